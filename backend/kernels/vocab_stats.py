"""The forward of the vocabulary pass (log-prob of the target, entropy and log-normaliser of each
position) as one Triton kernel that reads each position's logits once.

Why a kernel: with the 151,936-entry vocabulary of Qwen models, the logits of one 2,048-position chunk are
622 MB in bf16. torch.compile's fused reduction reads them about three times (the max, the sum of
exponentials, then the entropy's sum). This kernel keeps a running max and both sums for each position (an
online softmax), so it reads them once; `python bench/vocab_pass_check.py` times both (docs/performance.md).

Triton runs on NVIDIA GPUs; `TRITON_INTERPRET=1` runs the same kernel on the CPU (slowly), which is how the
tests check it against algos' PyTorch pass.
"""

from __future__ import annotations

import torch

from backend.kernels.decode_attention import available  # the same condition: a CUDA device with Triton installed

__all__ = ["available", "vocab_stats"]

BLOCK = 4096  # vocabulary entries a program reads per iteration
NUM_WARPS = 8


def vocab_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """With z = logits / temperature: log softmax(z)[target], the entropy of softmax(z) and logsumexp(z).

    logits (..., V) in any float dtype; targets (...) int64 indices into V. Returns three fp32 tensors of
    targets' shape (the entropy None unless asked for), as algos' _vocab_forward does.
    """
    from backend.kernels.vocab_stats_triton import vocab_stats_kernel

    n_vocab = logits.shape[-1]
    flat = logits.reshape(-1, n_vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    log_prob, entropy, lse = out.unbind(0)
    # The vocabulary size is a compile-time constant: one compilation per model, and loop bounds the
    # compiler (and Triton's interpreter) know.
    vocab_stats_kernel[(rows,)](flat, targets.reshape(-1).contiguous(), log_prob, entropy, lse, flat.stride(0),
                                float(temperature), N_VOCAB=n_vocab, WITH_ENTROPY=with_entropy, BLOCK=block,
                                num_warps=NUM_WARPS)
    shape = targets.shape
    return log_prob.view(shape), entropy.view(shape) if with_entropy else None, lse.view(shape)
