"""The Triton kernel behind backend.vocab_stats (imported on first use: Triton is only on GPU machines,
and TRITON_INTERPRET, which runs it on the CPU, is read when the kernel is defined)."""

import triton
import triton.language as tl


@triton.jit
def vocab_stats_kernel(logits_ptr, targets_ptr, log_prob_ptr, entropy_ptr, lse_ptr, stride_row, temperature,
                       N_VOCAB: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """One program per position: z = logits[row] / temperature read once, in blocks of BLOCK entries.

    Each lane keeps a running max m, s = sum exp(z - m) and t = sum exp(z - m) (z - m) over the entries
    it has seen, rescaled when m grows; the lanes are combined at the end. t is kept relative to the
    running max, so the entropy log S - T / S never subtracts two large numbers.
    """
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N_VOCAB, BLOCK):
        idx = start + lanes
        inside = idx < N_VOCAB
        z = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, z)
        # A lane that has seen only padding keeps m = -inf: shift it by 0 so exp gives 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        centred = tl.where(inside, z - shift, 0.0)
        e = tl.where(inside, tl.exp(centred), 0.0)
        if WITH_ENTROPY:
            moved = tl.where(m == float("-inf"), 0.0, m - shift)
            t = alpha * (t + s * moved) + e * centred
        s = s * alpha + e
        m = m_new
    top = tl.max(m, axis=0)
    weight = tl.exp(m - top)
    total = tl.sum(s * weight, axis=0)
    lse = top + tl.log(total)
    target = tl.load(targets_ptr + row)
    z_target = tl.load(base + target).to(tl.float32) / temperature
    tl.store(log_prob_ptr + row, z_target - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        moved = tl.where(m == float("-inf"), 0.0, m - top)
        spread = tl.sum(weight * (t + s * moved), axis=0)
        tl.store(entropy_ptr + row, tl.log(total) - spread / total)
