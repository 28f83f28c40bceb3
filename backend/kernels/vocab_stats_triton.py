"""The Triton kernel behind backend.kernels.vocab_stats (imported on first use: Triton is only on GPU machines,
and TRITON_INTERPRET, which runs it on the CPU, is read when the kernel is defined)."""

import triton
import triton.language as tl


@triton.jit
def vocab_stats_kernel(logits_ptr, targets_ptr, log_prob_ptr, entropy_ptr, lse_ptr, stride_row, temperature,
                       N_VOCAB: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """One program per position: z = logits[row] / temperature read once, in blocks of BLOCK entries.

    The program keeps the running max m, s = sum exp(z - m) and t = sum exp(z - m) (z - m) over the blocks
    it has read, rescaling both when a block raises m (one exp an entry; rescaling each lane instead cost
    three). t is kept relative to the running max, so the entropy log s - t / s never subtracts two large
    numbers.
    """
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    t = tl.full((), 0.0, tl.float32)
    for start in range(0, N_VOCAB, BLOCK):
        idx = start + lanes
        inside = idx < N_VOCAB
        z = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))  # finite: every block holds at least one entry
        alpha = tl.exp(m - m_new)  # 0 on the first block, where m is -inf
        centred = tl.where(inside, z - m_new, 0.0)
        e = tl.where(inside, tl.exp(centred), 0.0)
        if WITH_ENTROPY:
            moved = tl.where(m == float("-inf"), 0.0, m - m_new)
            t = alpha * (t + s * moved) + tl.sum(e * centred, axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    z_target = tl.load(base + target).to(tl.float32) / temperature
    tl.store(log_prob_ptr + row, z_target - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, tl.log(s) - t / s)
