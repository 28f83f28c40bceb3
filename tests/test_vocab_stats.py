"""The vocabulary pass's one-read forward kernel gives what algos' PyTorch pass gives: the target's
log-prob, the entropy and the log-normaliser of each position. Triton's interpreter runs the GPU kernel
here on the CPU (conftest sets TRITON_INTERPRET); it has no bfloat16, so these run in fp32 and fp16, and
bench/vocab_pass_check.py covers bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

from backend.engine.log_probs import _vocab_forward
from backend.kernels import vocab_stats

pytest.importorskip("triton", reason="the kernel is written in Triton (installed with the dev extra)")
if torch.cuda.is_available():
    pytest.skip("these run the kernel on CPU tensors in Triton's interpreter, which conftest turns on only where "
                "there is no GPU; on a GPU, bench/vocab_pass_check.py checks it", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_the_kernel_matches_the_pytorch_pass(dtype, with_entropy):
    torch.manual_seed(0)
    # 1,000 entries in blocks of 128: the last block is partly past the end of the vocabulary.
    logits = (torch.randn(3, 5, 1000) * 4 + 30).to(dtype)
    targets = torch.randint(0, 1000, (3, 5))
    got = vocab_stats.vocab_stats(logits, targets, 0.7, with_entropy, block=128)
    want = _vocab_forward(logits, targets, 0.7, with_entropy)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g.dtype == torch.float32 and g.shape == (3, 5)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_peaked_distribution_far_from_zero_keeps_its_tiny_entropy():
    # Large logits and one dominant entry: an entropy computed as lse - E[z] would lose everything
    # below about 1e-4 to the cancellation of two numbers near 1,060.
    logits = torch.randn(4, 3000)
    logits[:, 7] = 60.0
    logits += 1000.0
    targets = torch.tensor([7, 7, 0, 1])
    log_prob, entropy, lse = vocab_stats.vocab_stats(logits, targets, 1.0, True, block=256)
    want_lp, want_entropy, want_lse = _vocab_forward(logits, targets, 1.0, True)
    assert (entropy > 0).all() and (entropy < 1e-18).all()
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-4, atol=0)
    torch.testing.assert_close(log_prob, want_lp)
    torch.testing.assert_close(lse, want_lse)


def test_rows_that_are_not_contiguous_are_read_correctly():
    torch.manual_seed(1)
    wide = torch.randn(6, 2, 300)
    logits = wide[:, 0]  # every other row of the underlying storage
    targets = torch.randint(0, 300, (6,))
    got = vocab_stats.vocab_stats(logits, targets, 1.3, True, block=64)
    want = _vocab_forward(logits, targets, 1.3, True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_the_kernel_is_for_gpus_only():
    assert not vocab_stats.available(torch.device("cpu"))
