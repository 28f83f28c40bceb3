"""A reward model worker: a Hugging Face sequence-classification model with one output scores each
(prompt, response) pair, as verl's RewardModelWorker and TRL's reward_funcs with a model do.

The pair is written with the reward model's own chat template (the prompt's messages, then the response
as the assistant's turn), so a model trained on chats reads what it was trained on; a tokenizer without a
template gets the prompt's text and the response joined. The model's output at the last real token is the
score. It only runs forward, so each rank holds a whole copy in the compute dtype (bf16 on GPUs, fp32 on
CPU) and scores its own share of the rows without talking to the other ranks.
"""

from __future__ import annotations

import torch

from backend.core.models import resolve_model
from backend.engine import distributed


def load_reward_model(name_or_path: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of a one-output sequence-classification model, in eval mode on `device`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = resolve_model(name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Sequence classification reads the last token that is not padding; it must know which id that is.
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def pair_texts(tokenizer, messages: list[list[dict]], responses: list[str]) -> list[str]:
    """Each prompt's messages with its response as the assistant's turn, as the reward model reads them."""
    if tokenizer.chat_template:
        return [tokenizer.apply_chat_template([*m, {"role": "assistant", "content": r}], tokenize=False)
                for m, r in zip(messages, responses, strict=True)]
    return ["\n".join(x["content"] for x in m) + "\n" + r for m, r in zip(messages, responses, strict=True)]


class RewardModelWorker:
    """One rank's reward model. `device` is "cuda" (the GPU Ray gave this process) or "cpu"."""

    def __init__(self, path: str, micro_batch_size: int, param_dtype: str, device: str, max_length: int):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.model, self.tokenizer = load_reward_model(path, self.device,
                                                       distributed.param_dtype(param_dtype, self.device))
        self.micro_batch_size, self.max_length = micro_batch_size, max_length

    @torch.no_grad()
    def score(self, messages: list[list[dict]], responses: list[str]) -> list[float]:
        """The reward model's score of each (prompt messages, response) pair, in order."""
        texts = pair_texts(self.tokenizer, messages, responses)
        out: list[float] = []
        for start in range(0, len(texts), self.micro_batch_size):
            enc = self.tokenizer(texts[start:start + self.micro_batch_size], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length, add_special_tokens=False)
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits  # (b, 1)
            out.extend(logits[:, 0].float().cpu().tolist())
        return out

    def where(self) -> dict:
        return {"device": str(self.device)}
