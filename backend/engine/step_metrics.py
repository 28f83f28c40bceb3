"""A step's numbers: phase timings, verl's data metrics (score, reward, advantage, length statistics) and
the one-line console summary."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from backend.rollout.base import RolloutBatch


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = timings.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}



def batch_metrics(batch: RolloutBatch, scores: torch.Tensor, token_level_rewards: torch.Tensor,
                  advantages: torch.Tensor, returns: torch.Tensor, group_ids: torch.Tensor,
                  max_response_length: int) -> dict[str, float]:
    """verl's data metrics: score, reward, advantage, return and length statistics of one step."""
    mask = batch.response_mask.bool()
    # Every token after the prompt, an episode's observations too (verl's response_length).
    lengths = batch.attention_mask[:, batch.prompt_length:].sum(-1)
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(-1)
    m = {}
    m.update(stats("critic/score", scores))
    m.update(stats("critic/rewards", token_level_rewards.sum(-1)))
    m.update(stats("critic/advantages", advantages[mask]))
    m.update(stats("critic/returns", returns[mask]))
    m.update(stats("response_length", lengths))
    m["response_length/clip_ratio"] = (lengths >= max_response_length).float().mean().item()
    m.update(stats("prompt_length", prompt_lengths))
    groups = [scores[group_ids == g] for g in group_ids.unique()]
    m["batch/zero_spread_groups"] = sum(bool((g == g[0]).all()) for g in groups) / len(groups)
    m["batch/solve_all"] = sum(bool((g >= 1).all()) for g in groups) / len(groups)
    m["batch/solve_none"] = sum(bool((g <= 0).all()) for g in groups) / len(groups)
    return m


def summary_line(m: dict, total: int) -> str:
    """One line per step for the console."""
    def g(key: str, fmt: str = ".3f") -> str:
        v = m.get(key)
        return "-" if v is None else format(v, fmt)
    line = (f"step {m['step']}/{total} | score {g('critic/score/mean')} | kl {g('actor/kl_loss', '.4f')} | "
            f"pg_loss {g('actor/pg_loss', '.4f')} | len {g('response_length/mean', '.1f')} | "
            f"gen {g('timing_s/gen', '.1f')}s | step {g('timing_s/step', '.1f')}s")
    if "val/accuracy" in m:
        line += f" | val acc {g('val/accuracy')}"
    return line


