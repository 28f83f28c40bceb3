"""What every rank worker shares (the actor and the critic): micro-batching, moving a batch to the
device, per-phase memory peaks, the learning-rate schedule, heap freezing, and the calls the
controller makes on any rank while another call runs."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import socket

import ray
import torch

Batch = dict[str, torch.Tensor]


def micro_batches(batch: Batch, size: int):
    n = next(iter(batch.values())).shape[0]
    for start in range(0, n, size):
        yield {k: v[start:start + size] for k, v in batch.items()}


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The whole batch on the device in one go, before its micro-batches run: a copy from ordinary
    (pageable) host memory waits for the device to finish its queued work, so one per micro-batch
    would stop the host from queueing the next micro-batch while the device runs this one."""
    return {k: v.to(device) for k, v in batch.items()}


class PeakMemory:
    """Each phase's peak GPU memory in this process, in GiB (nothing is recorded on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: dict[str, tuple[float, float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.reset_peak_memory_stats()
        yield
        self.peaks[name] = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)

    def take(self, overall: bool) -> dict[str, float]:
        """perf/max_memory_{allocated,reserved}_gb/<phase> since the last call, and with `overall` the
        largest over the phases under perf/max_memory_{allocated,reserved}_gb; then starts afresh."""
        out: dict[str, float] = {}
        for name, (allocated, reserved) in self.peaks.items():
            out[f"perf/max_memory_allocated_gb/{name}"] = allocated
            out[f"perf/max_memory_reserved_gb/{name}"] = reserved
        if overall and self.peaks:
            out["perf/max_memory_allocated_gb"] = max(a for a, _ in self.peaks.values())
            out["perf/max_memory_reserved_gb"] = max(r for _, r in self.peaks.values())
        self.peaks = {}
        return out


def lr_lambda(warmup: int, total: int, style: str, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if style == "cosine" and total > warmup:
            progress = min((step - warmup) / (total - warmup), 1.0)
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return f


def freeze_heap() -> int:
    """Collect once, then move every object still alive into the collector's permanent generation;
    returns how many are there. After the first step a worker holds hundreds of thousands of long-lived
    objects (torch, transformers, compiled graphs) that every full collection would walk again, a pause
    some steps then pay. Frozen objects are never collected as cycles (reference counting still frees
    them); garbage made later is collected as before, walking only the objects made later."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class RankWorker:
    """What the controller reads of any rank while a call runs: where it is and how far it got. A
    subclass sets rank, device and _progress."""

    rank: int
    device: torch.device
    _progress: tuple = ()

    @ray.method(concurrency_group="monitor")
    def where(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "ip": node_ip(), "device": str(self.device)}

    @ray.method(concurrency_group="monitor")
    def progress(self) -> tuple:
        return self._progress

    def _report(self, *state) -> None:
        self._progress = state

    def freeze_heap(self) -> int:
        return freeze_heap()


def node_ip() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def step_counts(response_mask: torch.Tensor, rows_per_step: int) -> list[tuple[float, float]]:
    """(valid tokens, non-empty responses) of each optimizer step's rows, in order: what the update's losses
    divide by (num_tokens and num_seqs of algos.losses.agg_loss). Given all of a step's rows, over every rank."""
    return [(float(m.sum()), float((m.sum(-1) > 0).sum())) for m in response_mask.split(rows_per_step)]


@dataclasses.dataclass
class MarkedRows:
    """What the actor's update computed for the rows marked with `token_row` (the token view's), in mark
    order: the marks (k,), their log-probs under the updated weights (k, R), and, when the update was one
    optimizer step, the log-probs and entropies of its forward, which were the rows' values before it
    (k, R each; None otherwise: the old log-probs pass has them then)."""

    rows: torch.Tensor
    after: torch.Tensor
    before: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def concat_marked(parts: list[MarkedRows | None]) -> MarkedRows | None:
    """Every rank's marked rows as one, in mark order."""
    parts = [p for p in parts if p is not None and len(p.rows)]
    if not parts:
        return None
    rows = torch.cat([p.rows for p in parts])
    order = rows.argsort()
    one_step = all(p.before is not None for p in parts)
    return MarkedRows(rows[order], torch.cat([p.after for p in parts])[order],
                      torch.cat([p.before for p in parts])[order] if one_step else None,
                      torch.cat([p.entropy for p in parts])[order] if one_step else None)
