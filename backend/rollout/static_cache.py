"""The workbench rollout engine: a static-cache decode loop for Llama-family models (Llama, Mistral,
Qwen2, Qwen3), written against the weights rather than Hugging Face's modules.

Why not `model.generate`: with a left-padded batch, Hugging Face's attention expands every KV head
and runs over the whole cache at each step, and its cache grows by reallocation (docs/performance.md
compares the two). Here:

- The KV cache is allocated once, (rows, kv_heads, slots, head_dim) per layer, and reused every step; in the
  compute dtype, or FP8 (`rollout.kv_cache_dtype=fp8`: half the bytes a decode step reads, each key and value
  rounded to 3 mantissa bits; the prompt's own attention in its prefill uses them unrounded).
- Decode attention groups the query heads by KV head, so each key and value is read once per step.
  On a GPU it is one Triton kernel (backend.kernels.decode_attention) that writes the step's key and value into
  the cache and reads exactly the slots written so far; elsewhere PyTorch's attention reads the written
  slots, rounded up to a bucket of `SPAN` when steps are captured in graphs.
- On a GPU each decode step (for a batch size) is captured once in a CUDA graph and replayed; the
  step advances its own token, position and slot counters, so the host only replays.
- The engine keeps its own copy of the weights in the compute dtype, at fixed addresses (what a
  CUDA graph needs). `load_weights` copies the actor's current weights in after each update, on the
  device, with no disk round trip.

Sampling is `rollout.sample_tokens` keyed by (seed, global row id, position), so a row gets the same
tokens here as from `HFGenerateEngine`, on any worker, in any batch.

Cache slots of a batch (`generate`): the prompt occupies slots [0, P) left-padded (P = longest prompt),
response token t is written at slot P + t; a key is attended when its slot holds a real prompt token or a
response token already generated. Every row has its own slot counter, so in `play` (multi-turn episodes)
a row holds one episode from slot 0 on, its prompt, turns and observations back to back, and decodes
beside rows at other turns; an observation is appended by a prefill of its own tokens only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.core.lora import effective_weight
from backend.kernels import decode_attention
from backend.rollout.base import (
    RolloutBatch,
    SamplingParams,
    Turn,
    assemble,
    eos_ids_of,
    fingerprint,
    left_pad,
    right_pad,
    sample_tokens,
    stale_tensors,
)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SPAN = 32  # cache slots per attention bucket: each bucket is one captured graph
SYNC_EVERY = 8  # decode steps between checks whether every row has finished
KV_DTYPES = {"auto": None, "fp8": decode_attention.FP8}  # rollout.kv_cache_dtype -> the cache's (None: compute)


def unsupported_reason(config) -> str | None:
    """Why a model with this Hugging Face config cannot run in the workbench engine, or None."""
    arch = (getattr(config, "architectures", None) or ["(no architecture)"])[0]
    if arch not in ARCHITECTURES:
        return f"its architecture {arch} is not one the workbench engine runs ({', '.join(ARCHITECTURES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act} (the workbench engine runs silu MLPs)"
    if getattr(config, "use_sliding_window", False):
        return "it uses sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        return f"its rope type {rope_type!r} changes frequencies with the sequence length"
    return None


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _layer_sources(layer) -> dict[str, list[torch.Tensor] | None]:
    """Each `_Layer` field's source tensors in a Hugging Face decoder layer (fused ones in order), or None."""
    att, mlp = layer.self_attn, layer.mlp

    def optional(module, name: str) -> list[torch.Tensor] | None:
        tensor = getattr(module, name, None) if module is not None else None
        return None if tensor is None else [tensor]

    w = effective_weight  # a LoRA layer's weight with its adapters merged in

    return {
        "ln1": [layer.input_layernorm.weight],
        "qkv": [w(att.q_proj), w(att.k_proj), w(att.v_proj)],
        "qkv_bias": None if att.q_proj.bias is None else [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias],
        "q_norm": optional(getattr(att, "q_norm", None), "weight"),
        "k_norm": optional(getattr(att, "k_norm", None), "weight"),
        "o": [w(att.o_proj)],
        "o_bias": optional(att.o_proj, "bias"),
        "ln2": [layer.post_attention_layernorm.weight],
        "gate_up": [w(mlp.gate_proj), w(mlp.up_proj)],
        "down": [w(mlp.down_proj)],
    }


# The Hugging Face names of each `_Layer` field's source tensors, in `_layer_sources`'s order.
_SOURCE_NAMES = {
    "ln1": ["input_layernorm.weight"],
    "qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "qkv_bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "q_norm": ["self_attn.q_norm.weight"],
    "k_norm": ["self_attn.k_norm.weight"],
    "o": ["self_attn.o_proj.weight"],
    "o_bias": ["self_attn.o_proj.bias"],
    "ln2": ["post_attention_layernorm.weight"],
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": ["mlp.down_proj.weight"],
}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face's Llama computes it: normalise in fp32, scale in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., heads, D) with cos/sin (..., 1, D), halves rotated as in Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _gather(futures: list[concurrent.futures.Future], quiet_s: float) -> None:
    """Wait for the first future, then for more as long as each next one finishes within quiet_s of the one
    before. A decode step costs nearly the same for a few rows as for all, so rows whose environments answer
    close together start their turns together; a slow environment holds up no one for long."""
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
    finished, last = sum(f.done() for f in futures), time.perf_counter()
    while finished < len(futures) and time.perf_counter() - last < quiet_s:
        time.sleep(quiet_s / 10)
        now = sum(f.done() for f in futures)
        if now > finished:
            finished, last = now, time.perf_counter()


class StaticCacheEngine:
    """A rollout engine (see backend.rollout.base.RolloutEngine) for `unsupported_reason(model) is None`.

    model: the actor (possibly FSDP-sharded); it is read only by `load_weights`, which must be called
    while its parameters are whole (under `distributed.unsharded`) before the first `generate` and
    after every update (with free_after_generate, before every `generate`). max_len: the longest prompt
    plus response expected, to size the cache.
    """

    def __init__(self, model, tokenizer, batch_size: int, device: torch.device, dtype: torch.dtype,
                 max_len: int, cuda_graphs: bool = True, free_after_generate: bool = True,
                 kv_dtype: torch.dtype | None = None):
        cfg = model.config
        self.batch_size, self.device, self.dtype = batch_size, device, dtype
        self.kv_dtype = kv_dtype or dtype
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().to(device)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.kernel_attention = decode_attention.available(device, self.kv_dtype)
        self.free_after_generate = free_after_generate
        # With graphs, the per-layer pieces of a decode step are compiled too: fusing the norms, rotary
        # embedding and gated MLP matters once kernel launches no longer hide the small kernels' cost.
        # Their shapes do not depend on the attention bucket, so each compiles once per batch size.
        self._decode_qkv = torch.compile(self._stored_qkv) if self.cuda_graphs else self._stored_qkv
        self._decode_finish = torch.compile(self._finish_apart) if self.cuda_graphs else self._finish_apart
        # Sampling reads the (b, V) logits a few times; compiled, those reads are two fused passes that
        # write nothing of the vocabulary's size (eager: 15% of generation's device time on an H200).
        self._decode_sample = torch.compile(self._sample) if self.cuda_graphs else self._sample
        self.max_len = max_len
        self.layers: list[_Layer] = []
        self.embed = self.norm = self.lm_head = None
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None

    # ---- weights ----

    @torch.no_grad()
    def load_weights(self, model) -> None:
        """Copy the model's current (whole, gathered) weights into the engine's buffers: allocated when
        the engine holds none (the first call, or after `release`), else overwritten in place (slice by
        slice, no temporary)."""
        base = model.model
        first = not self.layers
        for i, layer in enumerate(base.layers):
            sources = _layer_sources(layer)
            if first:
                self.layers.append(_Layer(**{k: self._fill(None, v) for k, v in sources.items()}))
            else:
                for k, v in sources.items():
                    self._fill(getattr(self.layers[i], k), v)
        self.embed = self._fill(self.embed, [base.embed_tokens.weight])
        self.norm = self._fill(self.norm, [base.norm.weight])
        self.lm_head = self.embed if self.tied else self._fill(self.lm_head, [model.lm_head.weight])

    @torch.no_grad()
    def stale_tensors(self, model) -> list[str]:
        """The names of the actor's weights whose copy in the engine differs from them, as the engine stores
        them (its dtype): empty right after a whole `load_weights` (a sample of each compared)."""
        base = model.model
        pairs = []

        def compare(name: str, dst: torch.Tensor | None, parts: list[torch.Tensor] | None, part_names: list[str]):
            if dst is None or parts is None:
                return
            start = 0
            for part, part_name in zip(parts, part_names, strict=True):
                pairs.append((f"{name}{part_name}", fingerprint(dst[start:start + part.shape[0]]), fingerprint(part)))
                start += part.shape[0]

        for i, layer in enumerate(base.layers):
            for k, parts in _layer_sources(layer).items():
                compare(f"model.layers.{i}.", getattr(self.layers[i], k), parts, _SOURCE_NAMES[k])
        compare("model.", self.embed, [base.embed_tokens.weight], ["embed_tokens.weight"])
        compare("model.", self.norm, [base.norm.weight], ["norm.weight"])
        if not self.tied:
            compare("", self.lm_head, [model.lm_head.weight], ["lm_head.weight"])
        return stale_tensors(pairs)

    def _fill(self, dst: torch.Tensor | None, parts: list[torch.Tensor] | None) -> torch.Tensor | None:
        """`parts` stacked along dim 0 into `dst` (a new buffer in the engine's device and dtype if None)."""
        if parts is None:
            return None
        if dst is None:
            return torch.cat([p.detach() for p in parts]).to(device=self.device, dtype=self.dtype)
        start = 0
        for p in parts:
            dst[start:start + p.shape[0]].copy_(p.detach())
            start += p.shape[0]
        return dst

    # ---- the model ----

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., 1, D) for integer positions (...), computed in fp32 as Hugging Face does."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.rope_scale).to(self.dtype).unsqueeze(-2),
                (emb.sin() * self.rope_scale).to(self.dtype).unsqueeze(-2))

    def _qkv(self, w: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected, normalised and rotated q (..., heads, D), k and v (..., kv_heads, D)."""
        h = _rms(x, w.ln1, self.eps)
        qkv = F.linear(h, w.qkv, w.qkv_bias)
        d, heads = self.head_dim, self.n_heads + self.n_kv
        qk, v = qkv.split([heads * d, self.n_kv * d], dim=-1)
        qk, v = qk.unflatten(-1, (heads, d)), v.unflatten(-1, (self.n_kv, d))
        # Queries and keys are normalised and rotated as one tensor: compiled, one kernel a layer instead of two.
        if w.q_norm is not None:
            norm = torch.cat((w.q_norm.expand(self.n_heads, d), w.k_norm.expand(self.n_kv, d)))
            qk = _rms(qk, norm, self.eps)
        q, k = _rope(qk, cos, sin).split([self.n_heads, self.n_kv], dim=-2)
        return q, k, v

    def _stored_qkv(self, w: _Layer, x: torch.Tensor, mlp: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor):
        """A decode step's residual stream x + mlp (mlp: the previous layer's MLP output, see `_finish_apart`;
        None in the first layer), its query, and its key and value as the cache holds them. Compiled, the add
        is fused into the norm's kernel and the rounding to an FP8 cache into the step's own kernels."""
        if mlp is not None:
            x = x + mlp
        q, k, v = self._qkv(w, x, cos, sin)
        return x, q, self._storable(k), self._storable(v)

    def _finish_layer(self, w: _Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the gated MLP block."""
        x, mlp = self._finish_apart(w, x, attended)
        return x + mlp

    def _finish_apart(self, w: _Layer, x: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_finish_layer` without its last residual add: the residual stream after attention, and the MLP's
        output. A decode step adds the two in the next layer's norm kernel. The first add is written in fp32 and
        rounded, which is how PyTorch adds two bf16 tensors anyway: as `x + F.linear(...)` returned from a
        compiled graph, inductor makes it an addmm, which first copies x into its output (a kernel more a layer)."""
        x = (x.float() + F.linear(attended, w.o, w.o_bias).float()).to(x.dtype)
        gate, up = F.linear(_rms(x, w.ln2, self.eps), w.gate_up).chunk(2, dim=-1)
        return x, F.linear(F.silu(gate) * up, w.down)

    def _storable(self, t: torch.Tensor) -> torch.Tensor:
        """t as the cache holds it: in an FP8 cache clamped to its range first (e4m3 has no infinity, and what a
        cast does past the range differs between libraries; clamped, every path stores the same values)."""
        if self.kv_dtype == decode_attention.FP8:
            most = torch.finfo(self.kv_dtype).max
            t = t.clamp(-most, most)
        return t.to(self.kv_dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(x, self.norm, self.eps), self.lm_head).float()

    def _sample(self, x: torch.Tensor, mlp: torch.Tensor, params: SamplingParams, seed: torch.Tensor,
                rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The next token of each row from the last layer's output x + mlp (b, hidden; see `_finish_apart`)."""
        return sample_tokens(self._logits(x + mlp), params, seed, rows, t)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts (b, P), fill cache slots [0, P); logits of the last position (b, V)."""
        b, p = ids.shape
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._rotary(positions)
        keep = mask.bool()
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
        # A padding query attends to itself, so no row of the mask is empty (an empty row gives NaN).
        allowed = (causal & keep[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        x = F.embedding(ids, self.embed)
        for w, (kc, vc) in zip(self.layers, self.cache, strict=True):
            q, k, v = self._qkv(w, x, cos, sin)
            kc[:b, :, :p].copy_(self._storable(k).transpose(1, 2))
            vc[:b, :, :p].copy_(self._storable(v).transpose(1, 2))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=allowed[:, None], enable_gqa=self.n_kv != self.n_heads)
            x = self._finish_layer(w, x, out.transpose(1, 2).flatten(-2))
        return self._logits(x[:, -1])

    def _decode_step(self, s: dict, b: int, span: int, params: SamplingParams) -> None:
        """One token for each unfinished row of the first b rows, each attending to its cache slots
        [0, slot[row]] (within [0, span)): reads the state tensors in `s` and advances them in place
        (graph-capturable: no host values change). A finished row holds still: it writes its last token's
        key and value into the same slot again and keeps its counters, so its cache ends where its
        tokens end and a next turn can be appended there (see `play`)."""
        tok, pos, slot, t = s["tok"][:b], s["pos"][:b], s["slot"][:b], s["t"][:b]
        index = s["index"][:b]
        cos, sin = self._rotary(pos)
        if not self.kernel_attention:
            slots = torch.arange(span, device=tok.device)
            attend = (s["valid"][:b, :span] & (slots <= slot.unsqueeze(1))).view(b, 1, 1, span)
        g = self.n_heads // self.n_kv
        x, mlp = F.embedding(tok, self.embed), None
        for w, (kc, vc) in zip(self.layers, self.cache, strict=True):
            x, q, k, v = self._decode_qkv(w, x, mlp, cos, sin)
            # (b, kv, g, D) against (b, kv, slots, D): each KV head is read once for its g query heads.
            q = q.reshape(b, self.n_kv, g, self.head_dim)
            if self.kernel_attention:  # the kernel writes k and v into the cache itself
                out = decode_attention.decode_attention(q, kc, vc, k, v, s["valid"], slot)
            else:
                kc[index, :, slot] = k
                vc[index, :, slot] = v
                out = F.scaled_dot_product_attention(q, kc[:b, :, :span].to(q.dtype), vc[:b, :, :span].to(q.dtype),
                                                     attn_mask=attend)
            x, mlp = self._decode_finish(w, x, out.flatten(1))
        nxt = self._decode_sample(x, mlp, params, s["seed"][:b], s["rows"][:b], t)
        done = s["done"][:b]
        live = ~done
        s["out"][index, t] = torch.where(live, nxt, self.pad_id)
        tok.copy_(torch.where(live, nxt, tok))
        moved = live.long()
        pos.add_(moved)
        slot.add_(moved)
        t.add_(moved)
        ended = t >= s["cap"][:b]
        if not params.ignore_eos:
            ended |= torch.isin(nxt, s["eos"])
        done |= live & ended

    # ---- generation ----

    def _allocate(self, slots: int) -> None:
        """KV cache and step state for batch_size rows and `slots` slots; drops graphs of an older size."""
        shape = (self.batch_size, self.n_kv, slots, self.head_dim)
        self.cache = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                       torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in self.layers]
        bsz = self.batch_size

        def zeros(*size, dtype=torch.long):
            return torch.zeros(size, dtype=dtype, device=self.device)

        self.state = {
            # per row: the token to run, its position and cache slot, how many tokens its turn has
            # sampled (t) and may sample (cap), the key of its draws (seed, rows), whether it finished
            "tok": zeros(bsz), "pos": zeros(bsz), "slot": zeros(bsz), "t": zeros(bsz), "cap": zeros(bsz),
            "seed": zeros(bsz), "rows": zeros(bsz), "done": zeros(bsz, dtype=torch.bool),
            "index": torch.arange(bsz, device=self.device), "valid": zeros(bsz, slots, dtype=torch.bool),
            "out": zeros(bsz, slots),
            "eos": torch.tensor(self.eos_ids, dtype=torch.long, device=self.device),
        }
        self.graphs.clear()

    def release(self) -> None:
        """Free the KV cache, the step state, the captured graphs (they hold the cache's addresses) and the
        weights, so the training phases get that memory: the weights are stale once the update runs, and
        the next `load_weights` allocates them again, as the next `generate` does the cache and graphs."""
        self.cache, self.state = [], {}
        self.layers, self.embed, self.norm, self.lm_head = [], None, None, None
        self.graphs.clear()
        self.pool = None

    def _step(self, b: int, span: int, params: SamplingParams) -> None:
        if not self.cuda_graphs:
            self._decode_step(self.state, b, span, params)
            return
        key = (b, span, params.greedy, params.temperature, params.top_k, params.top_p, params.ignore_eos)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(b, span, params)
        graph.replay()

    def _capture(self, b: int, span: int, params: SamplingParams) -> torch.cuda.CUDAGraph:
        """Record one decode step; a warm-up run first (lazy kernel and workspace set-up must not happen
        during capture), with the step's state saved and put back so the warm-up leaves no trace."""
        saved = {k: v.clone() for k, v in self.state.items() if k not in ("valid", "eos", "index")}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._decode_step(self.state, b, span, params)
        torch.cuda.current_stream().wait_stream(side)
        for k, v in saved.items():
            self.state[k].copy_(v)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._decode_step(self.state, b, span, params)
        return graph

    def _ended(self, first: torch.Tensor, cap: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Whether a turn whose first sampled token is `first` is over already."""
        ended = cap <= 1
        return ended if params.ignore_eos else ended | torch.isin(first, self.state["eos"])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None,
                 first_row: int = 0, row_ids: list[int] | None = None) -> RolloutBatch:
        """n responses per prompt (rows prompt-major); `first_row` is the global id of the first row,
        the key of its random draws (see HFGenerateEngine.generate), or `row_ids` each row's."""
        if not self.layers:
            raise RuntimeError("StaticCacheEngine.generate before load_weights")
        rows = [p for p in prompts for _ in range(params.n)]
        prompt_ids, prompt_mask = left_pad(rows, self.pad_id)
        p, r = prompt_ids.shape[1], params.max_new_tokens
        slots = max(self.max_len, p + r)
        if not self.cache or self.cache[0][0].shape[2] < slots:
            self._allocate(slots)
        slots = self.cache[0][0].shape[2]
        s = self.state
        keys = torch.tensor(row_ids) if row_ids is not None else torch.arange(first_row, first_row + len(rows))
        responses: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            ids = prompt_ids[start:start + self.batch_size].to(self.device)
            mask = prompt_mask[start:start + self.batch_size].to(self.device)
            b = ids.shape[0]
            s["rows"][:b].copy_(keys[start:start + b])
            s["seed"][:b].fill_(params.seed)
            s["valid"][:b].fill_(True)
            s["valid"][:b, :p].copy_(mask.bool())
            s["out"][:b].fill_(self.pad_id)
            first = sample_tokens(self._prefill(ids, mask), params, params.seed, s["rows"][:b], 0)
            s["out"][:b, 0] = first
            s["tok"][:b].copy_(first)
            s["pos"][:b].copy_(mask.sum(-1))
            s["slot"][:b].fill_(p)
            s["t"][:b].fill_(1)
            s["cap"][:b].fill_(r)
            s["done"][:b] = self._ended(first, torch.full_like(first, r), params)
            made = 1
            while made < r:
                if made % SYNC_EVERY == 0:
                    if progress is not None:
                        progress(start, len(rows), made, r)
                    if not params.ignore_eos and bool(s["done"][:b].all()):
                        break
                # Slots [0, p + made) are written. The kernel finds that bound itself (one graph for all
                # steps); PyTorch's attention in a graph reads a whole bucket of slots.
                if self.kernel_attention:
                    span = slots
                elif self.cuda_graphs:
                    span = min(slots, math.ceil((p + made) / SPAN) * SPAN)
                else:
                    span = p + made
                self._step(b, span, params)
                made += 1
            if progress is not None:
                progress(start, len(rows), made, r)
            responses.extend(s["out"][:b, :made].to("cpu", copy=True))
        if self.free_after_generate:
            self.release()
        return assemble(prompts, params.n, responses, self.eos_ids, self.pad_id, params.ignore_eos)

    # ---- episodes ----

    def _extend(self, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Append each chunk of token ids to its cache row (`rows[i]` gets `chunks[i]`) from the row's slot
        and position on: the chunk's keys and values are written after what the row holds, its queries
        attend to the row's cache and causally within the chunk, and nothing the row holds is computed
        again. Returns the logits (k, V) after each chunk's last token."""
        s = self.state
        index = torch.tensor(rows, device=self.device)
        lengths = torch.tensor([len(c) for c in chunks], device=self.device)
        width = max(len(c) for c in chunks)
        ids = right_pad([torch.tensor(c) for c in chunks], width, self.pad_id).to(self.device)
        start_slot, start_pos = s["slot"][index], s["pos"][index]
        offsets = torch.arange(width, device=self.device)
        query_slots = start_slot.unsqueeze(1) + offsets  # (k, width)
        real = offsets < lengths.unsqueeze(1)
        span = int((start_slot + lengths).max())
        # A query reads its row's written slots up to its own; a padding query (past its chunk's end)
        # reads the same and is dropped, so no mask row is empty.
        before = torch.arange(span, device=self.device) <= query_slots.unsqueeze(2)
        allowed = s["valid"][index, :span].unsqueeze(1) & before
        write_rows = index.unsqueeze(1).expand_as(real)[real]
        write_slots = query_slots[real]
        # Queries grouped by KV head, (k, kv, g * width, D), as in a decode step: each row's cached keys and
        # values are read once for their g query heads instead of being repeated g times.
        rows_n, g, d = len(rows), self.n_heads // self.n_kv, self.head_dim
        grouped_mask = allowed.unsqueeze(1).expand(rows_n, g, width, span).reshape(rows_n, 1, g * width, span)
        cos, sin = self._rotary(start_pos.unsqueeze(1) + offsets)
        x = F.embedding(ids, self.embed)
        for w, (kc, vc) in zip(self.layers, self.cache, strict=True):
            q, k, v = self._qkv(w, x, cos, sin)
            kc[write_rows, :, write_slots] = self._storable(k[real])
            vc[write_rows, :, write_slots] = self._storable(v[real])
            q = q.view(rows_n, width, self.n_kv, g, d).permute(0, 2, 3, 1, 4).reshape(rows_n, self.n_kv, g * width, d)
            out = F.scaled_dot_product_attention(q, kc[index, :, :span].to(q.dtype), vc[index, :, :span].to(q.dtype),
                                                 attn_mask=grouped_mask)
            out = out.view(rows_n, self.n_kv, g, width, d).permute(0, 3, 1, 2, 4).reshape(rows_n, width, -1)
            x = self._finish_layer(w, x, out)
        s["slot"][index] = start_slot + lengths
        s["pos"][index] = start_pos + lengths
        return self._logits(x[torch.arange(len(rows), device=self.device), lengths - 1])

    def _begin(self, starts: list[tuple[int, int, Turn, bool]], params: SamplingParams, first_row: int) -> None:
        """Start a turn in each (cache row, episode, turn, whether the episode is new): a new episode's prompt
        fills its row from slot 0 (what the row held before is never read again); a next turn's ids are
        appended after the row's last sampled token, which goes first (a turn may end before a decode
        step has written that token's key and value; writing them again changes nothing). Then each
        row's first token of the turn is sampled."""
        s = self.state
        rows = [row for row, _, _, _ in starts]
        index = torch.tensor(rows, device=self.device)
        fresh = [row for row, _, _, new in starts if new]
        if fresh:
            at = torch.tensor(fresh, device=self.device)
            s["slot"][at] = 0
            s["pos"][at] = 0
            s["valid"][at] = True
        last = s["tok"][index].tolist()
        chunks = [turn.ids if new else [last[i]] + turn.ids for i, (_, _, turn, new) in enumerate(starts)]
        logits = self._extend(rows, chunks)
        seeds = torch.tensor([turn.seed for _, _, turn, _ in starts], device=self.device)
        keys = torch.tensor([first_row + episode for _, episode, _, _ in starts], device=self.device)
        caps = torch.tensor([turn.max_new_tokens for _, _, turn, _ in starts], device=self.device)
        first = sample_tokens(logits, params, seeds, keys, 0)
        s["seed"][index], s["rows"][index], s["cap"][index] = seeds, keys, caps
        s["out"][index, 0] = first
        s["tok"][index] = first
        s["t"][index] = 1
        s["done"][index] = self._ended(first, caps, params)

    @torch.no_grad()
    def play(self, first_turns: list[Turn | None], params: SamplingParams, end_turn: Callable[[int, list[int], bool],
             concurrent.futures.Future], most_tokens: int, progress=None, first_row: int = 0) -> float:
        """Run episodes to their end, each in its own cache row for its whole life: episode i starts with
        first_turns[i] (None: it has nothing to generate); when a turn ends, `end_turn(i, sampled ids,
        stopped at EOS)` answers with a future of the episode's next turn (the observation ids to
        append and its budget) or None when the episode is over. Rows decode while others wait for
        their environment, so rows of the batch are at different turns at once; a next turn is appended
        to the row's cache, so the prefix is never prefilled again; a finished episode's row takes the
        next episode waiting. most_tokens bounds an episode's tokens after its prompt (the cache's size).
        Draws are keyed by (turn.seed, first_row + i, position in the turn), as `generate` keys a row.
        Returns the seconds it waited with no row to decode (every unfinished episode at its environment)."""
        if not self.layers:
            raise RuntimeError("StaticCacheEngine.play before load_weights")
        waiting = collections.deque(i for i, turn in enumerate(first_turns) if turn is not None)
        if not waiting:
            return 0.0
        slots = max(self.max_len, max(len(first_turns[i].ids) for i in waiting) + most_tokens)
        if not self.cache or self.cache[0][0].shape[2] < slots:
            self._allocate(slots)
        slots = self.cache[0][0].shape[2]
        s = self.state
        b = min(self.batch_size, len(waiting))
        free = list(range(b))
        episode_of: dict[int, int] = {}  # cache row -> episode
        pending: dict[int, concurrent.futures.Future] = {}  # cache row -> its turn's end being handled
        starts: list[tuple[int, int, Turn, bool]] = []
        finished, waited = 0, 0.0
        window_s = 0.0  # how long the last decode window took
        while True:
            while free and waiting:
                episode = waiting.popleft()
                row = free.pop()
                episode_of[row] = episode
                starts.append((row, episode, first_turns[episode], True))
            if starts:
                self._begin(starts, params, first_row)
                starts = []
            done, t, cap, slot = torch.stack([s["done"][:b].long(), s["t"][:b], s["cap"][:b], s["slot"][:b]]).tolist()
            running = [row for row in episode_of if not done[row] and row not in pending]
            if running:
                # The window ends where the first running row's turn must end (exactly there with EOS ignored).
                steps = max(1, min(SYNC_EVERY, *(cap[row] - t[row] for row in running)))
                start = time.perf_counter()
                high = max(slot)
                for _ in range(steps):
                    if self.kernel_attention:
                        span = slots
                    else:
                        high += 1
                        span = min(slots, math.ceil(high / SPAN) * SPAN) if self.cuda_graphs else min(slots, high)
                    self._step(b, span, params)
                done, t = torch.stack([s["done"][:b].long(), s["t"][:b]]).tolist()
                window_s = time.perf_counter() - start
            ended = [row for row in episode_of if done[row] and row not in pending]
            if ended:
                out = s["out"][:b].to("cpu")
                for row in ended:
                    sampled = out[row, :t[row]].tolist()
                    stopped = not params.ignore_eos and sampled[-1] in self.eos_ids
                    pending[row] = end_turn(episode_of[row], sampled, stopped)
            if not pending and not episode_of:
                break
            if not any(not done[row] for row in episode_of) and pending:
                start = time.perf_counter()
                _gather(list(pending.values()), window_s)
                waited += time.perf_counter() - start
            for row in [r for r, f in pending.items() if f.done()]:
                turn = pending.pop(row).result()
                if turn is None:
                    del episode_of[row]
                    free.append(row)
                    finished += 1
                else:
                    starts.append((row, episode_of[row], turn, False))
            if progress is not None:
                progress(finished, len(first_turns))
        if self.free_after_generate:
            self.release()
        return waited
