"""Decode attention for the workbench rollout engine: one new query per row against that row's KV cache,
reading only the slots written so far, as one Triton kernel.

Why a kernel: at batch 512 a decode step's time is mostly reading the KV cache. PyTorch's attention
takes a boolean mask over a fixed number of slots, so a CUDA graph must be captured per slot bucket
and every step reads its whole bucket. Here the kernel reads the number of written slots from device
memory, so one graph serves every step, and each step reads exactly the slots written. Each program
takes one (row, KV head): its g query heads share one read of the keys and values (grouped-query
attention), with a running (online) softmax over blocks of slots.

Triton runs on NVIDIA GPUs; `TRITON_INTERPRET=1` runs the same kernel on the CPU (slowly), which is
how the tests check it against PyTorch's attention.

The cache may be FP8 (e4m3, unscaled, as vLLM's kv_cache_dtype=fp8 without calibrated scales): half the bytes
to read, each value rounded to 3 mantissa bits (by the caller, which hands the new key and value in already
rounded). The kernel widens each block to the queries' dtype in registers.
"""

from __future__ import annotations

import os

import torch

# Cache slots per iteration of a program's loop, warps per program and pipeline stages; chosen by
# `python bench/decode_attention_check.py --sweep` on an H200 (see docs/performance.md).
BLOCK_SLOTS = 128
NUM_WARPS = 4
NUM_STAGES = 2
PIPELINED = True
FP8 = torch.float8_e4m3fn  # the FP8 cache's format (as vLLM's kv_cache_dtype=fp8): 4 exponent bits, 3 mantissa


def available(device: torch.device, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel can run for tensors on `device` (a CUDA device with Triton installed), with a cache of
    `cache_dtype` (Triton converts FP8 from compute capability 8.9 on: Ada, Hopper and later)."""
    if device.type != "cuda":
        return False
    if cache_dtype == FP8 and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                     v_new: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor, out: torch.Tensor | None = None,
                     block: int = BLOCK_SLOTS, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     pipelined: bool = PIPELINED) -> torch.Tensor:
    """Write each row's newest key and value into its cache slot slot[row], then softmax(q k^T / sqrt(D)) v
    for one query position per row, over that row's cache slots [0, slot[row]] that `valid` marks, each KV
    head serving its g query heads.

    q: (b, kv_heads, g, D); k_cache, v_cache: (rows >= b, kv_heads, slots, D), written in place;
    k_new, v_new: (b, kv_heads, D); the caches and the new key and value all in q's dtype, or all FP8;
    valid: (rows >= b, slots) bool; slot: (b,) int64 on the device, or (1,) for one slot for all rows (read by
    the kernel, so a captured graph replays correctly as it advances).
    Every row must have at least one valid slot in range. Returns (b, kv_heads, g, D) in q's dtype
    (written into `out` when given). block, num_warps, num_stages and pipelined (a for loop rather than a
    while loop) tune the kernel; the defaults are the fastest measured.
    """
    b, n_kv, g, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode_attention needs a power-of-two head_dim of at least 16, got {d}")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, k_new, v_new, valid)):
        raise ValueError("decode_attention needs the last dimension of q, the caches, the new key and value "
                         "and valid contiguous")
    stored = {t.dtype for t in (k_cache, v_cache, k_new, v_new)}
    if len(stored) != 1 or stored.pop() not in (q.dtype, FP8):
        raise ValueError(f"decode_attention needs the caches and the new key and value all in q's dtype ({q.dtype}) "
                         f"or all in {FP8}, got {k_cache.dtype}, {v_cache.dtype}, {k_new.dtype} and {v_new.dtype}")
    out = torch.empty_like(q) if out is None else out
    slot = slot.expand(b)  # one slot for all rows reads slot[0] everywhere (stride 0)
    # Imported on first use: Triton is only on GPU machines (and in the tests, through its interpreter).
    from backend.kernels.decode_attention_triton import decode_attention_kernel

    decode_attention_kernel[(b, n_kv)](
        q, k_cache, v_cache, k_new, v_new, valid, slot, out, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        valid.stride(0), slot.stride(0), out.stride(0), out.stride(1), out.stride(2),
        G=g, G_PAD=max(16, 1 << (g - 1).bit_length()), D=d, BLOCK=block,
        PIPELINED=pipelined and os.environ.get("TRITON_INTERPRET") != "1", num_warps=num_warps,
        num_stages=num_stages)
    return out
