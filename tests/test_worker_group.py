"""How the group starts its ranks: CPU ranks built by a call on the thread their calls run on, with allocator
settings that keep their memory mapped; GPU ranks with the caching allocator's expandable segments."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

from backend.core.config import load_config
from backend.engine.rank import MarkedRows, concat_marked
from backend.engine.worker_group import CPU_MALLOC_TUNABLES, _rank_class, gpu_rank_env


class Built:
    def __init__(self, *args):
        self.args, self.thread = args, threading.get_ident()

    def where(self) -> dict:
        return {"args": self.args, "thread": self.thread}


def test_a_cpu_rank_is_built_by_its_start_call_on_that_calls_thread_and_a_gpu_rank_by_its_constructor():
    rank = _rank_class(Built, built_by_start=True)(1, 2)
    assert not hasattr(rank, "thread")  # the constructor kept the arguments only
    got: list[dict] = []
    caller = threading.Thread(target=lambda: got.append(rank.start()))
    caller.start()
    caller.join()
    assert got == [{"args": (1, 2), "thread": caller.ident}]
    gpu = _rank_class(Built, built_by_start=False)(3)
    assert gpu.thread == threading.get_ident() and gpu.start() == {"args": (3,), "thread": threading.get_ident()}
    assert _rank_class(Built, built_by_start=True).__name__ == "Built"  # Ray's logs name the rank's own class


def test_a_deterministic_rank_switches_its_process_to_deterministic_algorithms_before_it_is_built(monkeypatch):
    class Checks(Built):
        def __init__(self, *args):
            super().__init__(*args)
            self.mode = torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        assert _rank_class(Checks, built_by_start=False, deterministic=False)(1).mode == (False, None)
        assert _rank_class(Checks, built_by_start=False, deterministic=True)(1).mode == (True, ":4096:8")
    finally:
        torch.use_deterministic_algorithms(False)
        torch._inductor.config.deterministic = False


FAULTS = """
import resource, threading, torch
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        a, b = torch.ones(12 * 2**20), torch.ones(12 * 2**20)  # 48 MiB each, written and freed
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
out = []
t = threading.Thread(target=lambda: out.extend([faults(), faults()]))  # a rank's calls run on a thread
t.start(); t.join()
print(out[1])
"""


def test_the_cpu_ranks_allocator_settings_keep_a_freed_block_mapped_for_the_next_one():
    def faults(env: dict) -> int:
        run = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
        return int(run.stdout)

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    # 40 blocks of 48 MiB are 491,520 pages of 4 KiB: faulted in again each time by default, not at all
    # the second time round with the settings
    assert faults(plain) > 400_000
    assert faults({**plain, "GLIBC_TUNABLES": CPU_MALLOC_TUNABLES}) < 1_000


def test_gpu_ranks_use_expandable_segments_unless_vllm_generates_or_the_user_set_the_allocator(monkeypatch):
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config("configs/default.yaml")
    assert gpu_rank_env(cfg) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    assert gpu_rank_env(cfg) == {}
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    cfg.actor_rollout_ref.rollout.name = "vllm"  # (a config naming vLLM validates only where vLLM is installed)
    assert gpu_rank_env(cfg) == {}  # vLLM's sleep mode refuses expandable segments


def test_a_marked_row_two_ranks_report_after_shuffled_epochs_appears_once_in_mark_order():
    """With two epochs of shuffled mini-batches, mark 0 fell to rank 0 in one epoch and to rank 1 in the other."""
    rank0 = MarkedRows(torch.tensor([2, 0]), torch.tensor([[2.0], [0.0]]))
    rank1 = MarkedRows(torch.tensor([0, 1]), torch.tensor([[0.0], [1.0]]))
    merged = concat_marked([rank0, rank1])
    assert merged.rows.tolist() == [0, 1, 2]
    assert merged.after[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert merged.before is None and merged.entropy is None
