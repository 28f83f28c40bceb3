"""Will it fit? Peak memory per worker in each phase of a training step, and the step's time, predicted
from the config and the model's dimensions before anything starts (`python -m backend plan`, the
config page's plan panel).

Per worker rank, W = trainer.n_gpus_per_node x trainer.nnodes ranks, for a model of P parameters (one
decoder layer P_layer, embeddings + final norm + head P_root), c bytes a value in the compute dtype
(bf16: 2, fp32: 4), T = max_prompt_length + max_response_length, R = max_response_length, in bytes:

    held in every phase   4P/W fp32 master + 8P/W AdamW states + 4P/W fp32 gradients (0: actor offload)
    (after the first      + cP/W reference shard, when there is a reference (0: reference offload)
    update)               + cP the rollout engine's own copy of the weights (engine auto/workbench; hf has none),
                          held only in generation when rollout.free_cache_engine (the default) frees it
    generation            KV cache Bg*T*L*2*Hkv*D*k (k = c; 1 with rollout.kv_cache_dtype=fp8)
                          + sampling Bg*V*18 + cP gathered weights
                          (Bg = min(generation_batch_size, rows per rank)); vllm: its share of the GPU,
                          rollout.gpu_memory_utilization x the GPU's memory (held in every phase instead
                          when rollout.free_cache_engine is off, as vLLM then never sleeps)
    old / ref log-prob    gathered weights G + logits m*R*V*c (a plain head runs inside the vocabulary
                          pass: one chunk's, K*V*c) + the fp32 log-softmax of one chunk of K = 2048
                          positions K*V*8 (old, with entropy: *16; 0 when compiled)
                          + activations m*T*H*c*4                      (m: that pass's micro-batch)
    update                activations kept for backward m*T*L*H*A (gradient checkpointing: the layer inputs
                          m*T*H*c*L + one layer's m*T*H*A; compiled layers keep A x
                          actor.activation_memory_budget) + logits and their gradient 2*m*R*V*c (a plain
                          head: one chunk's 2*K*V*c + the head's fp32 gradient sum 4*V*H)
                          + one chunk's fp32 log-softmax and entropy K*V*16 + the gathered weights G
                          (G = cP on one rank, which gathers the model once a phase; c*(P_layer + P_root),
                          a layer at a time, on more ranks or offloaded)
    reserved              allocated x fragmentation + CUDA context and workspaces

With trainer.rollout_mode=async generation is the rollout workers' (rows split over
rollout.n_gpus_per_node of them): each holds cP of its own, the engine's cP (workbench) or vLLM's share, the
KV cache, and the larger of the sampling temporaries and its log-prob forward (logits, vocabulary pass and
activations of a rollout micro-batch, no gathered weights); the actor's workers hold no engine. At
max_staleness=1 the step takes the longer of generation (with that forward) and the rest.

Step time: each decode step reads the engine's weights and, on average, half the KV cache (as if in the compute
dtype for an FP8 cache too, which the kernel reads no faster today) at the GPU's memory bandwidth x an
efficiency (HF generate adds a fixed overhead per step and layer), prefill and the forward passes cost 2P
FLOPs a token and the update 6P (8P with checkpointing), at the peak bf16 FLOP/s x an MFU.
backend.engine.distributed says what each phase holds and why.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from backend.core.checkpoint import HF
from backend.core.config import Config, ConfigError, batch_plan, uses_critic, validate_config, yaml_value
from backend.core.models import ModelError, resolve_model
from backend.engine.distributed import decoder_layers, gathers_once, param_dtype
from backend.engine.log_probs import LOG_PROB_CHUNK_TOKENS
from backend.rollout.static_cache import ARCHITECTURES
from backend.services.gpus import DEFAULT_GPU, GPU, GPUS, match_gpu

GiB = 2**30

# ---- calibration ----
# Every number the plan does not derive from the config or the model, in one place.
# Calibrated from measured runs: the time constants against bench/results/2026-11-30-gpu-distributed-x1.json
# and -x2.json (Qwen3-0.6B random, 64 x 8 responses of 128 + 256 tokens on one and two H200s, HF generate:
# generation 17.2 s and 14.8 s, reference 1.27 s, update 6.0 s; tiny-qwen3 for the per-step overhead of a
# small model) and ../shared/PERF-FACTS.md (our own decode loop: 3.3 s for 512 x 256 tokens). Recalibrated on
# 2026-12-01 for our engine and a compiled update (A, the MFU, the micro-batch overhead and the workbench's
# decode efficiency) against bench/results/2026-12-01-h200-activation-budget-ab.json: the performance workload
# at micro-batches 32, 64 and 128 (generation 1.54-1.63 s, reference 0.48-0.50 s, update 1.64-1.94 s, update
# allocated 24.8-35.9 GiB), so those three are in-sample. A went back from 50 to 36 once the log-prob passes
# ran causal attention without a mask (d726415): each layer had kept a (micro-batch, heads, T, T) bias for
# backward, 4.5 GiB at micro-batch 64. With 36 the update of bench/results/2026-12-01-h200-grpo-step-5x.json
# is predicted at 24.56 GiB allocated against 24.76 measured (in-sample, one config). The memory
# constants are the design's first estimates (see the module docstring) until GPU runs calibrate them:
# compare the plan of a bench config with its peak_allocated_gib_per_gpu / peak_reserved_gib_per_gpu
# (perf/max_memory_*_gb in a run's metrics) and change the numbers here. plan(cfg, calibration={...})
# takes changed values on top of these, which is how the tests check the formulas with numbers of their own.
CALIBRATION: dict[str, float] = {
    # memory
    "activation_bytes": 36.0,             # A: bytes kept for backward per token, hidden unit and layer (bf16;
                                          #    scaled by c/2, so fp32 compute keeps twice as many)
    "logprob_activation_copies": 4.0,     # hidden-sized tensors (m*T*H*c) alive at once in a no-grad forward
    "sampling_bytes_per_vocab": 18.0,     # per sequence sampled: bf16 + fp32 logits, probabilities, their cumsum
    "fragmentation": 1.15,                # reserved / allocated of PyTorch's caching allocator
    "cuda_overhead_gib": 0.5,             # CUDA context, cuBLAS and NCCL workspaces, per worker
    # time
    "mfu": 0.37,                          # achieved / peak bf16 FLOP/s of the forward and backward passes
    "decode_efficiency_hf": 0.135,        # achieved / peak memory bandwidth of a decode step, HF generate
    "decode_step_overhead_hf_s": 0.004,   # HF generate's launches and Python per decode step ...
    "decode_layer_overhead_hf_s": 0.0015,  # ... and per decode step and layer
    "decode_efficiency_workbench": 0.32,  # the same for our own engine (rollout.name auto or workbench), which
                                          #    replays each decode step as one CUDA graph: no per-step overhead
    "micro_batch_overhead_s": 0.017,      # launches and Python of a forward pass over one micro-batch (a
                                          #    backward counts twice): what dominates a tiny model's passes
    "fp32_flops_fraction": 0.068,         # fp32 compute (no tensor cores, TF32 off) / bf16 peak: H100 67 / 989
    # CPU time, as fractions of this machine's measured matrix-multiply speed (cpu_flops). Calibrated on the
    # 2-core CPU these numbers came from, against configs/default.yaml (SmolLM2-135M, 16 responses of at most
    # 128 + 64 tokens; steps 2-4 of `python -m backend train configs/default.yaml trainer.total_training_steps=4`
    # while cpu_flops measured about 204 GFLOP/s: generation 7.4-10.2 s, reference 4.2-5.1 s, update 16.3-19.2 s)
    # and configs/quick_try.yaml (tiny-qwen3: generation 0.04 s, reference 0.02 s, update 0.06 s, all overhead).
    "cpu_pass_efficiency": 0.73,          # the forward and backward passes (the formula's T counts padding to the
                                          #    longest allowed lengths, which the engine does not run)
    "cpu_decode_efficiency": 0.64,        # the matrix products of a decode step (bg rows)
    "cpu_decode_layer_overhead_s": 0.00125,  # Python and dispatch per decode step and layer (the tiny model's
                                             #    generation is nothing else)
    "cpu_micro_batch_overhead_s": 0.012,  # per forward pass over one micro-batch (a backward counts twice)
    # In bf16 (param_dtype auto on a CPU with bf16 instructions), as fractions of the bf16 speed (cpu_flops
    # about 900 GFLOP/s on the same CPU), fitted on configs/default.yaml alone: generation 2.4-3.2 s,
    # reference 0.9-1.2 s, update 4.4-5.3 s (bench/engine_step.py and bench/cpu_vs_trl.py, 2026-12-03). One
    # pass efficiency for the reference and the update together: the update also spends time the products
    # do not (AdamW, gradient copies), so the reference alone comes out over-predicted (1.5 s).
    "cpu_bf16_pass_efficiency": 0.63,
    "cpu_bf16_decode_efficiency": 0.35,
    "cpu_bf16_decode_layer_overhead_s": 0.0005,
}


# ---- GPUs ----

@functools.lru_cache(maxsize=1)
def visible_gpu() -> GPU | None:
    """The first visible CUDA GPU, with its own total memory and the table's speeds (None when its name is
    not in the table); None when there is no GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    memory = props.total_memory / GiB
    kind = match_gpu(props.name, memory)
    if kind is None:
        return GPU(props.name, memory, None, None)
    return replace(GPUS[kind], memory_gib=memory)


def this_machine() -> str:
    """What a plan without a named GPU is for, in words: the visible GPU, else this machine's CPU and memory."""
    seen = visible_gpu()
    if seen is not None:
        return f"this machine's GPU ({seen.name}, {seen.memory_gib:.0f} GiB)"
    memory = _host_memory_gib()
    return f"this machine's CPU ({os.cpu_count()} cores{f', {memory:.0f} GiB' if memory else ''})"


@functools.lru_cache(maxsize=2)
def cpu_flops(dtype: torch.dtype = torch.float32) -> float:
    """This machine's matrix-multiply speed in `dtype` in FLOP/s: one core's, times torch's threads (what a run's worker
    uses), measured once per process. One core's is the fastest of the products of two 512 x 512 matrices made in
    0.3 s on a thread of its own: with two threads, the speed measured on this 2-core machine ranged from 22 to
    194 GFLOP/s with other work running, as a product waits for its slower thread; one thread's stayed at
    101-103. OpenMP's thread count is per thread, but torch also keeps it as the default of threads that have not
    used torch yet: the caller's is fixed first, and the default is put back as it was."""
    threads = torch.get_num_threads()
    fastest: list[float] = []

    def measure() -> None:
        torch.set_num_threads(1)
        try:
            a = torch.randn(512, 512, dtype=dtype)
            best = math.inf
            end = time.perf_counter() + 0.3
            while (start := time.perf_counter()) < end:
                a @ a
                best = min(best, time.perf_counter() - start)
            fastest.append(best)
        finally:
            torch.set_num_threads(threads)

    thread = threading.Thread(target=measure, name="cpu-flops")
    thread.start()
    thread.join()
    return 2 * 512**3 / fastest[0] * threads


# ---- the model ----

@dataclass(frozen=True)
class ModelDims:
    """What the plan needs of a model, from its Hugging Face config and a meta-device instance."""

    architecture: str
    params: int        # P, tied weights counted once
    layer_params: int  # P_layer: the largest decoder layer
    root_params: int   # P_root: everything outside the decoder layers (embeddings, final norm, untied head)
    layers: int        # L
    hidden: int        # H
    vocab: int         # V
    kv_heads: int      # Hkv
    head_dim: int      # D
    intermediate: int  # I (informational: P_layer is counted exactly)
    linear_in_out: dict[str, int] = field(default_factory=dict)  # per linear layer name: sum over layers of in + out


@functools.lru_cache(maxsize=32)
def model_dims(path: str) -> ModelDims:
    """The dimensions of the model a config names (a shipped name, a folder, a run checkpoint or a Hub id).
    Cached per path: the first call for a model takes a few seconds, later ones nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(resolve_model(path))
    if (source / HF / "config.json").is_file():  # a sharded run checkpoint keeps its config there
        source = source / HF
    try:
        hf_config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the config of model '{path}': {e}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"model '{path}' is not a causal LM transformers can build: {e}") from None
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    try:
        layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    except ValueError:
        layer_sizes = []
    linear_in_out: dict[str, int] = {}
    if layer_sizes:
        for layer in decoder_layers(model):
            for name, module in layer.named_modules():
                if isinstance(module, torch.nn.Linear):
                    short = name.rpartition(".")[2]
                    linear_in_out[short] = linear_in_out.get(short, 0) + module.in_features + module.out_features
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden, heads = text.hidden_size, text.num_attention_heads
    layers = text.num_hidden_layers
    if not layer_sizes:  # no decoder layers found: split what is not the embeddings evenly
        embed = text.vocab_size * hidden * (1 if getattr(text, "tie_word_embeddings", True) else 2)
        layer_sizes = [max(params - embed, 0) // max(layers, 1)] * layers
    return ModelDims(
        architecture=type(model).__name__, params=params, layer_params=max(layer_sizes),
        root_params=params - sum(layer_sizes), layers=layers, hidden=hidden, vocab=text.vocab_size,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        intermediate=getattr(text, "intermediate_size", 0) or 0, linear_in_out=linear_in_out)


def lora_params(dims: ModelDims, rank: int, target_modules: list[str]) -> int:
    """Trainable parameters of LoRA adapters of `rank` on the named linear layers (all-linear: every one
    in the decoder layers): rank x (in + out) each."""
    return rank * sum(v for name, v in dims.linear_in_out.items()
                      if target_modules == ["all-linear"] or name in target_modules)


# ---- the plan ----

VLLM_SHARE = "vLLM's share of the GPU (rollout.gpu_memory_utilization)"

@dataclass
class Phase:
    """One phase of a step on one worker: what sits in memory at its peak (bytes), and its time."""

    name: str
    runs: bool
    why_not: str = ""                                     # when it does not run
    terms: dict[str, float] = field(default_factory=dict)  # held ones first, then the phase's own
    allocated: float = 0.0
    reserved: float = 0.0
    seconds: float | None = None

    @property
    def allocated_gib(self) -> float:
        return self.allocated / GiB

    @property
    def reserved_gib(self) -> float:
        return self.reserved / GiB

    def largest(self, k: int = 3) -> list[tuple[str, float]]:
        return sorted(self.terms.items(), key=lambda kv: -kv[1])[:k]


@dataclass
class Suggestion:
    """Config changes that lower the predicted need, and by how much (re-planned with the change)."""

    changes: list[tuple[str, Any]]
    saves_gib: float
    need_gib: float
    fits: bool
    note: str = ""

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={yaml_value(value)}" for key, value in self.changes]

    @property
    def effect(self) -> str:
        outcome = "fits" if self.fits else "still does not fit"
        note = f"; {self.note}" if self.note else ""
        return f"saves {self.saves_gib:.2f} GiB ({self.need_gib:.2f} GiB, {outcome}){note}"

    def text(self) -> str:
        return f"{' '.join(self.overrides)}: {self.effect}"


@dataclass
class Plan:
    model: str
    dims: ModelDims
    device: str                   # "cuda" or "cpu"
    gpu: GPU | None               # None on CPU
    world_size: int
    workers_per_node: int
    compute_bytes: int            # c
    rows_per_step: int
    rows_per_rank: int
    seq_len: int                  # T
    response_len: int             # R
    engine: str
    held: dict[str, float]        # bytes held by each worker through every phase
    phases: list[Phase]
    peak_phase: str
    need_gib: float               # GPU: peak reserved per worker; CPU: peak of all the node's workers together
    capacity_gib: float | None    # GPU memory, or this machine's memory on CPU (None: unknown)
    fits: bool
    verdict: str
    step_seconds: float | None
    host_gib_per_worker: float    # CPU memory a worker's offloaded state takes (GPU plans with offload)
    suggestions: list[Suggestion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    overlapped: bool = False      # generation runs while the rest trains (trainer.rollout_mode=async, staleness 1)

    @property
    def params(self) -> int:
        return self.dims.params

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def step_time_text(self) -> str:
        if self.step_seconds is None:
            return "step time: not predicted"
        ran = [p for p in self.phases if p.runs]
        if self.overlapped:
            rest = " + ".join(f"{p.name} {_seconds(p.seconds)}" for p in ran if p.name != "generation")
            parts = f"the longer of generation {_seconds(self.phase('generation').seconds)} and {rest}"
        else:
            parts = " + ".join(f"{p.name} {_seconds(p.seconds)}" for p in ran)
        return (f"step time: {_seconds(self.step_seconds)} = {parts} (rewards, weight sync and the optimizer "
                "step not counted)")

    def table(self) -> list[dict[str, Any]]:
        """One row per phase, as the config page shows them (GiB and seconds rounded)."""
        rows = []
        for p in self.phases:
            rows.append({
                "phase": p.name,
                "runs": "yes" if p.runs else f"no: {p.why_not}",
                "allocated GiB": round(p.allocated_gib, 3) if p.runs else None,
                ("reserved GiB" if self.device == "cuda" else "host GiB"): round(p.reserved_gib, 3) if p.runs else None,
                "time s": round(p.seconds, 2) if p.runs and p.seconds is not None else None,
                "largest terms": ", ".join(f"{name} {_size(b)}" for name, b in p.largest()) if p.runs else "",
            })
        return rows


PHASES = ("generation", "old log-prob", "reference log-prob", "update")


def plan(cfg: Config, gpu: str | None = None, *, gpus: int | None = None,
         calibration: dict[str, float] | None = None) -> Plan:
    """Predict peak memory per worker in each phase of a step, the step time, whether it fits `gpu` (a name
    of GPUS; default: the visible GPU, else h200) and, when it does not, what to change. `gpus` replaces
    trainer.n_gpus_per_node (the config is validated again with it); `calibration` replaces constants
    of CALIBRATION. Raises ConfigError for a config that is not valid with `gpus`, ModelError for a model
    whose config cannot be read, ValueError for an unknown GPU name."""
    if gpus is not None and gpus != cfg.trainer.n_gpus_per_node:
        cfg = _with(cfg, [("trainer.n_gpus_per_node", gpus)])
        validate_config(cfg)
    cal = {**CALIBRATION, **(calibration or {})}
    unknown = set(cal) - set(CALIBRATION)
    if unknown:
        raise ValueError(f"unknown calibration constant(s): {', '.join(sorted(unknown))}")
    device, target, notes = _target(cfg, gpu)
    dims = model_dims(cfg.actor_rollout_ref.model.path)
    result = _plan(cfg, dims, device, target, cal)
    result.notes = notes + result.notes
    if not result.fits:
        result.suggestions = _suggestions(cfg, dims, device, target, cal, result)
    return result


def _target(cfg: Config, gpu: str | None) -> tuple[str, GPU | None, list[str]]:
    if gpu is not None and gpu not in GPUS:
        raise ValueError(f"unknown GPU '{gpu}': choose one of {', '.join(GPUS)}")
    if cfg.trainer.device == "cpu":
        return "cpu", None, (["trainer.device=cpu: the GPU named is not used"] if gpu else [])
    if gpu is not None:
        return "cuda", GPUS[gpu], []
    seen = visible_gpu()
    if seen is None and cfg.trainer.device == "auto":
        # What a run started here would use: trainer.device=auto takes the CPU when no GPU is visible.
        return "cpu", None, [f"no CUDA GPU is visible here: planned for this machine's CPU, which a run started here "
                             f"with trainer.device=auto uses (name a GPU, e.g. --gpu {DEFAULT_GPU}, to plan for one)"]
    if seen is None:
        return "cuda", GPUS[DEFAULT_GPU], [f"trainer.device=cuda and no CUDA GPU is visible here: planned for an "
                                           f"{DEFAULT_GPU} (choose another with --gpu)"]
    if seen.tflops is None:
        return "cuda", seen, [f"the visible GPU ({seen.name}) is not in the table: its memory is used, the "
                              f"step time is not predicted (name one of {', '.join(GPUS)} with --gpu for that)"]
    return "cuda", seen, []


def _compute_bytes(setting: str, device: str) -> int:
    """Bytes a value in the compute dtype takes, as the workers pick that dtype."""
    return param_dtype(setting, torch.device(device)).itemsize


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def _plan(cfg: Config, dims: ModelDims, device: str, gpu: GPU | None, cal: dict[str, float]) -> Plan:
    """The plan without suggestions: the memory model and the time model of the module docstring."""
    arr, d = cfg.actor_rollout_ref, cfg.data
    a, r, ref = arr.actor, arr.rollout, arr.ref
    on_gpu = device == "cuda"
    # trainer.rollout_mode=async: generation runs on rollout workers of their own, which hold the engine; the
    # actor's workers hold none of it.
    apart = cfg.trainer.rollout_mode == "async"
    overlapped = apart and cfg.trainer.max_staleness > 0  # the next batch generates while this one trains
    per_node = cfg.trainer.n_gpus_per_node
    W = per_node * cfg.trainer.nnodes
    c = _compute_bytes(a.fsdp_config.param_dtype, device)
    dtype = {2: "bf16", 4: "fp32"}[c]
    P, L, H, V = dims.params, dims.layers, dims.hidden, dims.vocab
    rows = d.train_batch_size * r.n
    rows_rank = math.ceil(rows / W)
    mini_rank = max(math.ceil(a.ppo_mini_batch_size * r.n / W), 1)
    T, R = d.max_prompt_length + d.max_response_length, d.max_response_length
    has_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    engine = getattr(r, "name", "auto")  # auto and workbench keep a copy of the weights; hf samples with the actor's
    engine_copy = engine not in ("hf", "vllm")
    # vLLM takes its share of the GPU for its weights and KV cache; asleep (free_cache_engine) it holds none
    # of it between generations. The gathered actor is freed before its KV cache wakes, so the share is the
    # generation's peak.
    vllm_share = r.gpu_memory_utilization * gpu.memory_gib * GiB if engine == "vllm" and on_gpu and gpu else 0.0
    offload = on_gpu and a.fsdp_config.offload_policy
    ref_offload = on_gpu and ref.fsdp_config.offload_policy
    act = cal["activation_bytes"] * c / 2
    gc = arr.model.enable_gradient_checkpointing
    notes: list[str] = []

    # ---- held through every phase ----
    held: dict[str, float] = {}
    # With LoRA only the adapters (P_t of them) have gradients and AdamW states, and the reference is the
    # actor itself with its adapters off.
    lora_rank = arr.model.lora_rank
    trained = lora_params(dims, lora_rank, arr.model.target_modules) if lora_rank else P
    if not offload:
        held.update({"actor fp32 master shard": 4 * (P + (trained if lora_rank else 0)) / W,
                     "AdamW states": 8 * trained / W, "fp32 gradients": 4 * trained / W})
    if has_ref and not ref_offload and not lora_rank:
        held[f"reference shard ({dtype})"] = c * P / W
    # The engine frees its copy with its cache after generating (free_cache_engine): stale once the update runs.
    engine_weights = {f"rollout engine weights ({dtype})": c * P} if engine_copy else {}
    if not r.free_cache_engine and not apart:
        held.update(engine_weights)
    if vllm_share and not r.free_cache_engine and not apart:
        held[VLLM_SHARE] = vllm_share
    host_per_worker = (16 * P / W if offload else 0.0) + (c * P / W if has_ref and ref_offload and not lora_rank
                                                          else 0.0)

    # One rank gathers the whole model once per phase (distributed.gathers_once); more gather a layer at a time.
    layerwise = c * (dims.layer_params + dims.root_params)
    gathered = c * P if gathers_once(W, offload) else layerwise
    ref_gathered = c * P if gathers_once(W, ref_offload) else layerwise

    # The vocabulary pass (algos.token_log_probs) works a chunk of rows at a time. Compiled (GPUs with
    # actor.use_torch_compile) it is fused and writes no fp32 copy; eager, one chunk's fp32 temporaries live.
    chunk_tokens = max(1, LOG_PROB_CHUNK_TOKENS // max(R, 1)) * R
    fused = on_gpu and a.use_torch_compile

    def chunk_term(m: int, bytes_per_entry: int) -> dict[str, float]:
        return {} if fused else {"fp32 vocabulary pass of one chunk": min(m * R, chunk_tokens) * V * bytes_per_entry}

    # A plain head runs inside the vocabulary pass (workers.response_log_probs): its logits exist a chunk
    # at a time, never for the whole micro-batch.
    head_in_pass = dims.architecture in ARCHITECTURES and not (lora_rank and "lm_head" in arr.model.target_modules)

    def logits_tokens(m: int) -> int:
        return min(m * R, chunk_tokens) if head_in_pass else m * R

    def forward_terms(m: int, entropy: bool, gathered: float = gathered) -> dict[str, float]:
        return {"gathered weights": gathered, "logits": logits_tokens(m) * V * c,
                **chunk_term(m, 16 if entropy else 8), "activations": m * T * H * c * cal["logprob_activation_copies"]}

    # By tokens (use_dynamic_bsz), a micro-batch holds at most budget // T rows of the longest length.
    def micro_rows(rows: int, budget: int | None, cap: int) -> int:
        return min(rows if budget is None else max(1, budget // T), cap)

    # ---- each phase's own ----
    rows_gen = math.ceil(rows / r.n_gpus_per_node) if apart else rows_rank  # rows a generating worker samples
    bg = min(r.generation_batch_size, rows_gen)
    kv_compute = bg * T * L * 2 * dims.kv_heads * dims.head_dim * c
    kv = kv_compute // c if r.kv_cache_dtype == "fp8" else kv_compute
    decoding = {"KV cache": kv, "sampling temporaries": bg * V * cal["sampling_bytes_per_vocab"]}
    if engine_copy and r.free_cache_engine:
        # The engine copies the gathered weights in and frees them before it allocates its cache
        # (workers.generate): the gathered weights and the cache never live at once.
        loading = {"weights gathered for the engine copy": c * P}
        gen = {**max(loading, decoding, key=lambda terms: sum(terms.values())), **engine_weights}
    else:
        # The HF engine samples from the gathered weights; a kept engine cache lives while the weights load.
        gen = {**decoding, ("weights gathered for the engine copy" if engine_copy
                            else "actor weights gathered for sampling"): c * P}
    if engine == "vllm":
        gen = {VLLM_SHARE: vllm_share} if r.free_cache_engine else {"actor weights gathered for the push": c * P}
        notes.append("vLLM's generation time is not predicted (docs/performance.md has what one H200 measured)")
    m_rollout = micro_rows(r.log_prob_micro_batch_size_per_gpu, arr.log_prob_token_budget(r), rows_gen)
    if apart:
        # A rollout worker holds its whole copy, the engine's own (vLLM: its share), and the cache between
        # generations; after sampling, its forward for the sampled tokens' log-probs (not vLLM, which returns
        # them) takes the place of the sampling temporaries.
        gen = {f"rollout worker's model ({dtype})": c * P}
        if engine == "vllm":
            gen[VLLM_SHARE] = vllm_share
        else:
            forward = {k: v for k, v in forward_terms(m_rollout, entropy=False).items() if k != "gathered weights"}
            gen.update({**engine_weights, "KV cache": kv, **max({"sampling temporaries": decoding[
                "sampling temporaries"]}, forward, key=lambda terms: sum(terms.values()))})
        notes.append(f"trainer.rollout_mode=async: generation is on each of {r.n_gpus_per_node} rollout worker(s); "
                     "the other phases on the actor's workers")

    old_runs = batch_plan(cfg).optimizer_steps_per_step > 1 or cfg.algorithm.use_kl_in_reward

    m_old = micro_rows(r.log_prob_micro_batch_size_per_gpu, arr.log_prob_token_budget(r), rows_rank)
    m_ref = micro_rows(ref.log_prob_micro_batch_size_per_gpu, arr.log_prob_token_budget(ref), rows_rank)
    m_upd = micro_rows(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
                       mini_rank)
    # Compiled, the partitioner keeps about activation_memory_budget of a layer's activations: 0.71 of them at
    # 0.7 in the workload's update on an H200 (0.55, 0.50 and 0.32 at 0.7, 0.5 and 0.3 on the CPU).
    kept = act * (a.activation_memory_budget if fused else 1.0)
    if gc:
        acts = {"checkpointed layer inputs": m_upd * T * H * c * L, "activations of one layer": m_upd * T * H * kept}
    else:
        acts = {"activations kept for backward": m_upd * T * L * H * kept}
    update = {**acts, "logits + gradient": 2 * logits_tokens(m_upd) * V * c, **chunk_term(m_upd, 20),
              "gathered weights": gathered}
    if head_in_pass:
        update["fp32 gradient sum of the head"] = 4 * V * H

    # ---- time ----
    flops = bw = None
    tokens = rows_rank * T
    overhead = cal["micro_batch_overhead_s"]
    if on_gpu and gpu is not None and gpu.tflops:
        flops = gpu.tflops * 1e12 * cal["mfu"] * (1.0 if c == 2 else cal["fp32_flops_fraction"])
        bw = gpu.bandwidth_tbs * 1e12 * cal["decode_efficiency_hf" if engine == "hf" else "decode_efficiency_workbench"]
    elif not on_gpu:
        speed = cpu_flops(torch.bfloat16 if c == 2 else torch.float32)
        machine = speed / per_node  # the node's worker processes share its cores
        # In bf16 the matrix products run 4-5 times as fast on a CPU with bf16 instructions, the rest of a
        # pass (norms, the optimizer, gradient copies) no faster: a smaller share of that speed.
        cpu = "cpu_bf16_" if c == 2 else "cpu_"
        flops, overhead = machine * cal[f"{cpu}pass_efficiency"], cal["cpu_micro_batch_overhead_s"]
        notes.append(f"times are for this machine's CPU ({speed / 1e9:.0f} GFLOP/s measured in {dtype} matrix "
                     "products) with nothing else running; other work here slows them down")

    def seconds(value):
        return value() if flops else None

    step_overhead = cal["decode_step_overhead_hf_s"] + cal["decode_layer_overhead_hf_s"] * L if engine == "hf" else 0.0

    def decode_step_s() -> float:
        """One decode step over bg rows: on a GPU reading the weights and half the KV cache; on a CPU its products."""
        if on_gpu:
            # An FP8 cache decodes no faster than one in the compute dtype: the kernel's widening costs what
            # the halved reads save (docs/performance.md, "The kernels").
            return step_overhead + (c * P + 0.5 * kv_compute) / bw
        return 2 * P * bg / (machine * cal[f"{cpu}decode_efficiency"]) + cal[f"{cpu}decode_layer_overhead_s"] * L

    gen_s = None if engine == "vllm" else seconds(lambda: math.ceil(rows_gen / bg) * (
        R * decode_step_s() + 2 * P * bg * d.max_prompt_length / flops)
        + (2 * P * rows_gen * T / flops + math.ceil(rows_gen / m_rollout) * overhead if apart else 0.0))

    def forward_s(m: int) -> float | None:
        return seconds(lambda: 2 * P * tokens / flops + math.ceil(rows_rank / m) * overhead)

    # Per parameter and token: 2 FLOPs forward, 2 for the activations' gradient, 2 for the weight's, which
    # LoRA computes for its adapters only; checkpointing adds a forward.
    update_flops = 4 * P + 2 * trained + (2 * P if gc else 0)
    update_s = seconds(lambda: a.ppo_epochs * (update_flops * tokens / flops
                                               + 2 * math.ceil(rows_rank / m_upd) * overhead))

    # ---- the critic and the reward model: their own processes on the same GPUs, holding their own ----
    critic_phases: list[Phase] = []
    if uses_critic(cfg):
        cd = model_dims(cfg.critic.model.path or arr.model.path)
        if not (on_gpu and cfg.critic.fsdp_config.offload_policy):
            held["critic fp32 shard, AdamW states and gradients"] = 16 * cd.params / W
        m_c = micro_rows(cfg.critic.ppo_micro_batch_size_per_gpu,
                         cfg.critic.ppo_max_token_len_per_gpu if cfg.critic.use_dynamic_bsz else None, mini_rank)
        critic_gathered = c * (cd.layer_params + cd.root_params)
        critic_acts = (m_c * T * cd.hidden * (c * cd.layers + act) if cfg.critic.model.enable_gradient_checkpointing
                       else m_c * T * cd.layers * cd.hidden * act)
        critic_phases = [Phase("critic update", True, terms={**held, "critic activations": critic_acts,
                                                              "critic gathered layer + root": critic_gathered},
                               seconds=seconds(lambda: 6 * cd.params * tokens / flops))]
    if cfg.reward_model.enable:
        try:
            rd = model_dims(cfg.reward_model.model.path)
            held[f"reward model ({dtype}, whole on every worker)"] = c * rd.params
        except ModelError:  # a Hub id this machine cannot reach: plan without it, and say so
            notes.append("the reward model's size is unknown (its config cannot be read as a causal LM)")
    phases = [
        Phase("generation", True, terms=gen if apart else {**held, **gen}, seconds=gen_s),
        Phase("old log-prob", old_runs, "on-policy with one optimizer step: the update computes them",
              terms={**held, **forward_terms(m_old, entropy=True)}, seconds=forward_s(m_old)),
        Phase("reference log-prob", has_ref, "no reference model (use_kl_loss and use_kl_in_reward are off)",
              terms={**held, **forward_terms(m_ref, entropy=False, gathered=ref_gathered if has_ref and not lora_rank
                                             else gathered)}, seconds=forward_s(m_ref)),
        Phase("update", True, terms={**held, **update}, seconds=update_s),
        *critic_phases,
    ]
    frag, fixed = (cal["fragmentation"], cal["cuda_overhead_gib"] * GiB) if on_gpu else (1.0, 0.0)
    for p in phases:
        if not p.runs:
            p.seconds = None
            continue
        p.allocated = sum(p.terms.values())
        exact = p.terms.get(VLLM_SHARE, 0.0)  # vLLM maps its share itself, outside PyTorch's allocator
        p.reserved = (p.allocated - exact) * frag + exact + fixed
    peak = max((p for p in phases if p.runs), key=lambda p: p.reserved)
    timed = [p.seconds for p in phases if p.runs]
    step_s = sum(timed) if flops and None not in timed else None
    if overlapped and step_s is not None:
        step_s = max(gen_s, step_s - gen_s)

    # ---- verdict ----
    if on_gpu:
        need, capacity = peak.reserved / GiB, gpu.memory_gib
        fits = need <= capacity
        where = f"{gpu.name} ({capacity:.0f} GiB)"
        if fits:
            verdict = (f"fits: peak {need:.2f} GiB reserved per worker ({peak.name}) on an {where}, "
                       f"{capacity - need:.2f} GiB ({(capacity - need) / capacity:.0%}) headroom")
        else:
            verdict = (f"does not fit: peak {need:.2f} GiB reserved per worker ({peak.name}) is "
                       f"{need - capacity:.2f} GiB more than an {where} holds")
        if host_per_worker:
            notes.append(f"offloaded to CPU memory: {host_per_worker / GiB:.2f} GiB per worker "
                         f"({host_per_worker * per_node / GiB:.2f} GiB for a node's {per_node})")
    else:
        actor_peak = max(p.reserved for p in phases if p.runs and not (apart and p.name == "generation"))
        rollout_need = phases[0].reserved * r.n_gpus_per_node if apart else 0.0
        need, capacity = (actor_peak * per_node + rollout_need) / GiB, _host_memory_gib()
        fits = capacity is None or need <= capacity
        procs = per_node + (r.n_gpus_per_node if apart else 0)
        need_text = (f"{need:.2f} GiB of host memory for {procs} worker process{'es' if procs > 1 else ''} "
                     f"({peak.name}; on the CPU, GPU memory does not apply)")
        if capacity is None:
            verdict = f"needs {need_text}"
        elif fits:
            verdict = f"fits: {need_text}, of {capacity:.1f} GiB on this machine"
        else:
            verdict = f"does not fit: {need_text} is more than this machine's {capacity:.1f} GiB"
    return Plan(
        model=arr.model.path, dims=dims, device=device, gpu=gpu, world_size=W, workers_per_node=per_node,
        compute_bytes=c, rows_per_step=rows, rows_per_rank=rows_rank, seq_len=T, response_len=R, engine=engine,
        held=held, phases=phases, peak_phase=peak.name, need_gib=need, capacity_gib=capacity, fits=fits,
        verdict=verdict, step_seconds=step_s, host_gib_per_worker=host_per_worker / GiB, notes=notes,
        overlapped=overlapped)


# ---- after a rank ran out of memory ----

# A worker's phase (rank.PeakMemory) -> the planner's phase of the same work.
WORKER_PHASES = {"gen": "generation", "old_log_prob": "old log-prob", "ref": "reference log-prob",
                 "update_actor": "update", "update_critic": "critic update"}
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (GiB|MiB|KiB)")


def after_out_of_memory(cfg: Config, memory: dict, message: str, k: int = 3) -> dict[str, Any]:
    """What the planner makes of a rank that ran out of memory (`memory`: rank.held_at_failure's record,
    `message`: the error, whose "Tried to allocate" it reads): its prediction for that phase against what the
    rank held plus the allocation that failed, and the `k` config changes it says would fit once its miss is
    allowed for (planned for a GPU that much smaller). Keys: predicted_gib, needed_gib (None off a GPU),
    suggestions (override lines with their effect), note."""
    phase = WORKER_PHASES.get(memory.get("phase", ""))
    gpu = None
    if memory.get("device") == "cuda" and "device_gib" in memory:
        kind = match_gpu(memory.get("gpu", ""), memory["device_gib"])
        gpu = (replace(GPUS[kind], memory_gib=memory["device_gib"]) if kind
               else GPU(memory.get("gpu", "this GPU"), memory["device_gib"], None, None))
    cal = dict(CALIBRATION)
    dims = model_dims(cfg.actor_rollout_ref.model.path)
    device = "cuda" if gpu is not None else "cpu"
    base = _plan(cfg, dims, device, gpu, cal)
    predicted = base.phase(phase).reserved_gib if phase and base.phase(phase).runs else None
    out: dict[str, Any] = {"phase": phase, "predicted_gib": predicted, "needed_gib": None, "suggestions": [],
                           "note": ""}
    if gpu is None or predicted is None:
        out["note"] = "the planner's suggestions need the GPU's figures; run `python -m backend plan` with --gpu"
        return out
    tried = _TRIED.search(message)
    tried_gib = float(tried[1]) / {"GiB": 1, "MiB": 2**10, "KiB": 2**20}[tried[2]] if tried else 0.0
    needed = memory["peak_reserved_gib"] + tried_gib
    miss = max(0.0, needed - predicted)
    smaller = replace(gpu, memory_gib=gpu.memory_gib - miss)
    out["needed_gib"] = needed
    out["note"] = (f"the planner predicted {predicted:.2f} GiB reserved for {phase}; the rank held "
                   f"{memory['peak_reserved_gib']:.2f} GiB and asked for {tried_gib:.2f} GiB more: the suggestions "
                   f"are planned for {smaller.memory_gib:.1f} GiB, the GPU less the planner's miss of {miss:.2f} GiB")
    planned = _plan(cfg, dims, device, smaller, cal)
    if not planned.fits:
        out["suggestions"] = [s.text() for s in _suggestions(cfg, dims, device, smaller, cal, planned)[:k]]
    return out


# ---- what to change ----

def _with(cfg: Config, changes: list[tuple[str, Any]]) -> Config:
    out = copy.deepcopy(cfg)
    for key, value in changes:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, value)
    return out


def _halvings(n: int) -> list[int]:
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


_NOTES = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "more micro-batches, the same update",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "more micro-batches, the same update",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "recomputes activations: the update about a third slower",
    "actor_rollout_ref.actor.activation_memory_budget": "torch.compile recomputes the cheapest activations in "
                                                        "backward: a little more compute in the update",
    "actor_rollout_ref.rollout.generation_batch_size": "generation in more passes",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "more forward passes for old log-probs",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "more forward passes for reference log-probs",
    "actor_rollout_ref.ref.fsdp_config.offload_policy": "the reference shards wait in CPU memory",
    "actor_rollout_ref.actor.fsdp_config.offload_policy": "weights, gradients and AdamW states in CPU memory, the "
                                                          "optimizer steps there: much slower updates",
    "trainer.n_gpus_per_node": "more GPUs",
    "actor_rollout_ref.model.lora_rank": "LoRA adapters instead of every weight (no AdamW state for the base, no "
                                         "reference copy); a different update, usually slower to learn",
}


def _candidates(cfg: Config, device: str) -> list[tuple[str, list[Any]]]:
    """The changes worth trying, cheapest in speed first, each with its values from mild to strong."""
    arr = cfg.actor_rollout_ref
    a, r = arr.actor, arr.rollout
    n_gpus = cfg.trainer.n_gpus_per_node
    W = n_gpus * cfg.trainer.nnodes
    mini_rank = a.ppo_mini_batch_size * r.n // W
    rows_rank = math.ceil(cfg.data.train_batch_size * r.n / W)
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    out: list[tuple[str, list[Any]]] = [
        # micro-batches must divide a worker's share of the mini-batch (validate_config says so)
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
         [m for m in range(min(a.ppo_micro_batch_size_per_gpu, mini_rank) - 1, 0, -1) if mini_rank % m == 0]),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
         [t for t in _halvings(a.ppo_max_token_len_per_gpu) if t >= longest] if a.use_dynamic_bsz else []),
        ("actor_rollout_ref.actor.activation_memory_budget",
         [b for b in (0.7, 0.5, 0.3) if b < a.activation_memory_budget] if device == "cuda" and a.use_torch_compile
         else []),
        ("actor_rollout_ref.model.enable_gradient_checkpointing", [] if arr.model.enable_gradient_checkpointing
         else [True]),
        ("actor_rollout_ref.rollout.generation_batch_size", _halvings(min(r.generation_batch_size, rows_rank))),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
         _halvings(min(r.log_prob_micro_batch_size_per_gpu, rows_rank))),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
         _halvings(min(arr.ref.log_prob_micro_batch_size_per_gpu, rows_rank))),
        ("actor_rollout_ref.model.lora_rank", [] if arr.model.lora_rank else [64, 16]),
    ]
    if device == "cuda":
        out += [
            ("actor_rollout_ref.ref.fsdp_config.offload_policy", [] if arr.ref.fsdp_config.offload_policy else [True]),
            ("actor_rollout_ref.actor.fsdp_config.offload_policy", [] if a.fsdp_config.offload_policy else [True]),
            ("trainer.n_gpus_per_node", list(range(n_gpus + 1, max(8, 2 * n_gpus) + 1))),
        ]
    return out


def _best_change(cfg: Config, key: str, values: list[Any], dims: ModelDims, device: str, gpu: GPU | None,
                 cal: dict[str, float], base_need: float) -> tuple[Any, Plan] | None:
    """The mildest value of `key` that makes `cfg` fit, else the mildest that saves at least 90% of what
    the strongest saves; None when no value saves anything (or none gives a valid config)."""
    tried = []
    for value in values:
        changed = _with(cfg, [(key, value)])
        try:
            validate_config(changed)
        except ConfigError:
            continue
        tried.append((value, _plan(changed, dims, device, gpu, cal)))
    most = max((base_need - p.need_gib for _, p in tried), default=0.0)
    if most < max(0.005, 0.001 * base_need):
        return None
    fitting = [(v, p) for v, p in tried if p.fits]
    return fitting[0] if fitting else next((v, p) for v, p in tried if base_need - p.need_gib >= 0.9 * most)


def _suggestions(cfg: Config, dims: ModelDims, device: str, gpu: GPU | None, cal: dict[str, float],
                 base: Plan) -> list[Suggestion]:
    """Each change alone (re-planned with it); when none fits alone, the cheapest changes one after another
    (each time the first of the list that still helps) until the config fits or nothing more helps."""
    out: list[Suggestion] = []
    for key, values in _candidates(cfg, device):
        found = _best_change(cfg, key, values, dims, device, gpu, cal, base.need_gib)
        if found is None:
            continue
        value, p = found
        note = _NOTES[key] + (f": {value} per node" if key == "trainer.n_gpus_per_node" else "")
        if key == "actor_rollout_ref.actor.fsdp_config.offload_policy":
            note += f" ({p.host_gib_per_worker:.2f} GiB of CPU memory per worker)"
        out.append(Suggestion([(key, value)], base.need_gib - p.need_gib, p.need_gib, p.fits, note))
    if any(s.fits for s in out):
        return out

    current, now, changes = cfg, base, {}
    for _ in range(16):
        step = None
        for key, values in _candidates(current, device):
            step = _best_change(current, key, values, dims, device, gpu, cal, now.need_gib)
            if step is not None:
                changes[key] = step[0]
                current, now = _with(current, [(key, step[0])]), step[1]
                break
        if step is None or now.fits:
            break
    if len(changes) > 1:
        out.append(Suggestion(list(changes.items()), base.need_gib - now.need_gib, now.need_gib, now.fits))
    return out


# ---- text ----

def _size(b: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale or unit == "KiB":
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t < 10 else f"{t:.1f} s" if t < 1000 else f"{t:,.0f} s"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_plan(p: Plan) -> str:
    """The plan as the CLI prints it: model, ranks, a table of phases, step time, verdict, suggestions."""
    d = p.dims
    lines = [f"model: {p.model} ({d.architecture}), {_count(p.params)} parameters ({p.params:,}): {d.layers} layers, "
             f"hidden {d.hidden}, vocab {d.vocab:,}, {d.kv_heads} KV heads x {d.head_dim}"]
    if p.device == "cuda":
        g = p.gpu
        speed = f", {g.tflops:g} TFLOP/s bf16, {g.bandwidth_tbs:g} TB/s" if g.tflops else ""
        lines.append(f"ranks: {p.world_size} ({p.workers_per_node} per node) on {g.name} GPUs "
                     f"({g.memory_gib:.0f} GiB{speed})")
    else:
        lines.append(f"ranks: {p.world_size} CPU worker process(es) ({p.workers_per_node} per node)")
    lines.append(f"step: {p.rows_per_step} responses, {p.rows_per_rank} per rank; sequences of {p.seq_len} tokens "
                 f"({p.seq_len - p.response_len} prompt + {p.response_len} response); compute in "
                 f"{'bf16' if p.compute_bytes == 2 else 'fp32'}; rollout engine {p.engine}")
    lines.append("held by each worker in every phase: " + (
        ", ".join(f"{k} {_size(v)}" for k, v in p.held.items()) or "nothing (offloaded)"))
    lines.append("")
    mem = "reserved" if p.device == "cuda" else "host"
    header = f"{'phase':<20}{'allocated':>12}{mem:>12}{'time':>11}  largest terms"
    lines += [header, "-" * len(header)]
    for ph in p.phases:
        if not ph.runs:
            lines.append(f"{ph.name:<20}{'-':>12}{'-':>12}{'-':>11}  not run: {ph.why_not}")
            continue
        t = _seconds(ph.seconds) if ph.seconds is not None else "-"
        terms = ", ".join(f"{k} {_size(v)}" for k, v in ph.largest())
        lines.append(f"{ph.name:<20}{_size(ph.allocated):>12}{_size(ph.reserved):>12}{t:>11}  {terms}")
    lines.append("")
    lines.append(p.step_time_text())
    lines.append(f"verdict: {p.verdict}")
    alone = [s for s in p.suggestions if len(s.changes) == 1]
    together = [s for s in p.suggestions if len(s.changes) > 1]
    if alone:
        lines.append("what to change (each alone, re-planned with it):")
        lines += [f"  {s.text()}" for s in alone]
    for s in together:
        lines.append(f"or all of these together: {s.effect}")
        lines += [f"  {o}" for o in s.overrides]
    if not p.fits and not any(s.fits for s in p.suggestions):
        lines.append("no change of batch sizes, checkpointing, offload or GPU count tried here makes it fit: "
                     "shorter sequences, fewer responses per step or a smaller model")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)

