"""Greedy evaluation: generate one answer per prompt and score it with the data set's own reward.

The same harness serves validation inside a run, `python -m backend eval`, and later the UI."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from backend.rewards.scoring import score_batch
from backend.rollout.base import RolloutEngine, SamplingParams
from backend.rollout.episodes import Episode


@dataclass
class EvalResult:
    metrics: dict[str, float]  # val/<data_source>/accuracy, val/<data_source>/score, val/accuracy
    records: list[dict]        # one per prompt: prompt, response, ground truth, score, correct, finish reason


def is_correct(score: float, parts: dict[str, float]) -> bool:
    """A scorer's own `correct` part when it gives one; otherwise full marks (score >= 1) count."""
    return bool(parts["correct"]) if "correct" in parts else score >= 1.0


def evaluate(engine: RolloutEngine, tokenizer, items: list[dict], max_new_tokens: int, *,
             custom_fn: Callable | None = None, gsm8k_scorer: str = "verl", timeout_s: float = 10.0,
             batch_size: int = 32, progress: Callable[[int, int], None] | None = None,
             episodes: Callable[[list[dict], SamplingParams], list[Episode]] | None = None) -> EvalResult:
    """Greedy answers for `items` (PromptDataset items) scored per data source; GSM8K rows by the rule
    `gsm8k_scorer` names (reward.gsm8k_scorer: "verl" or "lenient"). With `episodes` (multi-turn runs),
    each item is a greedy episode scored on its last assistant message, and the metrics add how many
    episodes made a tool call that answered (val/tool_call_rate)."""
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, greedy=True)
    records: list[dict] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        if episodes is None:
            batch = engine.generate([it["prompt_ids"] for it in chunk], params)
            texts = tokenizer.batch_decode(batch.responses * batch.response_mask, skip_special_tokens=True)
            finishes, lengths = batch.finish_reasons, batch.response_mask.sum(-1).tolist()
            extra = [{} for _ in chunk]
        else:
            done = episodes(chunk, params)
            texts = [e.last_assistant_text() for e in done]
            finishes, lengths = [e.finish_reason for e in done], [len(e.ids) for e in done]
            extra = [{"turns": e.turns, "tool_called": any(c["failure"] is None for c in e.tool_calls())}
                     for e in done]
        scored = score_batch([it["data_source"] for it in chunk], texts,
                             [it["ground_truth"] for it in chunk], [it["extra_info"] for it in chunk],
                             custom_fn=custom_fn, gsm8k_scorer=gsm8k_scorer, timeout_s=timeout_s)
        for it, text, score, parts, pred, finish, length, more in zip(
                chunk, texts, scored.scores, scored.parts, scored.preds, finishes, lengths, extra, strict=True):
            records.append({"data_source": it["data_source"], "prompt": it["prompt_text"], "response": text,
                            "ground_truth": it["ground_truth"], "pred": pred, "score": score,
                            "correct": is_correct(score, parts), "finish_reason": finish,
                            "response_length": length, **more})
        if progress is not None:
            progress(len(records), len(items))
    return EvalResult(metrics=summarize(records), records=records)


def summarize(records: list[dict]) -> dict[str, float]:
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_source[r["data_source"]].append(r)
    metrics: dict[str, float] = {}
    for source, rs in sorted(by_source.items()):
        metrics[f"val/{source}/accuracy"] = sum(r["correct"] for r in rs) / len(rs)
        metrics[f"val/{source}/score"] = sum(r["score"] for r in rs) / len(rs)
    if records:
        metrics["val/accuracy"] = sum(r["correct"] for r in records) / len(records)
        metrics["val/response_length/mean"] = sum(r["response_length"] for r in records) / len(records)
    if records and "tool_called" in records[0]:
        metrics["val/tool_call_rate"] = sum(r["tool_called"] for r in records) / len(records)
    return metrics
