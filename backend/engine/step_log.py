"""What a step leaves in the run directory besides its metrics line: the rollout table (one row per
sampled response) and the token view (per-token log-probs, KL, entropy, advantage and clipping of the
first responses), built and written on one thread off the step's path."""

from __future__ import annotations

import concurrent.futures
import json
import math
from collections.abc import Callable

import torch

from backend.rewards.scoring import ScoredBatch
from backend.rollout.base import RolloutBatch
from backend.rollout.episodes import Episode


class TableWriter:
    """Writes a step's tables (the rollouts and the token view: decoding, building, parquet) on one
    thread, in order, off the step's path: they are written while the next step generates."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tables")
        self._pending: list[tuple[int, concurrent.futures.Future]] = []

    def submit(self, step: int, write: Callable[[], object]) -> None:
        """Queue `write` for `step`, once every earlier step's writes are done (at most one step behind)."""
        self.wait(before_step=step)
        self._pending.append((step, self._pool.submit(write)))

    def wait(self, before_step: int | None = None) -> None:
        """Wait for the writes of the steps before `before_step` (all by default); raise what one raised."""
        waiting = [(s, f) for s, f in self._pending if before_step is None or s < before_step]
        self._pending = [(s, f) for s, f in self._pending if before_step is not None and s >= before_step]
        for _, future in waiting:
            future.result()

    def finish(self) -> None:
        """Let the queued writes end, without raising their errors: a stopped or failed run records its
        own end, and a run that succeeded has waited (and raised) before its last checkpoint."""
        concurrent.futures.wait([f for _, f in self._pending])
        self._pending = []



def rollout_rows(step: int, rows: list[dict], texts: list[str], scored: ScoredBatch,
                 advantages: torch.Tensor, batch: RolloutBatch, limit: int,
                 episodes: list[Episode] | None = None) -> dict[str, list]:
    """The rollouts/step_N.parquet table: one row per sampled response (first `limit`). An episode's row
    also holds its turns (JSON: each assistant turn with its tool calls, each observation), its prompt as
    rendered with the tools, and counts of turns, tool calls and failed calls; `response` is then the last
    assistant message (what the reward scored)."""
    n = min(limit, len(texts))
    lengths = batch.response_mask.sum(-1).tolist()
    mask = batch.response_mask.bool()
    part_names = sorted({k for p in scored.parts for k in p})
    out: dict[str, list] = {
        "step": [step] * n,
        "group": batch.prompt_index[:n].tolist(),
        "data_source": [r["data_source"] for r in rows[:n]],
        "index": [int(r["index"]) for r in rows[:n]],
        "prompt": [r["prompt_text"] for r in rows[:n]],
        "response": texts[:n],
        "ground_truth": [str(r["ground_truth"]) for r in rows[:n]],
        "pred": [p if p is None else str(p) for p in scored.preds[:n]],
        "reward": scored.scores[:n],
        "advantage": [float(advantages[i][mask[i]].mean()) if lengths[i] else 0.0 for i in range(n)],
        "response_length": [int(x) for x in lengths[:n]],
        "finish_reason": batch.finish_reasons[:n],
    }
    for name in part_names:
        out[f"reward_{name}"] = [float(p.get(name, math.nan)) for p in scored.parts[:n]]
    if episodes is not None:
        shown = episodes[:n]
        out["prompt"] = [e.prompt_text for e in shown]
        out["turns"] = [json.dumps(e.turns) for e in shown]
        out["num_turns"] = [e.assistant_turns + e.observation_turns for e in shown]
        out["tool_calls"] = [len(e.tool_calls()) for e in shown]
        out["tool_failures"] = [sum(c["failure"] is not None for c in e.tool_calls()) for e in shown]
        out["episode_error"] = [e.error for e in shown]
    return out



def token_rows(sample: dict[str, torch.Tensor], after: torch.Tensor, tokenizer, clip_low: float, clip_high: float
           ) -> dict[str, list]:
    """Per-token quantities of the sampled responses; `clipped` marks tokens whose ratio after the
    update (`after`: their log-probs then, (k, R)) lies outside the clip range in the direction the
    advantage pushes (where PPO stops). `sampled` is 0 on the tokens of an episode the policy did not
    write (observations), which carry no loss."""
    before, adv = sample["before_log_probs"], sample["advantages"]
    ratio = torch.exp(after - before)
    clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
    ref = sample.get("ref_log_probs")
    rows: dict[str, list] = {key: [] for key in ("row", "token_ids", "tokens", "log_prob", "ref_log_prob", "kl",
                                                 "entropy", "advantage", "clipped", "sampled")}
    width = sample["responses"].shape[1]
    for i in range(len(before)):
        n = int(sample["attention_mask"][i, -width:].sum())  # observations inside an episode included
        ids = sample["responses"][i, :n].tolist()
        rows["row"].append(i)
        rows["token_ids"].append(ids)
        rows["tokens"].append([tokenizer.decode([t]) for t in ids])
        rows["log_prob"].append(before[i, :n].tolist())
        rows["ref_log_prob"].append(ref[i, :n].tolist() if ref is not None else [None] * n)
        rows["kl"].append((before[i, :n] - ref[i, :n]).tolist() if ref is not None else [None] * n)
        rows["entropy"].append(sample["entropy"][i, :n].tolist())
        rows["advantage"].append(adv[i, :n].tolist())
        rows["clipped"].append(clipped[i, :n].tolist())
        rows["sampled"].append(sample["response_mask"][i, :n].bool().tolist())
    return rows

