"""Answering prompts and scoring a model on a data file, for any model: a shipped name, a run's export
or checkpoint, a local folder. The CLI's `generate` and `eval`, the Python API and the trainer's own
`generate`/`evaluate` all come through here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backend.core import data
from backend.engine.evaluation import EvalResult
from backend.engine.evaluation import evaluate as _evaluate_items
from backend.rollout.base import HFGenerateEngine, RolloutEngine, SamplingParams


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A user message through the tokenizer's chat template (plain text when it has none)."""
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


class Generator:
    """A rollout engine and its tokenizer ready to answer prompts and to be scored on data files."""

    def __init__(self, engine: RolloutEngine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    def generate(self, prompts: list[str], *, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, max_new_tokens: int = 128, seed: int = 0) -> list[list[str]]:
        """n answers per prompt (temperature 0 = greedy); one list per prompt. Sampled answers depend only
        on the seed, the prompt and its place in the list."""
        params = SamplingParams(n=n, temperature=temperature or 1.0, top_p=top_p, top_k=top_k,
                                max_new_tokens=max_new_tokens, greedy=temperature == 0, seed=seed)
        batch = self.engine.generate([chat_prompt_ids(self.tokenizer, p) for p in prompts], params)
        texts = self.tokenizer.batch_decode(batch.responses * batch.response_mask, skip_special_tokens=True)
        return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]

    def evaluate(self, data_file: str | Path, *, limit: int = 0, max_new_tokens: int = 128,
                 max_prompt_length: int = 512, batch_size: int = 32, custom_fn: Callable | None = None,
                 gsm8k_scorer: str = "verl", timeout_s: float = 10.0,
                 progress: Callable[[int, int], None] | None = None) -> EvalResult:
        """Greedy accuracy on a parquet file, each answer scored by its data source's reward (GSM8K rows by
        the rule `gsm8k_scorer` names)."""
        rows = data.load_rows(data_file)
        if limit:
            rows = rows[:limit]
        dataset = data.PromptDataset(rows, self.tokenizer, max_prompt_length, truncation="left",
                                     source=str(data_file))
        items = [dataset[i] for i in range(len(dataset))]
        return _evaluate_items(self.engine, self.tokenizer, items, max_new_tokens, custom_fn=custom_fn,
                               gsm8k_scorer=gsm8k_scorer, timeout_s=timeout_s, batch_size=batch_size,
                               progress=progress)


def load_generator(model: str, device: str = "auto", batch_size: int = 32) -> Generator:
    from backend.core.models import load_model, load_tokenizer, pick_device

    tokenizer = load_tokenizer(model)
    return Generator(HFGenerateEngine(load_model(model, pick_device(device)), tokenizer, batch_size), tokenizer)


def generate(model: str, prompts: str | list[str], *, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
             max_new_tokens: int = 128, device: str = "auto", seed: int = 0) -> list[list[str]]:
    """Answer prompts with any model (shipped name, run export or checkpoint, local folder, Hub id)."""
    prompts = [prompts] if isinstance(prompts, str) else prompts
    return load_generator(model, device).generate(prompts, n=n, temperature=temperature, top_p=top_p,
                                                  max_new_tokens=max_new_tokens, seed=seed)


def evaluate(model: str, data_file: str | Path, *, limit: int = 0, max_new_tokens: int = 128,
             batch_size: int = 32, device: str = "auto",
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Greedy accuracy of any model on a parquet file, scored by the data set's own reward."""
    return load_generator(model, device, batch_size).evaluate(data_file, limit=limit, max_new_tokens=max_new_tokens,
                                                              batch_size=batch_size, progress=progress)
