"""The Triton kernel behind backend.kernels.decode_attention (imported on first use: Triton is only on GPU
machines, and TRITON_INTERPRET, which runs it on the CPU, is read when the kernel is defined)."""

import triton
import triton.language as tl


@triton.jit
def attend_block(start, end, q, m, total, acc, row, head, d, k_ptr, v_ptr, valid_ptr, scale,
                 stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_valid_b,
                 BLOCK: tl.constexpr):
    """The running softmax (max m, sum total, weighted values acc) after slots [start, start + BLOCK)."""
    s_idx = start + tl.arange(0, BLOCK)
    inside = s_idx < end
    keep = tl.load(valid_ptr + row * stride_valid_b + s_idx, mask=inside, other=0) != 0
    k = tl.load(k_ptr + row * stride_kb + head * stride_kh + s_idx[:, None] * stride_ks + d[None, :],
                mask=inside[:, None], other=0.0)
    v = tl.load(v_ptr + row * stride_vb + head * stride_vh + s_idx[:, None] * stride_vs + d[None, :],
                mask=inside[:, None], other=0.0)
    # An FP8 cache is widened to the queries' dtype in registers: the products run in 16 bits.
    scores = tl.dot(q, tl.trans(k.to(q.dtype))) * scale  # (G_PAD, BLOCK), fp32
    scores = tl.where(keep[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A row whose slots so far are all padding has m_new = -inf: shift by 0 there, so exp gives
    # 0 for every masked score instead of exp(-inf + inf) = NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - shift[:, None])
    alpha = tl.exp(m - shift)
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, total, acc

@triton.jit
def decode_attention_kernel(q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, valid_ptr, slot_ptr, out_ptr, scale,
                            stride_qb, stride_qh, stride_qg,
                            stride_kb, stride_kh, stride_ks,
                            stride_vb, stride_vh, stride_vs,
                            stride_knb, stride_knh, stride_vnb, stride_vnh,
                            stride_valid_b, stride_slot, stride_ob, stride_oh, stride_og,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                            PIPELINED: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * stride_qb + head * stride_qh + g[:, None] * stride_qg + d[None, :],
                mask=g[:, None] < G, other=0.0)
    newest = tl.load(slot_ptr + row * stride_slot).to(tl.int32)
    # The newest key and value go into the cache here (one kernel instead of two copies a layer) and are
    # attended from registers: the loop below reads the slots before them, so no program reads back
    # what another thread of it has just stored.
    k_new = tl.load(k_new_ptr + row * stride_knb + head * stride_knh + d)
    v_new = tl.load(v_new_ptr + row * stride_vnb + head * stride_vnh + d)
    tl.store(k_ptr + row * stride_kb + head * stride_kh + newest * stride_ks + d, k_new)
    tl.store(v_ptr + row * stride_vb + head * stride_vh + newest * stride_vs + d, v_new)
    end = newest  # slots [0, newest) come from the cache
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    if PIPELINED:
        # Triton pipelines a for loop (loading the next block while this one is computed), not a
        # while loop; its interpreter cannot take a bound read from memory, so it runs the while loop.
        for start in range(0, end, BLOCK):
            m, total, acc = attend_block(start, end, q, m, total, acc, row, head, d, k_ptr, v_ptr, valid_ptr,
                                         scale, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                                         stride_vs, stride_valid_b, BLOCK)
    else:
        start = tl.full((), 0, tl.int32)
        while start < end:
            m, total, acc = attend_block(start, end, q, m, total, acc, row, head, d, k_ptr, v_ptr, valid_ptr,
                                         scale, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                                         stride_vs, stride_valid_b, BLOCK)
            start += BLOCK
    # The newest slot, the same running-softmax update as a block of one.
    keep = tl.load(valid_ptr + row * stride_valid_b + newest) != 0
    score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale  # (G_PAD,)
    score = tl.where(keep, score, float("-inf"))
    m_new = tl.maximum(m, score)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(score - shift)
    alpha = tl.exp(m - shift)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + head * stride_oh + g[:, None] * stride_og + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)
