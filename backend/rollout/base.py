"""Rollout engines: prompts in, n sampled responses per prompt out, behind one interface.

The batch layout every later phase uses (B = prompts x n, P = longest prompt, R = longest response):

    input_ids       (B, P + R)  left-padded prompt, then the response padded on the right
    attention_mask  (B, P + R)  1 on real prompt and response tokens
    responses       (B, R)      response token ids (pad after the end)
    response_mask   (B, R)      1 up to and including the EOS token
    rollout_log_probs (B, R)    the engine's log-prob of each sampled token, fp32, 0 at padding (engines
                                that report them: vllm; and every rollout worker of trainer.rollout_mode=async)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.core.models import amp_context


class StaleWeightsError(RuntimeError):
    """A rollout engine's copy of the weights differs from the actor's after a weight sync: it would generate
    from weights other than those being trained. `engine` names the engine, `tensors` the actor's tensors whose
    copy differs."""

    def __init__(self, engine: str, tensors: list[str]):
        self.engine, self.tensors = engine, list(tensors)
        shown = ", ".join(tensors[:4]) + (f" and {len(tensors) - 4} more" if len(tensors) > 4 else "")
        super().__init__(f"after the weight sync {engine}'s copy of {len(tensors)} of the actor's tensors "
                         f"differs from the actor's: {shown}")

    def __reduce__(self):
        # Ray hands a worker's exception to the controller pickled: rebuild it from what it was made of.
        return type(self), (self.engine, self.tensors)


# Values of each tensor the weight check compares: about this many, evenly strided through it. A sync that
# skipped or misplaced a tensor leaves all of its values stale, so a sample shows it, at a read of a few
# thousand values a tensor instead of all of them (on a small CPU, a whole read costs a noticeable part of a step).
FINGERPRINT_VALUES = 4096


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A fixed, evenly strided sample of a tensor's values (a view: nothing is copied)."""
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // FINGERPRINT_VALUES)]


def stale_tensors(samples: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list[str]:
    """The names whose engine copy differs from the actor's tensor, of (name, fingerprint of the engine's copy,
    fingerprint of the actor's tensor) triples: compared value for value in the engine copy's dtype (the sync
    casts to it), all at once on the engine's device, in one transfer back."""
    if not samples:
        return []
    device = samples[0][1].device
    ours = [engine.float() for _, engine, _ in samples]
    theirs = [actor.to(device=device, dtype=engine.dtype).float() for _, engine, actor in samples]
    lengths = torch.tensor([len(x) for x in ours], device=device)
    unequal = torch.cat(ours) != torch.cat(theirs)
    differs = torch.segment_reduce(unequal.float(), "max", lengths=lengths).tolist()
    return [name for (name, _, _), d in zip(samples, differs, strict=True) if d]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    greedy: bool = False
    seed: int = 0
    ignore_eos: bool = False  # keep sampling after EOS up to max_new_tokens (fixed-length benchmarks)


@dataclass
class Turn:
    """One turn of an episode for an engine that keeps episodes in its cache (StaticCacheEngine.play): the
    ids to append before it samples (the prompt, then each observation), at most max_new_tokens sampled,
    drawn with this seed."""

    ids: list[int]
    max_new_tokens: int
    seed: int


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor       # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    responses: torch.Tensor       # (B, R)
    response_mask: torch.Tensor   # (B, R)
    prompt_index: torch.Tensor    # (B,) which prompt of the input list each row answers
    finish_reasons: list[str]     # "stop" (EOS) or "length" (ran out of max_new_tokens)
    # (B, R) fp32, the sampling engine's own log-probs of the response tokens, 0 at padding; None when the
    # engine does not report them. The update corrects for their mismatch with the trainer's (rollout IS).
    rollout_log_probs: torch.Tensor | None = None
    # How many updates the weights that sampled the batch had (the rollout workers' of trainer.rollout_mode=async);
    # None where the actor's own weights sampled it.
    weights_version: int | None = None

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

    def position_ids(self) -> torch.Tensor:
        """Positions that skip the left padding, as generation used them."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> RolloutBatch:
        """Sample `params.n` responses for each prompt (token ids); rows of one prompt are adjacent.
        `progress(rows_done, rows_total, tokens_done, max_new_tokens)` is called as generation advances."""
        ...


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # One tensor from padded lists: a copy into the tensor per row costs more than the row's tokens.
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def right_pad(seqs: list[torch.Tensor], width: int, pad_id: int | float) -> torch.Tensor:
    """(len(seqs), width): the rows padded on the right with pad_id; token ids (long) for an int pad, fp32
    values (log-probs) for a float one."""
    out = torch.full((len(seqs), width), pad_id, dtype=torch.float32 if isinstance(pad_id, float) else torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def response_mask_from_eos(responses: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, list[str]]:
    """Mask up to and including the first EOS; rows without one ran out of length."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = (~after_eos).long()
    finished = is_eos.any(-1).tolist()
    return mask, ["stop" if f else "length" for f in finished]


# Odd 64-bit multipliers (from splitmix64 and the golden ratio), written as signed int64 values.
_MIX = [m - (1 << 64) if m >= 1 << 63 else m for m in
        (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)]


def counter_uniform(seed: int | torch.Tensor, rows: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row that depends only on (seed, row id, position): (b,).

    A counter-based hash (splitmix64's finaliser over int64, which wraps), so a response's random
    draws do not depend on which batch, chunk or worker generated it. That makes sampling the same
    on 1 and N workers, in either rollout engine, and after a resume. seed and position may be 0-d
    tensors on the rows' device, so a captured CUDA graph can advance them.
    """
    m = _MIX  # Python ints: no host-to-device copy, which a CUDA graph capture would refuse
    # 0-d CPU tensors mix with tensors on any device, and int64 tensor arithmetic wraps as the hash needs.
    seed = torch.as_tensor(seed, dtype=torch.int64)
    position = torch.as_tensor(position, dtype=torch.int64)
    x = rows.to(torch.int64) * m[1] + seed * m[0] + position * m[3]
    for mul in (m[1], m[2]):
        x = (x ^ ((x >> 31) & 0x1FFFFFFFF)) * mul
    x = x ^ ((x >> 29) & 0x7FFFFFFFF)
    return (((x >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)


def warp_logits(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering of (b, V) logits; cut tokens get -inf."""
    scores = scores.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the likeliest token always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_tokens(scores: torch.Tensor, params: SamplingParams, seed: int | torch.Tensor, rows: torch.Tensor,
                  position: int | torch.Tensor) -> torch.Tensor:
    """Next token of each row from its (b, V) logits: greedy, or a draw from softmax(warped logits).

    The draw inverts the cumulative distribution at u = counter_uniform(seed, row, position): token i
    is picked when cdf[i-1] <= u * cdf[-1] < cdf[i], which happens with probability p[i] and never for
    a token of probability 0. One random number per row, so it costs a pass over the probabilities, not
    a noise tensor the size of the logits (see invert_cdf).
    """
    if params.greedy:
        return scores.argmax(-1)
    warped = warp_logits(scores, params.temperature, params.top_k, params.top_p)
    # Unnormalised probabilities: invert_cdf takes any total, so softmax's division is not needed, and
    # compiled (the workbench engine on GPUs) the weights are recomputed where read, never written whole.
    weights = torch.exp(warped - warped.max(-1, keepdim=True).values)
    return invert_cdf(weights, counter_uniform(seed, rows, position))


CDF_BLOCK = 1024  # tokens per block of invert_cdf's first level


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of probs (b, V) (non-negative, any total) and u (b,) in (0, 1): the first token i with
    cdf[i] > u * total, never a token of probability 0. Returns (b,) int64.

    Two levels instead of a cumulative sum over the whole vocabulary (which writes and reads a (b, V)
    tensor every decoding step): sums of blocks of CDF_BLOCK tokens, their cumulative sum to find the
    block, then a cumulative sum inside that block only.
    """
    b, vocab = probs.shape
    whole = vocab // CDF_BLOCK * CDF_BLOCK
    sums = probs[:, :whole].view(b, -1, CDF_BLOCK).sum(-1)
    if whole < vocab:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], -1)
    block_cdf = sums.cumsum(-1)
    target = u * block_cdf[:, -1]
    # Rounding may put target at the very end: stay within the last block that holds any mass.
    last = sums.shape[1] - 1 - (sums > 0).flip(-1).int().argmax(-1)
    block = torch.minimum(torch.searchsorted(block_cdf, target.unsqueeze(-1), right=True).squeeze(-1), last)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    ids = block.unsqueeze(-1) * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    inside = probs.gather(-1, ids.clamp(max=vocab - 1)) * (ids < vocab)
    rest = (target - before).clamp(min=0).unsqueeze(-1)
    pick = torch.searchsorted(inside.cumsum(-1), rest, right=True).squeeze(-1)
    # The same rounding inside the block: fall back to its last token that has mass.
    last_inside = CDF_BLOCK - 1 - (inside > 0).flip(-1).int().argmax(-1)
    return block * CDF_BLOCK + torch.minimum(pick, last_inside)


class CounterSampler:
    """A logits processor that makes Hugging Face's greedy decoding sample: it leaves only the token
    `sample_tokens` draws (keyed by each row's global id), so a row samples the same tokens wherever
    it runs, and the same as in the workbench engine."""

    def __init__(self, params: SamplingParams, row_ids: torch.Tensor):
        self.params = params
        self.row_ids = row_ids
        self.start: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.start is None:
            self.start = input_ids.shape[1]
        tokens = sample_tokens(scores, self.params, self.params.seed, self.row_ids.to(scores.device),
                               input_ids.shape[1] - self.start)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens.unsqueeze(1), 0.0)


def eos_ids_of(model, tokenizer) -> list[int]:
    """Every id that ends a response: the generation config's EOS ids and the tokenizer's."""
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
        else tokenizer.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def assemble(prompts: list[list[int]], n: int, responses: list[torch.Tensor], eos_ids: list[int], pad_id: int,
             ignore_eos: bool = False) -> RolloutBatch:
    """The batch layout (see the module docstring) from each row's generated tokens (prompt-major rows,
    n per prompt); a response ends at its first EOS unless `ignore_eos`."""
    rows = [p for p in prompts for _ in range(n)]
    prompt_ids, prompt_mask = left_pad(rows, pad_id)
    width = max(max(len(r) for r in responses), 1)
    padded = right_pad(responses, width, pad_id)
    if ignore_eos:
        response_mask = (torch.arange(width) < torch.tensor([len(r) for r in responses]).unsqueeze(1)).long()
        finish = ["length"] * len(rows)
    else:
        response_mask, finish = response_mask_from_eos(padded, eos_ids)
    # A row that stopped early carries no tokens past its EOS; trim the columns nobody used.
    width = max(int(response_mask.sum(-1).max()), 1)
    padded = padded[:, :width].masked_fill(response_mask[:, :width] == 0, pad_id)
    response_mask = response_mask[:, :width]
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, padded], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        responses=padded,
        response_mask=response_mask,
        prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
        finish_reasons=finish,
    )


def concat_rows(parts: list[tuple[RolloutBatch, torch.Tensor]], pad_id: int) -> RolloutBatch:
    """The chosen rows (a (k,) index each) of several batches as one batch: prompts re-padded on the
    left, responses on the right, groups renumbered 0.. in order of appearance (DAPO's dynamic sampling
    keeps whole groups from several generation rounds)."""
    prompts, responses, finish, groups, log_probs = [], [], [], [], []
    for number, (batch, rows) in enumerate(parts):
        p = batch.prompt_length
        for i in rows.tolist():
            prompts.append(batch.input_ids[i, :p][batch.attention_mask[i, :p].bool()].tolist())
            responses.append(batch.responses[i, :int(batch.response_mask[i].sum())])
            finish.append(batch.finish_reasons[i])
            groups.append((number, int(batch.prompt_index[i])))
            if batch.rollout_log_probs is not None:
                log_probs.append(batch.rollout_log_probs[i, :len(responses[-1])])
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    lengths = torch.tensor([len(r) for r in responses])
    width = max(int(lengths.max()), 1)
    response_mask = (torch.arange(width) < lengths.unsqueeze(1)).long()
    padded = right_pad(responses, width, pad_id)
    order = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    rollout_log_probs = None
    if log_probs and len(log_probs) == len(responses):  # every part came from an engine that reports them
        rollout_log_probs = right_pad(log_probs, width, 0.0)
    return RolloutBatch(input_ids=torch.cat([prompt_ids, padded], 1),
                        attention_mask=torch.cat([prompt_mask, response_mask], 1), responses=padded,
                        response_mask=response_mask, prompt_index=torch.tensor([order[g] for g in groups]),
                        finish_reasons=finish, rollout_log_probs=rollout_log_probs)


class HFGenerateEngine:
    """Hugging Face `generate` on the actor's own model object: colocated, so it samples with the
    weights of the latest update and holds no second copy of the model."""

    def __init__(self, model, tokenizer, batch_size: int = 64, device: torch.device | None = None,
                 autocast: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # An FSDP worker names its device (its shards may sit in CPU memory) and computes in the
        # dtype FSDP gathers in, so it turns autocast off.
        self.device = device
        self.autocast = autocast
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id

    def generation_kwargs(self, params: SamplingParams, row_ids: torch.Tensor) -> dict:
        """What `model.generate` gets besides the inputs, for rows with these global ids."""
        from transformers import GenerationConfig, LogitsProcessorList

        # Sampling is done by CounterSampler on top of greedy decoding (see there), so HF's own
        # warpers and its global-RNG sampler stay off.
        config = GenerationConfig(do_sample=False, max_new_tokens=params.max_new_tokens,
                                  eos_token_id=[] if params.ignore_eos else self.eos_ids,  # None: the model's
                                  pad_token_id=self.pad_id, top_k=None, top_p=None, temperature=None)
        processors = None if params.greedy else LogitsProcessorList([CounterSampler(params, row_ids)])
        return {"generation_config": config, "logits_processor": processors}

    def _progress_criteria(self, progress, done: int, total: int, max_new_tokens: int):
        """A stopping criterion that never stops: it reports each decoding step, so a watcher sees
        generation advance token by token instead of waiting for a whole chunk."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Report(StoppingCriteria):
            def __init__(self):
                self.tokens = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.tokens += 1
                progress(done, total, self.tokens, max_new_tokens)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([Report()])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None,
                 first_row: int = 0, row_ids: list[int] | None = None) -> RolloutBatch:
        """`first_row` is the global id of this call's first row (prompt-major, n rows per prompt): the
        key of each row's random draws, so a worker given a slice of the batch samples what one worker
        given the whole batch would; or `row_ids`, each row's (episodes' turns key rows by episode)."""
        device = self.device or next(self.model.parameters()).device
        rows = [p for p in prompts for _ in range(params.n)]
        row_ids = torch.tensor(row_ids) if row_ids is not None else torch.arange(first_row, first_row + len(rows))
        prompt_ids, prompt_mask = left_pad(rows, self.pad_id)
        was_training = self.model.training
        self.model.eval()
        responses: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            ids = prompt_ids[start:start + self.batch_size].to(device)
            mask = prompt_mask[start:start + self.batch_size].to(device)
            criteria = None if progress is None else self._progress_criteria(
                progress, start, len(rows), params.max_new_tokens)
            settings = self.generation_kwargs(params, row_ids[start:start + self.batch_size])
            with amp_context(device) if self.autocast else contextlib.nullcontext():
                out = self.model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=criteria, **settings)
            responses.extend(out[:, ids.shape[1]:].cpu())
        self.model.train(was_training)
        return assemble(prompts, params.n, responses, self.eos_ids, self.pad_id, params.ignore_eos)
