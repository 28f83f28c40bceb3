"""Where the update's time goes: one worker in this process generates a batch, takes one update as a
warm-up (compilation), then a second under torch.profiler; prints the top operators by device time and
by host time, and the share of the update the device was busy. Then the update's tail on its own (the
gradient norm and AdamW's step, and AdamW's fused step for comparison), and the reference pass under
the profiler. With --generate, the same for generation, first timing generations that free the engine's
cache and graphs after each call (the default) against ones that keep them (what re-capturing the graphs
costs). With --plain, the same micro-batches' forward and backward (and the reference's forward) on a
plain bf16 copy of the model with the same compiled layers and no FSDP: what FSDP's hooks cost on one GPU.
With --stop-at-eos, responses end at EOS (the realistic row) instead of running to full length.

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

from backend.algos.losses import agg_loss, kl_penalty  # noqa: E402
from backend.core.config import load_config, to_dict  # noqa: E402
from backend.core.models import load_model  # noqa: E402
from backend.engine import distributed  # noqa: E402
from backend.engine.log_probs import response_log_probs  # noqa: E402
from backend.engine.rank import COMPILED_WIDTH_MULTIPLE, MicroBatches  # noqa: E402
from backend.engine.workers import ActorRolloutRefWorker  # noqa: E402
from backend.kernels import decode_attention  # noqa: E402
from backend.rollout.base import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--generate", action="store_true", help="profile generation as well")
    p.add_argument("--plain", action="store_true", help="time the passes on a plain model without FSDP")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="responses end at EOS (the realistic row) instead of running to full length")
    args = p.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    worker = ActorRolloutRefWorker(to_dict(cfg), 0, 1, *distributed.local_meeting_point(), args.device,
                                   total_steps=3)
    batch = reference_step.rollout_batch(worker, cfg, ignore_eos=not args.stop_at_eos)
    lengths = batch["response_mask"].sum(-1).float()
    print(f"{len(lengths)} responses of {lengths.mean():.0f} tokens on average "
          f"({lengths.min():.0f}-{lengths.max():.0f})")
    if args.generate:
        profile_generation(worker, batch, args)
    rows = batch["responses"].shape[0]
    start = time.perf_counter()
    worker.update_actor(batch, mini_rows=rows)
    print(f"warm-up update: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    worker.update_actor(batch, mini_rows=rows)
    print(f"second update, not profiled: {time.perf_counter() - start:.2f} s")
    profiled("update", lambda: worker.update_actor(batch, mini_rows=rows), args, host_table=True)
    update_tail(worker)
    worker.compute_ref_log_prob(batch)
    profiled("reference log-probs", lambda: worker.compute_ref_log_prob(batch), args)
    if args.plain:
        plain_passes(worker, batch)
    worker.shutdown()


def timed(fn, repeats: int = 3) -> list[float]:
    """Wall seconds of each call, the device drained before and after."""
    times = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def update_tail(worker: ActorRolloutRefWorker) -> None:
    """The gradient norm and the optimizer step, each on its own (the update leaves its gradients)."""
    if worker.device.type != "cuda":
        return
    params = [p for p in worker.actor.parameters() if p.requires_grad]
    show = lambda t: ", ".join(f"{1000 * x:.1f}" for x in t) + " ms"  # noqa: E731
    print("gradient norm: " + show(timed(lambda: distributed.global_grad_norm(params, 1e9))))
    print("AdamW step (foreach): " + show(timed(worker.optimizer.step)))
    try:
        fused = torch.optim.AdamW(params, lr=1e-9, fused=True)
        print("AdamW step (fused): " + show(timed(fused.step)))
    except (RuntimeError, TypeError) as e:
        print(f"AdamW step (fused): not available here: {e}")


def plain_passes(worker: ActorRolloutRefWorker, batch: dict) -> None:
    """The update's forward and backward and the reference's forward on a plain bf16 model."""
    cfg = worker.cfg
    arr = cfg.actor_rollout_ref
    model = load_model(arr.model.path, worker.device, torch.bfloat16).train()
    for layer in distributed.decoder_layers(model):
        layer.forward = torch.compile(layer.forward)
    dev = {k: v.to(worker.device) for k, v in batch.items()}
    response_len = dev["responses"].shape[1]

    def split(rows: int):  # the worker's micro-batches: rows by length, each cut to its columns
        return MicroBatches(dev["attention_mask"], response_len, rows,
                            width_multiple=COMPILED_WIDTH_MULTIPLE).split(dev)

    def update() -> None:
        for mb, mb_response_len in split(arr.actor.ppo_micro_batch_size_per_gpu):
            lp, _ = response_log_probs(model, mb["input_ids"], mb["attention_mask"], mb_response_len,
                                       with_entropy=True, compiled=True)
            mask = mb["response_mask"].float()
            kl = kl_penalty(lp, mb["ref_log_probs"], "low_var_kl")
            loss = agg_loss(-mb["advantages"] * lp + 0.04 * kl, mask, "token-mean")
            loss.backward()

    @torch.no_grad()
    def reference() -> None:
        for mb, mb_response_len in split(arr.ref.log_prob_micro_batch_size_per_gpu):
            response_log_probs(model, mb["input_ids"], mb["attention_mask"], mb_response_len, compiled=True)

    show = lambda t: ", ".join(f"{x:.3f}" for x in t) + " s"  # noqa: E731
    print("plain bf16 model, no FSDP: update forward+backward " + show(timed(update)))
    print("plain bf16 model, no FSDP: reference forward " + show(timed(reference)))
    print("FSDP worker: update " + show(timed(lambda: worker.update_actor(batch, mini_rows=len(dev["responses"])))))
    print("FSDP worker: reference " + show(timed(lambda: worker.compute_ref_log_prob(batch))))


def profiled(what: str, fn, args, host_table: bool = False) -> None:
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
    if host_table:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=60))
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
