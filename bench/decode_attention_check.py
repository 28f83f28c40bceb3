"""The decode-attention kernel on the GPU: bf16 against an fp32 reference, and its time against PyTorch's
masked attention over the same cache, at the workload's shape (Qwen3-0.6B: 8 KV heads, 2 query heads
each, head_dim 128) and several numbers of written slots. Prints a table, writes a JSON.

    python bench/decode_attention_check.py --out bench/results/<date>-h200-decode-attention.json

--kv-dtype fp8 runs it on an FP8 cache (rollout.kv_cache_dtype=fp8): the reference then attends to the same
FP8 values widened to fp32 (the kernel's error), a second one to the bf16 values before they were rounded (what
the rounding costs), and the read bandwidth counts one byte a value.

--sweep also times every kernel setting (loop form, slots per block, warps, pipeline stages) at every 32nd
number of written slots from 16 to --slots, each checked against the fp32 reference, and ranks them by their
mean over those lengths: a generation calls the kernel at every length in turn, so that mean is its average
call. --apply then writes the fastest (within bf16 tolerance) into backend/kernels/decode_attention.py's defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.kernels import decode_attention as kernel  # noqa: E402
from backend.kernels.decode_attention import decode_attention  # noqa: E402


def timed(fn, repeats: int = 20, calls: int = 20) -> float:
    """Median device milliseconds of one call of `fn`, replayed `calls` at a time from a CUDA graph, as the
    engine replays its decode step: launched one by one from Python, a call this short would time the launch."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernel and warms PyTorch's paths outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--slots", type=int, default=272)
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true", help="time every kernel setting")
    p.add_argument("--apply", action="store_true", help="with --sweep: make the fastest setting the default")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the cache's dtype")
    args = p.parse_args()
    torch.manual_seed(0)
    b, n_kv, g, d, slots = args.rows, 8, 2, 128, args.slots
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cache_dtype = kernel.FP8 if args.kv_dtype == "fp8" else dtype
    unrounded = [torch.randn(b, n_kv, slots, d, device=dev, dtype=dtype) for _ in range(2)]
    k_cache, v_cache = (t.to(cache_dtype) for t in unrounded)
    q = torch.randn(b, n_kv, g, d, device=dev, dtype=dtype)
    valid = torch.ones(b, slots, dtype=torch.bool, device=dev)
    valid[:, :8] = torch.rand(b, 8, device=dev) > 0.5  # left padding of the prompts
    valid[:, 8] = True
    rows = []
    for written in (16, 64, 136, 200, slots):
        slot = torch.tensor([written - 1], device=dev)
        # The newest slot's own key and value: the kernel writes them back where they already are.
        k_new, v_new = k_cache[:, :, written - 1], v_cache[:, :, written - 1]
        out = decode_attention(q, k_cache, v_cache, k_new, v_new, valid, slot)
        keys, values = k_cache[:, :, :written].float(), v_cache[:, :, :written].float()
        ref = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=valid[:, None, None, :written])
        bucket = min(slots, -(-written // 32) * 32)
        mask = (valid[:, :bucket] & (torch.arange(bucket, device=dev) < written)).view(b, 1, 1, bucket)
        kernel_ms = timed(lambda slot=slot, k_new=k_new, v_new=v_new: decode_attention(
            q, k_cache, v_cache, k_new, v_new, valid, slot))
        # (on an FP8 cache PyTorch's attention needs the bucket widened first, which it times too)
        torch_ms = timed(lambda bucket=bucket, mask=mask: F.scaled_dot_product_attention(
            q, k_cache[:, :, :bucket].to(dtype), v_cache[:, :, :bucket].to(dtype), attn_mask=mask))
        read_gb = 2 * b * n_kv * written * d * cache_dtype.itemsize / 1e9
        # What the cache's rounding costs: against attention over the bf16 values before they were stored.
        unrounded_ref = F.scaled_dot_product_attention(q.float(), unrounded[0][:, :, :written].float(),
                                                       unrounded[1][:, :, :written].float(),
                                                       attn_mask=valid[:, None, None, :written])
        rows.append({"written_slots": written, "max_abs_error_vs_fp32": (out.float() - ref).abs().max().item(),
                     "max_abs_error_vs_unrounded_bf16_cache": (out.float() - unrounded_ref).abs().max().item(),
                     "kernel_ms": kernel_ms, "torch_sdpa_bucket_ms": torch_ms,
                     "kernel_gb_per_s": read_gb / (kernel_ms / 1e3)})
    print(f"{'slots':>6} {'max err':>9} {'vs bf16':>9} {'kernel ms':>10} {'sdpa ms':>8} {'kernel GB/s':>12}")
    for r in rows:
        print(f"{r['written_slots']:>6} {r['max_abs_error_vs_fp32']:>9.2e} "
              f"{r['max_abs_error_vs_unrounded_bf16_cache']:>9.2e} {r['kernel_ms']:>10.3f} "
              f"{r['torch_sdpa_bucket_ms']:>8.3f} {r['kernel_gb_per_s']:>12.0f}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": b, "kv_heads": n_kv,
              "group": g, "head_dim": d, "kv_dtype": str(cache_dtype), "per_layer_call": rows,
              "defaults": {"pipelined": kernel.PIPELINED, "block": kernel.BLOCK_SLOTS, "num_warps": kernel.NUM_WARPS,
                           "num_stages": kernel.NUM_STAGES}}
    if args.sweep:
        result["sweep"] = sweep(q, k_cache, v_cache, valid, slots)
        if args.apply:
            result["applied"] = apply_fastest(result["sweep"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def sweep_lengths(slots: int) -> list[int]:
    """The numbers of written slots the sweep times: every 32nd from 16 up to `slots`, and `slots` itself."""
    return sorted({*range(16, slots + 1, 32), slots})


def sweep(q, k_cache, v_cache, valid, slots: int) -> list[dict]:
    settings = [(False, block, warps, 1) for block in (32, 64, 128) for warps in (4, 8)]
    settings += [(True, block, warps, stages) for block in (16, 32, 64, 128) for warps in (2, 4, 8)
                 for stages in (1, 2, 3, 4)]
    lengths = sweep_lengths(slots)
    refs = {written: F.scaled_dot_product_attention(q.float(), k_cache[:, :, :written].float(),
                                                    v_cache[:, :, :written].float(),
                                                    attn_mask=valid[:, None, None, :written])
            for written in lengths}
    out = []
    for pipelined, block, warps, stages in settings:
        row = {"pipelined": pipelined, "block": block, "num_warps": warps, "num_stages": stages, "ms": {}}
        try:
            err = 0.0
            for written in lengths:
                slot = torch.tensor([written - 1], device=q.device)
                call = functools.partial(decode_attention, q, k_cache, v_cache, k_cache[:, :, written - 1],
                                         v_cache[:, :, written - 1], valid, slot, block=block,
                                         num_warps=warps, num_stages=stages, pipelined=pipelined)
                err = max(err, (call().float() - refs[written]).abs().max().item())
                row["ms"][written] = timed(call)
            row["max_err"] = err
            row["mean_ms"] = sum(row["ms"].values()) / len(lengths)
        except Exception as e:  # a setting Triton cannot compile (too much shared memory) is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out.append(row)
        print(f"setting {len(out)}/{len(settings)}: {pipelined} {block} {warps} {stages}: "
              + (row["error"] if "error" in row else " ".join(f"{row['ms'][n]:.3f}" for n in lengths)), flush=True)
    out.sort(key=lambda r: r.get("mean_ms", float("inf")))
    shown = (lengths[0], lengths[len(lengths) // 2], lengths[-1])
    print(f"\n{'pipelined':>9} {'block':>5} {'warps':>5} {'stages':>6} "
          + " ".join(f"{'ms@' + str(n):>8}" for n in shown) + f" {'mean ms':>8} {'max err':>9}")
    for r in out:
        setting = f"{r['pipelined']!s:>9} {r['block']:>5} {r['num_warps']:>5} {r['num_stages']:>6}"
        if "error" in r:
            print(f"{setting} {r['error']}")
        else:
            print(f"{setting} " + " ".join(f"{r['ms'][n]:>8.3f}" for n in shown)
                  + f" {r['mean_ms']:>8.3f} {r['max_err']:>9.2e}")
    # Whether one setting serves every length: the best at each length on its own, against the best overall.
    ok = [r for r in out if "error" not in r]
    best_each = {n: min(ok, key=lambda r, n=n: r["ms"][n]) for n in lengths}
    print(f"\n{'slots':>6} {'best ms':>8} {'its setting':>28} {'the fastest overall, ms':>24}")
    for n, r in best_each.items():
        setting = f"{r['pipelined']!s} {r['block']} {r['num_warps']} {r['num_stages']}"
        print(f"{n:>6} {r['ms'][n]:>8.3f} {setting:>28} {ok[0]['ms'][n]:>24.3f}")
    return out


def apply_fastest(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r and r["max_err"] < 2e-2]
    best = min(ok, key=lambda r: r["mean_ms"])
    path = Path(kernel.__file__)
    text = path.read_text()
    for name, value in (("BLOCK_SLOTS", best["block"]), ("NUM_WARPS", best["num_warps"]),
                        ("NUM_STAGES", best["num_stages"]), ("PIPELINED", best["pipelined"])):
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", text, count=1, flags=re.M)
        assert n == 1, name
    path.write_text(text)
    print(f"\ndefaults now {best}")
    return best


if __name__ == "__main__":
    main()
