"""The decode-attention kernel on the GPU: bf16 against an fp32 reference, and its time against PyTorch's
masked attention over the same cache, at the workload's shape (Qwen3-0.6B: 8 KV heads, 2 query heads
each, head_dim 128) and several numbers of written slots. Prints a table, writes a JSON.

    python bench/decode_attention_check.py --out bench/results/<date>-h200-decode-attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.decode_attention import decode_attention  # noqa: E402


def timed(fn, repeats: int = 50) -> float:
    """Median milliseconds of `fn` over `repeats` runs, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--slots", type=int, default=272)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    b, n_kv, g, d, slots = args.rows, 8, 2, 128, args.slots
    dev, dtype = torch.device("cuda"), torch.bfloat16
    k_cache, v_cache = (torch.randn(b, n_kv, slots, d, device=dev, dtype=dtype) for _ in range(2))
    q = torch.randn(b, n_kv, g, d, device=dev, dtype=dtype)
    valid = torch.ones(b, slots, dtype=torch.bool, device=dev)
    valid[:, :8] = torch.rand(b, 8, device=dev) > 0.5  # left padding of the prompts
    valid[:, 8] = True
    rows = []
    for written in (16, 64, 136, 200, slots):
        slot = torch.tensor([written - 1], device=dev)
        out = decode_attention(q, k_cache, v_cache, valid, slot)
        keys, values = k_cache[:, :, :written].float(), v_cache[:, :, :written].float()
        ref = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=valid[:, None, None, :written])
        bucket = min(slots, -(-written // 32) * 32)
        mask = (valid[:, :bucket] & (torch.arange(bucket, device=dev) < written)).view(b, 1, 1, bucket)
        kernel_ms = timed(lambda slot=slot: decode_attention(q, k_cache, v_cache, valid, slot))
        torch_ms = timed(lambda bucket=bucket, mask=mask: F.scaled_dot_product_attention(
            q, k_cache[:, :, :bucket], v_cache[:, :, :bucket], attn_mask=mask))
        read_gb = 2 * b * n_kv * written * d * 2 / 1e9
        rows.append({"written_slots": written, "max_abs_error_vs_fp32": (out.float() - ref).abs().max().item(),
                     "kernel_ms": kernel_ms, "torch_sdpa_bucket_ms": torch_ms,
                     "kernel_gb_per_s": read_gb / (kernel_ms / 1e3)})
    print(f"{'slots':>6} {'max err':>9} {'kernel ms':>10} {'sdpa ms':>8} {'kernel GB/s':>12}")
    for r in rows:
        print(f"{r['written_slots']:>6} {r['max_abs_error_vs_fp32']:>9.2e} {r['kernel_ms']:>10.3f} "
              f"{r['torch_sdpa_bucket_ms']:>8.3f} {r['kernel_gb_per_s']:>12.0f}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": b, "kv_heads": n_kv,
              "group": g, "head_dim": d, "per_layer_call": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
