"""The workbench rollout engine: a static-cache decode loop for Llama-family models (Llama, Mistral,
Qwen2, Qwen3), written against the weights rather than Hugging Face's modules.

Why not `model.generate`: with a left-padded batch, Hugging Face's attention expands every KV head
and runs over the whole cache at each step, and its cache grows by reallocation (docs/performance.md
compares the two). Here:

- The KV cache is allocated once, (rows, kv_heads, slots, head_dim) per layer, and reused every step.
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

Cache slots of a batch: the prompt occupies slots [0, P) left-padded (P = longest prompt), response
token t is written at slot P + t; a key is attended when its slot holds a real prompt token or a
response token already generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.core.lora import effective_weight
from backend.kernels import decode_attention
from backend.rollout.base import RolloutBatch, SamplingParams, assemble, eos_ids_of, left_pad, sample_tokens

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SPAN = 32  # cache slots per attention bucket: each bucket is one captured graph
SYNC_EVERY = 8  # decode steps between checks whether every row has finished


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


class StaticCacheEngine:
    """A rollout engine (see backend.rollout.base.RolloutEngine) for `unsupported_reason(model) is None`.

    model: the actor (possibly FSDP-sharded); it is read only by `load_weights`, which must be called
    while its parameters are whole (under `distributed.unsharded`) before the first `generate` and
    after every update (with free_after_generate, before every `generate`). max_len: the longest prompt
    plus response expected, to size the cache.
    """

    def __init__(self, model, tokenizer, batch_size: int, device: torch.device, dtype: torch.dtype,
                 max_len: int, cuda_graphs: bool = True, free_after_generate: bool = True):
        cfg = model.config
        self.batch_size, self.device, self.dtype = batch_size, device, dtype
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
        self.kernel_attention = decode_attention.available(device)
        self.free_after_generate = free_after_generate
        # With graphs, the per-layer pieces of a decode step are compiled too: fusing the norms, rotary
        # embedding and gated MLP matters once kernel launches no longer hide the small kernels' cost.
        # Their shapes do not depend on the attention bucket, so each compiles once per batch size.
        self._decode_qkv = torch.compile(self._qkv) if self.cuda_graphs else self._qkv
        self._decode_finish = torch.compile(self._finish_layer) if self.cuda_graphs else self._finish_layer
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
        d = self.head_dim
        q, k, v = qkv.split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, k, v = q.unflatten(-1, (self.n_heads, d)), k.unflatten(-1, (self.n_kv, d)), v.unflatten(-1, (self.n_kv, d))
        if w.q_norm is not None:
            q, k = _rms(q, w.q_norm, self.eps), _rms(k, w.k_norm, self.eps)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish_layer(self, w: _Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the gated MLP block."""
        x = x + F.linear(attended, w.o, w.o_bias)
        gate, up = F.linear(_rms(x, w.ln2, self.eps), w.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(x, self.norm, self.eps), self.lm_head).float()

    def _sample(self, x: torch.Tensor, params: SamplingParams, seed: torch.Tensor, rows: torch.Tensor,
                t: torch.Tensor) -> torch.Tensor:
        """The next token of each row from the last layer's output x (b, hidden)."""
        return sample_tokens(self._logits(x), params, seed, rows, t)

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
            kc[:b, :, :p].copy_(k.transpose(1, 2))
            vc[:b, :, :p].copy_(v.transpose(1, 2))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=allowed[:, None], enable_gqa=self.n_kv != self.n_heads)
            x = self._finish_layer(w, x, out.transpose(1, 2).flatten(-2))
        return self._logits(x[:, -1])

    def _decode_step(self, s: dict, b: int, span: int, params: SamplingParams) -> None:
        """One token for each of the first b rows, attending to cache slots [0, span): reads the state
        tensors in `s` and advances them in place (graph-capturable: no host values change)."""
        tok, pos, slot = s["tok"][:b], s["pos"][:b], s["slot"]
        cos, sin = self._rotary(pos)
        if not self.kernel_attention:
            slots = torch.arange(span, device=tok.device)
            attend = (s["valid"][:b, :span] & (slots <= slot)).view(b, 1, 1, span)
        g = self.n_heads // self.n_kv
        x = F.embedding(tok, self.embed)
        for w, (kc, vc) in zip(self.layers, self.cache, strict=True):
            q, k, v = self._decode_qkv(w, x, cos, sin)
            # (b, kv, g, D) against (b, kv, slots, D): each KV head is read once for its g query heads.
            q = q.reshape(b, self.n_kv, g, self.head_dim)
            if self.kernel_attention:  # the kernel writes k and v into the cache itself
                out = decode_attention.decode_attention(q, kc, vc, k, v, s["valid"], slot)
            else:
                kc[:b].index_copy_(2, slot, k.unsqueeze(2))
                vc[:b].index_copy_(2, slot, v.unsqueeze(2))
                out = F.scaled_dot_product_attention(q, kc[:b, :, :span], vc[:b, :, :span], attn_mask=attend)
            x = self._decode_finish(w, x, out.flatten(1))
        nxt = self._decode_sample(x, params, s["seed"], s["rows"][:b], s["t"])
        done = s["done"][:b]
        if not params.ignore_eos:
            nxt = torch.where(done, self.pad_id, nxt)
            done |= torch.isin(nxt, s["eos"])
        s["out"][:b].index_copy_(1, s["t"].view(1), nxt.unsqueeze(1))
        tok.copy_(nxt)
        pos.add_(1)
        slot.add_(1)
        s["t"].add_(1)

    # ---- generation ----

    def _allocate(self, slots: int) -> None:
        """KV cache and step state for batch_size rows and `slots` slots; drops graphs of an older size."""
        shape = (self.batch_size, self.n_kv, slots, self.head_dim)
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]
        bsz = self.batch_size

        def zeros(*size, dtype=torch.long):
            return torch.zeros(size, dtype=dtype, device=self.device)

        self.state = {
            "tok": zeros(bsz), "pos": zeros(bsz), "slot": zeros(1), "t": zeros(), "seed": zeros(), "rows": zeros(bsz),
            "done": zeros(bsz, dtype=torch.bool), "valid": zeros(bsz, slots, dtype=torch.bool),
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
        saved = {k: v.clone() for k, v in self.state.items() if k not in ("valid", "eos")}
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

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None,
                 first_row: int = 0) -> RolloutBatch:
        """n responses per prompt (rows prompt-major); `first_row` is the global id of the first row,
        the key of its random draws (see HFGenerateEngine.generate)."""
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
        responses: list[torch.Tensor] = []
        for start in range(0, len(rows), self.batch_size):
            ids = prompt_ids[start:start + self.batch_size].to(self.device)
            mask = prompt_mask[start:start + self.batch_size].to(self.device)
            b = ids.shape[0]
            s["rows"][:b].copy_(torch.arange(first_row + start, first_row + start + b))
            s["seed"].fill_(params.seed)
            s["valid"][:b].fill_(True)
            s["valid"][:b, :p].copy_(mask.bool())
            s["out"][:b].fill_(self.pad_id)
            first = sample_tokens(self._prefill(ids, mask), params, params.seed, s["rows"][:b], 0)
            s["out"][:b, 0] = first
            s["tok"][:b].copy_(first)
            s["pos"][:b].copy_(mask.sum(-1))
            s["slot"].fill_(p)
            s["t"].fill_(1)
            s["done"][:b] = False if params.ignore_eos else torch.isin(first, s["eos"])
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
