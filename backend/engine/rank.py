"""What every rank worker shares (the actor and the critic): micro-batching, moving a batch to the
device, per-phase memory peaks, torch.compile's work, the learning-rate schedule, heap freezing, and the calls the
controller makes on any rank while another call runs."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import socket
import sys
import threading
import traceback
from pathlib import Path

import ray
import torch

Batch = dict[str, torch.Tensor]

# Compiled layers specialise on whether a micro-batch's width is a multiple of 8 (a guard seen with the flash
# attention kernel), so cuts of any width compile the layers twice, the second time inside a counted step;
# widths that are all multiples of 8 compile once, for at most 7 columns of padding a micro-batch. That holds
# for the batch's widest cut too, which pads past the batch where the batch's own width is not a multiple
# (its own graph otherwise: another compilation in every run's first step). Layers that are not compiled
# (CPUs) take cuts as they are.
COMPILED_WIDTH_MULTIPLE = 8


class MicroBatches:
    """How a batch's rows split into micro-batches, and each cut to the columns its rows use.

    Rows go longest first (prompt and response, padding left out), so a micro-batch holds rows of similar
    length and is cut from the first column any of its prompts uses to the end of its longest response: the
    padding a batch carries for its longest row is neither computed nor kept for backward in the others.
    Each micro-batch holds `rows` rows, or with `max_tokens` (verl's use_dynamic_bsz) as many as fit in
    that many positions once cut, which bounds a pass's activations whatever the responses' lengths.
    A cut is widened to a multiple of `width_multiple` columns (left into the prompts' padding first, then
    right into the responses', then past the batch's last column with columns of padding).
    `at_least`: the fewest micro-batches (ranks that gather the model layer by layer run their collectives
    once per micro-batch, so they must all run as many). Every row's loss counts the same in whichever
    micro-batch it falls (the losses divide by the step's counts), so the order changes no result beyond
    float rounding.
    """

    def __init__(self, attention_mask: torch.Tensor, response_len: int, rows: int, max_tokens: int | None = None,
                 at_least: int = 1, width_multiple: int = 1):
        mask = attention_mask.cpu()
        self.width_multiple = width_multiple
        self.columns = mask.shape[1]
        self.prompt_width = self.columns - response_len
        prompt = mask[:, :self.prompt_width].sum(-1)
        response = mask[:, self.prompt_width:].sum(-1).clamp(min=1)
        self.order = (prompt + response).argsort(descending=True, stable=True)
        self._prompt, self._response = prompt[self.order].tolist(), response[self.order].tolist()
        self.spans: list[tuple[int, int]] = []  # [first, end) of each micro-batch in the sorted rows
        first, n = 0, len(self._prompt)
        while first < n:
            end = first + 1
            while end < n and (end + 1 - first <= rows if max_tokens is None
                               else (end + 1 - first) * self._width(first, end + 1) <= max_tokens):
                end += 1
            self.spans.append((first, end))
            first = end
        while len(self.spans) < min(at_least, n):
            first, end = max(self.spans, key=lambda s: s[1] - s[0])
            i = self.spans.index((first, end))
            middle = (first + end) // 2
            self.spans[i:i + 1] = [(first, middle), (middle, end)]

    def _width(self, first: int, end: int) -> int:
        used = max(self._prompt[first:end]) + max(self._response[first:end])
        return -(-used // self.width_multiple) * self.width_multiple

    def __len__(self) -> int:
        return len(self.spans)

    def split(self, batch: Batch):
        """Each micro-batch of `batch` (its rows in this order, on any device) and its response length:
        input_ids and attention_mask cut to the micro-batch's columns, every other tensor of two or more
        dimensions (the response-shaped ones) to its response length. Columns a cut takes past the batch's
        last are zeros (attention mask 0)."""
        order = self.order.to(next(iter(batch.values())).device)
        ordered = {k: v[order] for k, v in batch.items()}
        for first, end in self.spans:
            start = self.prompt_width - max(self._prompt[first:end])
            response_len = max(self._response[first:end])
            wider = self._width(first, end) - (self.prompt_width - start + response_len)
            left = min(wider, start)  # into the prompts' padding first, the rest past the responses
            start, response_len = start - left, response_len + wider - left
            stop = self.prompt_width + response_len
            yield {k: _widened(v[first:end, start:stop], stop - start) if k in ("input_ids", "attention_mask")
                   else _widened(v[first:end, :response_len], response_len) if v.dim() > 1 else v[first:end]
                   for k, v in ordered.items()}, response_len

    def join(self, parts: list[torch.Tensor], response_len: int) -> torch.Tensor:
        """The micro-batches' (rows, their response length) outputs as one (batch rows, response_len)
        tensor in the batch's order, 0 past each row's response (whichever micro-batch it fell in); a part
        widened past the batch is cut back to response_len (a negative pad)."""
        if not parts:
            return torch.empty(0, response_len)
        out = torch.cat([torch.nn.functional.pad(p, (0, response_len - p.shape[1])) for p in parts])
        inside = torch.arange(response_len) < torch.tensor(self._response)[:, None]
        return torch.where(inside.to(out.device), out, 0.0)[self.order.argsort().to(out.device)]


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (rows, columns, ...) with columns of zeros appended up to `width`."""
    if t.shape[1] >= width:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1], *t.shape[2:])], dim=1)


def micro_batches_on_ranks(attention_mask: torch.Tensor, response_len: int, rows: int, max_tokens: int | None,
                           world_size: int, device: torch.device, width_multiple: int = 1) -> MicroBatches:
    """MicroBatches, as many on every rank: with several ranks the model is gathered layer by layer, so each
    micro-batch runs collectives, and a rank running fewer would leave the others waiting. Called on every
    rank at once when micro-batches are by tokens (by rows, equal row counts make equal counts)."""
    plan = MicroBatches(attention_mask, response_len, rows, max_tokens, width_multiple=width_multiple)
    if max_tokens is None or world_size == 1:
        return plan
    count = torch.tensor(len(plan), device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return MicroBatches(attention_mask, response_len, rows, max_tokens, at_least=int(count),
                        width_multiple=width_multiple)


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
        """Records the phase's peaks; an allocation failure inside it leaves with `memory`: the phase and what
        the device held (held_at_failure)."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        except BaseException as e:
            if out_of_memory(e):
                e.memory = held_at_failure(name, self.device)
            raise
        if on_gpu:
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


class CompileLedger:
    """torch.compile's work in this process since the last `take`: seconds compiling and graphs compiled. A
    step that compiles (the first, or one whose shapes its graphs do not cover) is slower by that much, which
    its phase times alone cannot tell apart from a slow step. Read from dynamo's own records; a process that
    never imported dynamo compiled nothing, and reading them must not import it (about a second)."""

    def __init__(self):
        self.seconds, self.graphs = self._totals()

    @staticmethod
    def _totals() -> tuple[float, int]:
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return 0.0, 0
        times = utils.compilation_time_metrics.get("_compile.compile_inner", [])
        return sum(times), utils.counters["stats"]["unique_graphs"]

    def take(self) -> dict[str, float]:
        """perf/compile_s and perf/compiled_graphs since the last call; then starts afresh."""
        seconds, graphs = self._totals()
        out = {"perf/compile_s": float(seconds - self.seconds), "perf/compiled_graphs": float(graphs - self.graphs)}
        self.seconds, self.graphs = seconds, graphs
        return out


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation failure: CUDA's, Python's, or the CPU allocator's (a RuntimeError in torch)."""
    return isinstance(e, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(e)


def held_at_failure(phase: str, device: torch.device) -> dict:
    """What a phase that ran out of memory held: on a GPU its peaks since the phase began (the failed
    allocation not included) and the device's total and free memory, in GiB."""
    held: dict = {"phase": phase, "device": device.type}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        held.update(gpu=torch.cuda.get_device_name(), peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, device_gib=total / 2**30,
                    free_gib=free / 2**30)
    return held


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
                "ip": node_ip(), "device": str(self.device),
                "deterministic": torch.are_deterministic_algorithms_enabled()}

    @ray.method(concurrency_group="monitor")
    def progress(self) -> tuple:
        return self._progress

    @ray.method(concurrency_group="monitor")
    def stacks(self) -> dict:
        """Where every Python thread of this process is now, for a hang's diagnosis: answered on the monitor
        thread while a call runs (a collective waits with the interpreter's lock released)."""
        text, at = python_stacks()
        # Not where(): a CPU rank that is still being built (its start-up call) has no rank or device yet.
        return {"pid": os.getpid(), "host": socket.gethostname(), "progress": list(self._progress), "stacks": text,
                "at": at}

    def _report(self, *state) -> None:
        self._progress = state

    def freeze_heap(self) -> int:
        return freeze_heap()


def use_deterministic_algorithms() -> None:
    """Make this process's torch work repeat bit for bit (trainer.deterministic). Called before its first CUDA
    work: cuBLAS reads its workspace setting when it starts. PyTorch's deterministic mode picks the attention
    backward without atomic adds and raises on an operation that has no deterministic form (rather than varying
    silently); Inductor's deterministic mode drops the choices it makes by timing kernels, which can differ from
    one process to the next."""
    import torch._inductor.config

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch._inductor.config.deterministic = True


def python_stacks(skip_current: bool = True) -> tuple[str, str]:
    """Every thread's Python stack in this process, innermost call last: threads that run our code in full,
    the others (Ray's, torch's) by name; and in a line, where the innermost of ours is (`collective` names the
    torch.distributed call it waits in). `skip_current` leaves out the thread asking."""
    names = {t.ident: t.name for t in threading.enumerate()}
    ours, others, where = [], [], ""
    for ident, frame in sys._current_frames().items():
        if skip_current and ident == threading.get_ident():
            continue
        summary = traceback.extract_stack(frame)
        if ident == threading.get_ident():
            summary = summary[:-1]  # this function
        mine = [f for f in summary if f"{os.sep}backend{os.sep}" in f.filename]
        if not mine:
            others.append(str(names.get(ident, ident)))
            continue
        ours.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_list(summary)))
        inner = mine[-1]
        where = f"{Path(inner.filename).name}:{inner.lineno} in {inner.name}"
        collective = [f for f in summary if f"torch{os.sep}distributed" in f.filename]
        if collective:
            where += f", inside torch.distributed's {collective[-1].name}"
    text = "\n".join(ours) + (f"\n--- other threads: {', '.join(others)}\n" if others else "")
    return text, where


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
    """Every rank's marked rows as one, in mark order, each row once: with several epochs of shuffled mini-batches
    a row can fall to more than one rank, and each reports it (the same weights after the update)."""
    parts = [p for p in parts if p is not None and len(p.rows)]
    if not parts:
        return None
    rows = torch.cat([p.rows for p in parts])
    order = rows.argsort(stable=True)
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = rows[order][1:] != rows[order][:-1]
    order = order[first]
    one_step = all(p.before is not None for p in parts)
    return MarkedRows(rows[order], torch.cat([p.after for p in parts])[order],
                      torch.cat([p.before for p in parts])[order] if one_step else None,
                      torch.cat([p.entropy for p in parts])[order] if one_step else None)
