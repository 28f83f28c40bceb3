"""The vocabulary pass on the GPU, on the workload's shapes (Qwen3's 151,936-entry vocabulary, hidden 1,024,
a micro-batch of 64 x 256 response positions in 2,048-position chunks): the one-read forward kernel
(backend/kernels/vocab_stats.py) against torch.compile's fused pass and an fp32 reference; the output head's whole
pass forward and backward (head_token_log_probs, compiled=True); and the head weight's gradient
summed over chunks in fp32 by addmm against a bf16 product cast and added. Prints a table, writes a JSON.

    python bench/vocab_pass_check.py --out bench/results/<date>-h200-vocab-pass.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.engine.log_probs import _add_product, _over_positions, _vocab_forward, head_token_log_probs
from backend.kernels import vocab_stats  # noqa: E402

VOCAB, HIDDEN, ROWS, RESPONSE, CHUNK = 151_936, 1024, 64, 256, 2048


def timed_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden = (torch.randn(ROWS, RESPONSE, HIDDEN, device=dev) * 0.5).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, device=dev) * 0.02).bfloat16()
    targets = torch.randint(0, VOCAB, (ROWS, RESPONSE), device=dev)
    rows = CHUNK // RESPONSE
    chunk_logits = hidden[:rows] @ weight.T  # (8, 256, V) bf16: one chunk
    chunk_targets = targets[:rows]
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "shapes": {"vocab": VOCAB, "hidden": HIDDEN, "rows": ROWS, "response": RESPONSE, "chunk": CHUNK}}

    # Correctness in bf16 against an fp32 pass over the same logits.
    want = _vocab_forward(chunk_logits.float(), chunk_targets, 0.9, True)
    compiled_forward = _over_positions(torch.compile(_vocab_forward))
    errors = {}
    for name, fn in (("kernel", vocab_stats.vocab_stats), ("compiled", compiled_forward)):
        got = fn(chunk_logits, chunk_targets, 0.9, True)
        errors[name] = {k: (g - w).abs().max().item() for k, g, w in zip(("log_prob", "entropy", "lse"), got, want,
                                                                          strict=True)}
    result["max_abs_error_vs_fp32"] = errors

    times = {}
    for entropy in (True, False):
        for name, fn in (("kernel", vocab_stats.vocab_stats), ("compiled", compiled_forward)):
            times[f"forward a chunk, {name}, entropy {entropy} (ms)"] = timed_ms(
                lambda fn=fn, entropy=entropy: fn(chunk_logits, chunk_targets, 1.0, entropy))
    read_ms = chunk_logits.numel() * chunk_logits.element_size() / 4.3e12 * 1e3
    times["one read of a chunk at 4.3 TB/s (ms)"] = read_ms

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()

    def head_step() -> None:
        log_prob, _ = head_token_log_probs(h, w, targets, 1.0, True, False, compiled=True)
        log_prob.sum().backward()

    def head_forward() -> None:
        with torch.no_grad():
            head_token_log_probs(hidden, weight, targets, 1.0, True, False, compiled=True)

    times["head pass of a micro-batch, forward and backward (ms)"] = timed_ms(head_step)
    times["head pass of a micro-batch, forward only (ms)"] = timed_ms(head_forward)

    grad = (torch.randn(CHUNK, VOCAB, device=dev) * 1e-3).bfloat16()
    h_chunk = torch.randn(CHUNK, HIDDEN, device=dev).bfloat16()
    acc = torch.zeros(VOCAB, HIDDEN, device=dev)
    chunks = ROWS * RESPONSE // CHUNK

    def cast_and_add() -> None:
        for _ in range(chunks):
            acc.add_((grad.T @ h_chunk).float())

    def addmm() -> None:
        for _ in range(chunks):
            _add_product(acc, grad.T, h_chunk)

    times["head weight gradient of a micro-batch, bf16 product cast and added (ms)"] = timed_ms(cast_and_add)
    times["head weight gradient of a micro-batch, addmm into fp32 (ms)"] = timed_ms(addmm)
    exact = (grad.float().T @ h_chunk.float()) * chunks
    wgrad_errors = {}
    for name, fn in (("cast_and_add", cast_and_add), ("addmm", addmm)):
        acc.zero_()
        fn()
        wgrad_errors[name] = (acc - exact).abs().max().item()
    result["head_weight_gradient_max_abs_error_vs_fp32"] = wgrad_errors
    result["times_ms"] = times

    for k, v in times.items():
        print(f"| {k} | {v:.2f} |")
    for name, e in errors.items():
        print(f"| forward {name}, max abs error vs fp32 | " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()) + " |")
    print("| head weight gradient, max abs error vs fp32 | "
          + ", ".join(f"{k} {v:.2e}" for k, v in wgrad_errors.items()) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
