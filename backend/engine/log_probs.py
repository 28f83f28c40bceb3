"""Log-probs of the response tokens under a model: the fused vocabulary pass the engine runs in every
log-prob and update phase (chunked, recomputed in backward, a Triton kernel for the forward on GPUs).
"""

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from backend.core import lora
from backend.kernels import vocab_stats
from backend.rollout import static_cache

LOG_PROB_CHUNK_TOKENS = 2048  # response positions whose fp32 vocabulary pass is computed at once


def _vocab_forward(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
                   ) -> tuple[Tensor, Tensor | None, Tensor]:
    """One pass over the vocabulary: with z = logits / T and a = log softmax(z),
    log_prob = a[target], entropy = -sum_v exp(a_v) a_v, lse = logsumexp(z).

    logits (rows, R, V) in any dtype, targets (rows, R); returns three (rows, R) fp32 tensors
    (entropy None unless asked for). lse is read off the target's entry (z - a, where a is largest among
    the entries the model would sample), so the log-softmax is the only reduction over the vocabulary
    besides the entropy's.
    """
    z = logits.float() if temperature == 1 else logits.float() / temperature
    a = torch.log_softmax(z, dim=-1)
    index = targets.unsqueeze(-1)
    log_prob = a.gather(-1, index).squeeze(-1)
    entropy = -torch.linalg.vecdot(a.exp(), a) if with_entropy else None
    return log_prob, entropy, z.gather(-1, index).squeeze(-1) - log_prob


def _vocab_backward(logits: Tensor, targets: Tensor, temperature: float, lse: Tensor, entropy: Tensor | None,
                    grad_log_prob: Tensor, grad_entropy: Tensor | None) -> Tensor:
    """d/d logits of sum(grad_log_prob * log_prob + grad_entropy * entropy), from what the forward kept:
    (1/T) [g_lp (onehot(target) - p) - g_H p (a + H)], with a = z - lse = log p (so a + H = z - E_p[z]).

    logits (rows, R, V); targets, lse, entropy and the two upstream gradients (rows, R); returns the
    gradient in the logits' dtype (rows, R, V).
    """
    a = logits.float() / temperature - lse.unsqueeze(-1)
    p = a.exp()
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)
    grad = grad_log_prob.unsqueeze(-1) * (is_target.float() - p)
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(-1) * p * (a + entropy.unsqueeze(-1))
    return (grad / temperature).to(logits.dtype)


def _vocab_backward_eager(logits: Tensor, targets: Tensor, temperature: float, lse: Tensor,
                          entropy: Tensor | None, grad_log_prob: Tensor, grad_entropy: Tensor | None) -> Tensor:
    """_vocab_backward's gradient for eager execution (CPUs, or layers not compiled): in place on one fp32
    copy, the target's term added by a scatter instead of a one-hot comparison, so it makes five passes
    over the (rows, R, V) chunk where the compiled form's steps make a dozen. Compiled, the one-hot form
    fuses into a single kernel instead, which the in-place scatter would split."""
    a = logits.to(torch.float32, copy=True)
    if temperature != 1:
        a.div_(temperature)
    p = a.sub_(lse.unsqueeze(-1)).exp()
    g_lp = grad_log_prob.unsqueeze(-1)
    if grad_entropy is None:
        grad = p.mul_(g_lp)
    else:
        grad = p.mul_(a.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(g_lp))
    grad.neg_().scatter_add_(-1, targets.unsqueeze(-1), g_lp)
    if temperature != 1:
        grad.div_(temperature)
    return grad.to(logits.dtype)


@functools.cache
def _compiled_vocab_pass() -> tuple[Callable, Callable]:
    # Compiled, each direction is one or two fused kernels that read the bf16 logits without writing
    # an fp32 copy; eager, every step above is its own pass over a (rows, R, V) tensor. On a GPU the
    # forward is vocab_stats' kernel, which reads the logits once where the compiled one read them
    # about three times.
    compiled_forward = _over_positions(torch.compile(_vocab_forward))

    def forward(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
                ) -> tuple[Tensor, Tensor | None, Tensor]:
        if vocab_stats.available(logits.device):
            return vocab_stats.vocab_stats(logits, targets, temperature, with_entropy)
        return compiled_forward(logits, targets, temperature, with_entropy)

    return forward, _over_positions(torch.compile(_vocab_backward))


def _over_positions(fn: Callable) -> Callable:
    """fn applied to its tensors flattened to (positions, ...), with the number of positions dynamic and
    the vocabulary static: one compilation serves every chunk, and the kernels index the vocabulary by a
    constant (with all dimensions dynamic, the backward's per-element index arithmetic cost several times
    what reading and writing the chunk takes)."""
    def flat(*args):
        shape = args[1].shape  # the targets' (rows, R)
        flat_args = [a.flatten(0, 1) if isinstance(a, Tensor) else a for a in args]
        for a in flat_args:
            if isinstance(a, Tensor):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        out = fn(*flat_args)
        if isinstance(out, Tensor):  # the backward: the logits' gradient
            return out.view(*shape, out.shape[-1])
        return tuple(o.view(shape) if o is not None else None for o in out)
    return flat


def _row_chunks(n_rows: int, response_len: int) -> list[slice]:
    rows = max(1, LOG_PROB_CHUNK_TOKENS // max(response_len, 1))
    return [slice(start, start + rows) for start in range(0, n_rows, rows)]


def _chunked_forward(chunk_logits: Callable[[slice], Tensor], targets: Tensor, temperature: float,
                     with_entropy: bool, forward_fn: Callable) -> tuple[Tensor, Tensor | None, Tensor]:
    """forward_fn over the rows of targets (b, R) a chunk at a time, chunk_logits(rows) giving that chunk's
    logits; the chunks' (b, R) log-probs, entropies (None unless with_entropy) and log-normalisers."""
    parts = [forward_fn(chunk_logits(c), targets[c], temperature, with_entropy)
             for c in _row_chunks(targets.shape[0], targets.shape[1])]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if with_entropy else None,
            torch.cat([p[2] for p in parts]))


class _VocabPass(torch.autograd.Function):
    """Log-probs and entropies by chunks of rows, keeping only the logits and two (rows, R) vectors for
    backward, which recomputes the softmax chunk by chunk into the logits' gradient."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, fns):
        forward_fn, backward_fn = fns
        log_prob, entropy, lse = _chunked_forward(logits.__getitem__, targets, temperature, with_entropy, forward_fn)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.backward_fn = temperature, backward_fn
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None:
            grad_log_prob = torch.zeros_like(lse)
        grad = torch.empty_like(logits)
        for c in _row_chunks(logits.shape[0], logits.shape[1]):
            grad[c] = ctx.backward_fn(logits[c], targets[c], ctx.temperature, lse[c],
                                      None if grad_entropy is None else entropy[c], grad_log_prob[c],
                                      None if grad_entropy is None else grad_entropy[c])
        return grad, None, None, None, None


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of `targets` (b, R) under softmax((b, R, V) logits / temperature),
    as fp32 (b, R) tensors; logits in any dtype.

    The fp32 log-softmax of a whole micro-batch would be the largest tensor of a step (b x R x 151,936 x 4
    bytes for Qwen3): this works LOG_PROB_CHUNK_TOKENS positions at a time and, under autograd, keeps
    nothing of a chunk but its log-normaliser, recomputing the softmax in backward. The entropy carries a
    gradient only with entropy_grad (an entropy bonus). `compiled` fuses each chunk's pass (GPUs).
    """
    fns = _compiled_vocab_pass() if compiled else (_vocab_forward, _vocab_backward_eager)
    if torch.is_grad_enabled() and logits.requires_grad:
        log_prob, entropy = _VocabPass.apply(logits, targets, temperature, with_entropy, fns)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return log_prob, entropy
    return _chunked_forward(logits.__getitem__, targets, temperature, with_entropy, fns[0])[:2]


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b for an fp32 acc (m, n) and a (m, k), b (k, n) in the model's dtype.

    On a GPU with bf16 or fp16 factors the matmul writes fp32 into acc directly (cuBLAS adds into its
    output), so the product is never rounded to 16 bits and no cast and add run after it (timed by
    `bench/vocab_pass_check.py`). PyTorch has that form only on CUDA.
    """
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


class _HeadVocabPass(torch.autograd.Function):
    """The output head's matmul fused with the vocabulary pass, a chunk of rows at a time: neither the
    logits nor their gradient ever exist for the whole micro-batch, only for one chunk. Backward
    recomputes a chunk's logits (one more matmul) and turns their gradient into the hidden states' and
    the head weight's at once."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, fns):
        forward_fn, backward_fn = fns
        log_prob, entropy, lse = _chunked_forward(lambda c: hidden[c] @ weight.T, targets, temperature, with_entropy,
                                                  forward_fn)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.backward_fn = temperature, backward_fn
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None:
            grad_log_prob = torch.zeros_like(lse)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight's gradient sums over every chunk: kept in fp32 so the chunks' products add up as one
        # matmul's would.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for c in _row_chunks(hidden.shape[0], hidden.shape[1]):
            grad_logits = ctx.backward_fn(hidden[c] @ weight.T, targets[c], ctx.temperature, lse[c],
                                          None if grad_entropy is None else entropy[c], grad_log_prob[c],
                                          None if grad_entropy is None else grad_entropy[c])
            if grad_hidden is not None:
                grad_hidden[c] = grad_logits @ weight
            if grad_weight is not None:
                _add_product(grad_weight, grad_logits.flatten(0, 1).T, hidden[c].flatten(0, 1))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None)


def head_token_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False
                         ) -> tuple[Tensor, Tensor | None]:
    """token_log_probs(hidden @ weight.T, ...) without the whole (b, R, V) logits or their gradient:
    the head's matmul runs a chunk of rows at a time inside the vocabulary pass.

    hidden (b, R, H) the states that predict `targets` (b, R); weight (V, H) a bias-free output head.
    Returns fp32 (b, R) log-probs and entropies (None unless with_entropy); gradients reach both hidden
    and weight.
    """
    fns = _compiled_vocab_pass() if compiled else (_vocab_forward, _vocab_backward_eager)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        log_prob, entropy = _HeadVocabPass.apply(hidden, weight, targets, temperature, with_entropy, fns)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return log_prob, entropy
    return _chunked_forward(lambda c: hidden[c] @ weight.T, targets, temperature, with_entropy, fns[0])[:2]


def response_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                       temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                       compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under `model`, and optionally the entropy of each position.

    input_ids, attention_mask: (b, P + R), the last R positions are the response.
    Returns log_probs (b, R) and entropy (b, R) or None; the entropy carries a gradient only when
    entropy_grad is set (an entropy bonus). Only the R positions that predict response tokens reach the
    output head, and logits are divided by the sampling temperature so the ratio matches the sampling
    distribution. `compiled` fuses the vocabulary pass.

    Where the head is a plain bias-free linear layer, the model returns its hidden states and the head
    runs inside the vocabulary pass a chunk at a time (head_token_log_probs), so the (b, R, V)
    logits and their gradient never exist whole. Those models also see each row shifted left by its
    padding, so every row starts at position 0 and all padding trails: no real token then has padding
    before it, plain causal attention is exact, and no mask is built (a masked attention cannot skip
    the masked half of the scores; on an H200 it ran at about a quarter of the card's matmul rate here).
    Other models get the rows as they are, with the mask and `logits_to_keep` as indices.
    """
    total = input_ids.shape[1]
    predicting = torch.arange(total - response_len - 1, total - 1, device=input_ids.device)
    targets = input_ids[:, -response_len:]
    head = _plain_head(model)
    if head is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=predicting, use_cache=False)
        return token_log_probs(out.logits, targets, temperature, with_entropy, entropy_grad, compiled=compiled)
    shift = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True)  # (b, 1) left padding of each row
    positions = torch.arange(total, device=input_ids.device)
    shifted = input_ids.gather(1, (positions + shift) % total)
    with _passing_through(head):
        # No mask and no position ids: Hugging Face then counts positions from 0 and runs causal attention.
        # Every position kept as indices, so the output is a copy, not a view FSDP's backward hook could miss.
        hidden = model(input_ids=shifted, logits_to_keep=positions, use_cache=False).logits  # (b, P + R, H)
    at = (predicting - shift).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (b, R, H)
    out_hidden = hidden.gather(1, at)
    if isinstance(model, FSDPModule):
        # The root, which holds the head, may free its gathered weights after the forward (it does once
        # distributed.unsharded has run); the backward, or the caller's reshard, frees them again.
        model.unshard()
    return head_token_log_probs(out_hidden, head.weight, targets, temperature, with_entropy, entropy_grad,
                                      compiled=compiled)


def _plain_head(model) -> torch.nn.Linear | None:
    """The model's output head where the model's forward returns head(hidden) unchanged (the
    architectures the workbench engine runs) and the head is a bias-free linear layer; else None."""
    base = lora.unwrap(model)
    if (getattr(base.config, "architectures", None) or [None])[0] not in static_cache.ARCHITECTURES:
        return None
    head = base.get_output_embeddings()
    return head if type(head) is torch.nn.Linear and head.bias is None else None


@contextlib.contextmanager
def _passing_through(head: torch.nn.Module):
    """The head returns its input for the duration (an instance attribute shadows its forward, as
    distributed.shard_model does for compiled layers)."""
    head.forward = lambda hidden: hidden
    try:
        yield
    finally:
        del head.forward

