"""Rollout engines: prompts in, n sampled responses per prompt out, behind one interface.

The batch layout every later phase uses (B = prompts x n, P = longest prompt, R = longest response):

    input_ids       (B, P + R)  left-padded prompt, then the response padded on the right
    attention_mask  (B, P + R)  1 on real prompt and response tokens
    responses       (B, R)      response token ids (pad after the end)
    response_mask   (B, R)      1 up to and including the EOS token
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from backend.models import amp_context


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    greedy: bool = False


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor       # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    responses: torch.Tensor       # (B, R)
    response_mask: torch.Tensor   # (B, R)
    prompt_index: torch.Tensor    # (B,) which prompt of the input list each row answers
    finish_reasons: list[str]     # "stop" (EOS) or "length" (ran out of max_new_tokens)

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

    def position_ids(self) -> torch.Tensor:
        """Positions that skip the left padding, as generation used them."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> RolloutBatch:
        """Sample `params.n` responses for each prompt (token ids); rows of one prompt are adjacent.
        `progress(rows_done, rows_total, tokens_done, max_new_tokens)` is called as generation advances."""
        ...


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[torch.Tensor], width: int, pad_id: int) -> torch.Tensor:
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def response_mask_from_eos(responses: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, list[str]]:
    """Mask up to and including the first EOS; rows without one ran out of length."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = (~after_eos).long()
    finished = is_eos.any(-1).tolist()
    return mask, ["stop" if f else "length" for f in finished]


class HFGenerateEngine:
    """Hugging Face `generate` on the actor's own model object: colocated, so it samples with the
    weights of the latest update and holds no second copy of the model."""

    def __init__(self, model, tokenizer, batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_ids:
            self.eos_ids.append(tokenizer.eos_token_id)
        self.pad_id = tokenizer.pad_token_id

    def _config(self, params: SamplingParams):
        from transformers import GenerationConfig

        common = dict(max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        if params.greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                                top_k=params.top_k or None, **common)

    def _progress_criteria(self, progress, done: int, total: int, max_new_tokens: int):
        """A stopping criterion that never stops: it reports each decoding step, so a watcher sees
        generation advance token by token instead of waiting for a whole chunk."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Report(StoppingCriteria):
            def __init__(self):
                self.tokens = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.tokens += 1
                progress(done, total, self.tokens, max_new_tokens)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([Report()])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> RolloutBatch:
        device = next(self.model.parameters()).device
        rows = [p for p in prompts for _ in range(params.n)]
        prompt_index = torch.arange(len(prompts)).repeat_interleave(params.n)
        prompt_ids, prompt_mask = left_pad(rows, self.pad_id)
        config = self._config(params)
        was_training = self.model.training
        self.model.eval()
        chunks: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            ids = prompt_ids[start:start + self.batch_size].to(device)
            mask = prompt_mask[start:start + self.batch_size].to(device)
            criteria = None if progress is None else self._progress_criteria(
                progress, start, len(rows), params.max_new_tokens)
            with amp_context(device):
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                          stopping_criteria=criteria)
            chunks.extend(out[:, ids.shape[1]:].cpu())
        self.model.train(was_training)
        width = max(max(len(c) for c in chunks), 1)
        responses = right_pad(chunks, width, self.pad_id)
        response_mask, finish = response_mask_from_eos(responses, self.eos_ids)
        responses = responses.masked_fill(response_mask == 0, self.pad_id)
        return RolloutBatch(
            input_ids=torch.cat([prompt_ids, responses], dim=1),
            attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
            responses=responses,
            response_mask=response_mask,
            prompt_index=prompt_index,
            finish_reasons=finish,
        )
