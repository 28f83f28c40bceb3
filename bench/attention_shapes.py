"""PyTorch's attention backends on the training passes' shapes: what the first call of a new shape costs
against a call of a shape seen before, forward and backward, causal, grouped-query, bf16.

The training passes cut each micro-batch to its rows' widths (backend/engine/rank.py), so on responses that
end at EOS nearly every micro-batch has a shape the step has not seen. A backend that prepares work per shape
(cuDNN builds an execution graph for each) pays that on every micro-batch; one that does not pays it never.
Prints a table per model, writes a JSON.

    python bench/attention_shapes.py --out bench/results/<date>-h200-attention-shapes.json
    python bench/attention_shapes.py --small      # the script itself on CPU (the math backend only)
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (query heads, key/value heads, head_dim) of the two benchmark models, and the rows a micro-batch holds there.
MODELS = {"smollm2-135m": (9, 3, 64, 32), "qwen3-0.6b": (16, 8, 128, 64)}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def forward_backward(rows: int, width: int, heads: int, kv_heads: int, dim: int, device: torch.device,
                     dtype: torch.dtype) -> None:
    q = torch.randn(rows, heads, width, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, width, dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.ones_like(out))


def seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(backend: SDPBackend, widths: list[int], rows: int, heads: int, kv_heads: int, dim: int,
            device: torch.device, dtype: torch.dtype) -> dict:
    """Each width called twice in a row: the first call of a shape new to the process, then the same shape."""
    first, again = [], []
    with sdpa_kernel([backend]):
        for width in widths:
            call = functools.partial(forward_backward, rows, width, heads, kv_heads, dim, device, dtype)
            first.append(seconds(call, device))
            again.append(seconds(call, device))
    return {"first_ms": [round(t * 1e3, 3) for t in first], "again_ms": [round(t * 1e3, 3) for t in again],
            "first_median_ms": round(statistics.median(first) * 1e3, 3),
            "again_median_ms": round(statistics.median(again) * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=int, default=16, help="distinct widths a model is called at")
    p.add_argument("--small", action="store_true", help="CPU, the math backend, 4 rows of up to 48 positions")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    dtype = torch.float32 if args.small else torch.bfloat16
    backends = ["math"] if args.small else ["cudnn", "flash", "efficient"]
    # Widths the way responses that end at EOS give them: spread over the row's range, none repeated; each
    # backend and model gets its own so that no backend meets a shape another one prepared.
    widths_pool = random.Random(0).sample(range(16, 48) if args.small else range(96, 400),
                                          args.shapes * len(backends) * len(MODELS))
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "models": {}}
    for model, (heads, kv_heads, dim, rows) in MODELS.items():
        rows = 4 if args.small else rows
        results["models"][model] = {"rows": rows, "heads": heads, "kv_heads": kv_heads, "head_dim": dim}
        for name in backends:
            widths = [widths_pool.pop() for _ in range(args.shapes)]
            try:  # a warm-up outside the counted shapes first: each backend's libraries load once
                with sdpa_kernel([BACKENDS[name]]):
                    forward_backward(rows, 8, heads, kv_heads, dim, device, dtype)
                results["models"][model][name] = {"widths": widths, **measure(
                    BACKENDS[name], widths, rows, heads, kv_heads, dim, device, dtype)}
            except RuntimeError as e:  # a backend that cannot run these shapes (efficient: no grouped heads)
                results["models"][model][name] = {"error": str(e).splitlines()[0]}
    print(f"{'model':<14} {'backend':<10} {'first call of a shape (ms)':>28} {'the same shape again (ms)':>27}")
    for model, entry in results["models"].items():
        for name in backends:
            r = entry[name]
            if "error" in r:
                print(f"{model:<14} {name:<10} {r['error']}")
            else:
                print(f"{model:<14} {name:<10} {r['first_median_ms']:>28.2f} {r['again_median_ms']:>27.2f}")
    print("medians over", args.shapes, "widths; forward and backward of one layer's attention")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
