"""Where the update's time goes: one worker in this process generates a batch, takes one update as a
warm-up (compilation), then a second under torch.profiler; prints the top operators by device time and
the share of the update the device was busy. With --generate, the same for generation, first timing
generations that free the engine's cache and graphs after each call (the default) against ones that
keep them (what re-capturing the graphs costs).

    python bench/profile_update.py configs/default.yaml [key=value ...] --device cuda --rows-note "..."

Use the same overrides as the benchmark (bench/perf_gpu.sh builds the workload model and prompts).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import reference_step  # noqa: E402

from backend import decode_attention  # noqa: E402
from backend.config import load_config, to_dict  # noqa: E402
from backend.rollout import SamplingParams  # noqa: E402
from backend.workers import ActorRolloutRefWorker  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--generate", action="store_true", help="profile generation as well")
    args = p.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    worker = ActorRolloutRefWorker(to_dict(cfg), 0, 1, "127.0.0.1", reference_step.free_port(), args.device,
                                   total_steps=3)
    batch = reference_step.rollout_batch(worker, cfg)
    if args.generate:
        profile_generation(worker, batch, args)
    rows = batch["responses"].shape[0]
    start = time.perf_counter()
    worker.update_actor(batch, mini_rows=rows)
    print(f"warm-up update: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    worker.update_actor(batch, mini_rows=rows)
    print(f"second update, not profiled: {time.perf_counter() - start:.2f} s")
    profiled("update", lambda: worker.update_actor(batch, mini_rows=rows), args)
    worker.shutdown()


def profiled(what: str, fn, args) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    if args.device == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        print(f"profiled {what}: {wall:.2f} s wall, device busy {busy:.2f} s ({100 * busy / wall:.0f}%)")


def profile_generation(worker: ActorRolloutRefWorker, batch: dict, args) -> None:
    cfg = worker.cfg
    n, width = cfg.actor_rollout_ref.rollout.n, batch["input_ids"].shape[1] - batch["responses"].shape[1]
    ids, mask = batch["input_ids"][::n, :width], batch["attention_mask"][::n, :width].bool()
    prompts = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
    params = SamplingParams(n=cfg.actor_rollout_ref.rollout.n, temperature=cfg.actor_rollout_ref.rollout.temperature,
                            max_new_tokens=cfg.data.max_response_length, seed=1, ignore_eos=True)
    engine = worker.rollout
    for kernel in sorted({False, engine.kernel_attention}, reverse=True):
        engine.kernel_attention = kernel
        for keep in (False, True):
            engine.free_after_generate = not keep
            engine.release()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                worker.generate(prompts, params, first_row=0)
                times.append(time.perf_counter() - start)
            print(f"generate, {'kernel' if kernel else 'torch'} attention, {'keeping' if keep else 'freeing'} "
                  "cache and graphs: " + ", ".join(f"{t:.2f}" for t in times) + " s")
    engine.kernel_attention = decode_attention.available(worker.device)
    engine.release()
    worker.generate(prompts, params, first_row=0)  # captures the graphs the profiled call replays
    profiled("generate (graphs kept)", lambda: worker.generate(prompts, params, first_row=0), args)
    engine.free_after_generate = True
    engine.release()


if __name__ == "__main__":
    main()
