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
"""

from __future__ import annotations

import functools

import torch

BLOCK_SLOTS = 64  # cache slots per iteration of a program's loop


def available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on `device` (a CUDA device with Triton installed)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    # Built on first use, not at import: Triton is only on GPU machines, and TRITON_INTERPRET is read
    # when the kernel is defined.
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, out_ptr, scale,
                                stride_qb, stride_qh, stride_qg,
                                stride_kb, stride_kh, stride_ks,
                                stride_vb, stride_vh, stride_vs,
                                stride_valid_b, stride_ob, stride_oh, stride_og,
                                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * stride_qb + head * stride_qh + g[:, None] * stride_qg + d[None, :],
                    mask=g[:, None] < G, other=0.0)
        end = tl.load(slot_ptr).to(tl.int32) + 1  # slots [0, slot] are written, the newest at `slot`
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        start = tl.full((), 0, tl.int32)
        while start < end:  # a while loop, as the bound is read on the device
            s_idx = start + tl.arange(0, BLOCK)
            inside = s_idx < end
            keep = tl.load(valid_ptr + row * stride_valid_b + s_idx, mask=inside, other=0) != 0
            k = tl.load(k_ptr + row * stride_kb + head * stride_kh + s_idx[:, None] * stride_ks + d[None, :],
                        mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + row * stride_vb + head * stride_vh + s_idx[:, None] * stride_vs + d[None, :],
                        mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # (G_PAD, BLOCK), fp32
            scores = tl.where(keep[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A row whose slots so far are all padding has m_new = -inf: shift by 0 there, so exp gives
            # 0 for every masked score instead of exp(-inf + inf) = NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - shift[:, None])
            alpha = tl.exp(m - shift)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
            start += BLOCK
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + head * stride_oh + g[:, None] * stride_og + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)

    return decode_attention_kernel


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, valid: torch.Tensor,
                     slot: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for one query position per row, over cache slots [0, slot[0]] that
    `valid` marks, each KV head serving its g query heads.

    q: (b, kv_heads, g, D); k_cache, v_cache: (rows >= b, kv_heads, slots, D); valid: (rows >= b, slots)
    bool; slot: (1,) int64 on the device, the newest written slot (read by the kernel, so a captured
    graph replays correctly as it advances). Every row must have at least one valid slot in range.
    Returns (b, kv_heads, g, D) in q's dtype (written into `out` when given).
    """
    b, n_kv, g, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode_attention needs a power-of-two head_dim of at least 16, got {d}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or valid.stride(-1) != 1:
        raise ValueError("decode_attention needs the last dimension of q, the caches and valid contiguous")
    out = torch.empty_like(q) if out is None else out
    _kernel()[(b, n_kv)](
        q, k_cache, v_cache, valid, slot, out, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        valid.stride(0), out.stride(0), out.stride(1), out.stride(2),
        G=g, G_PAD=max(16, 1 << (g - 1).bit_length()), D=d, BLOCK=BLOCK_SLOTS)
    return out
