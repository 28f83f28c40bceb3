"""The rollout engine's own worker, for trainer.rollout_mode=async: a rank apart from the actor's, holding a whole
copy of the policy in the compute dtype and the engine that samples from it (workbench, Hugging Face generate or
vLLM), so generation runs on its own devices while the actor trains on others.

Weights arrive by broadcast from the actor's rank 0 over a process group of their own (transfer rank 0 is the
actor's rank 0, transfer rank r + 1 this worker's rank r): NCCL between GPUs, gloo between CPU processes, never
through disk. Each worker answers with a checksum of every tensor it received, which the controller compares with
the actor's, and checks its engine's copy against the received tensors as the colocated worker does.

The update's importance weights need the log-prob each sampled token had under the weights that sampled it. vLLM
returns them; for the other engines this worker computes them with a forward of its copy over the prompt and the
response.
"""

from __future__ import annotations

import torch

from backend.core import lora
from backend.core.config import Config, from_dict
from backend.core.models import load_model, load_tokenizer, resolve_model
from backend.engine import distributed
from backend.engine.log_probs import response_log_probs
from backend.engine.rank import MicroBatches, RankWorker, to_device
from backend.rollout import static_cache
from backend.rollout.base import (
    HFGenerateEngine,
    RolloutBatch,
    SamplingParams,
    StaleWeightsError,
    eos_ids_of,
    fingerprint,
    left_pad,
)
from backend.rollout.vllm_engine import VLLMEngine


def build_rollout_engine(cfg: Config, model, tokenizer, device: torch.device, dtype: torch.dtype, max_len: int,
                         free_between: bool):
    """The engine actor_rollout_ref.rollout.name asks for, sampling from `model` (the weights it copies, or for
    Hugging Face generate the model itself, LoRA adapters included). `free_between`: free the engine's memory
    after each generation, for an update that shares the device."""
    r, base = cfg.actor_rollout_ref.rollout, lora.unwrap(model)
    if r.name == "vllm":
        return VLLMEngine(resolve_model(cfg.actor_rollout_ref.model.path), eos_ids_of(base, tokenizer),
                          tokenizer.pad_token_id, device, dtype, max_len,
                          gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.generation_batch_size,
                          enforce_eager=r.enforce_eager, sleep=free_between, seed=cfg.trainer.seed,
                          kv_cache_dtype=r.kv_cache_dtype)
    reason = static_cache.unsupported_reason(model.config)
    if r.name == "hf" or (r.name == "auto" and reason):
        if r.kv_cache_dtype == "fp8":
            raise ValueError(f"actor_rollout_ref.rollout.kv_cache_dtype=fp8 needs the workbench or vLLM engine, and "
                             f"rollout.name=auto falls back to Hugging Face generate here: {reason}")
        return HFGenerateEngine(model, tokenizer, r.generation_batch_size, device=device, autocast=False)
    if reason:
        raise ValueError(f"actor_rollout_ref.rollout.name=workbench cannot run this model: {reason}")
    return static_cache.StaticCacheEngine(base, tokenizer, r.generation_batch_size, device, dtype, max_len=max_len,
                                          cuda_graphs=not r.enforce_eager, free_after_generate=free_between,
                                          kv_dtype=static_cache.KV_DTYPES[r.kv_cache_dtype])


def engine_name(engine) -> str:
    """How a stale-weights finding names the engine."""
    return "vLLM" if isinstance(engine, VLLMEngine) else "the workbench engine"


def checksums(named: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    """Two numbers per tensor, from its fingerprint (rollout.base: an evenly strided sample of its values): their
    fp64 sum and their sum weighted by position. A tensor left behind by a broadcast changes them; both sides
    compute them from the same values in the same order, so equal tensors give equal numbers."""
    pairs = []
    for _, t in named:
        sample = fingerprint(t).double()
        pairs.append(torch.stack([sample.sum(), (sample * torch.arange(1, len(sample) + 1, device=sample.device,
                                                                        dtype=torch.float64)).sum()]))
    values = torch.stack(pairs).cpu().tolist() if pairs else []
    return {name: tuple(v) for (name, _), v in zip(named, values, strict=True)}


class RolloutWorker(RankWorker):
    """Rollout rank `rank` of `world_size`; `transfer` is (host, port) of the store the weight broadcast's group
    meets at. `device` is "cuda" (the one GPU Ray gave this process) or "cpu"."""

    def __init__(self, cfg: dict, rank: int, world_size: int, transfer_host: str, transfer_port: int, device: str):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg: Config = from_dict(cfg)
        arr = self.cfg.actor_rollout_ref
        self.rank = rank
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = distributed.param_dtype(arr.actor.fsdp_config.param_dtype, self.device)
        self.model = load_model(arr.model.path, self.device, dtype).eval().requires_grad_(False)
        if self.device.type == "cpu" and dtype == torch.bfloat16:
            self.model.set_attn_implementation("eager")  # as the actor's CPU ranks (workers.py says why)
        self.tokenizer = load_tokenizer(arr.model.path, arr.model.tokenizer_path)
        max_len = self.cfg.data.max_prompt_length + self.cfg.data.max_response_length
        # Nothing else uses this device: the engine keeps its cache and graphs between generations.
        self.engine = build_rollout_engine(self.cfg, self.model, self.tokenizer, self.device, dtype, max_len,
                                           free_between=False)
        self.weights = list(self.model.named_parameters())
        self.transfer = distributed.transfer_group(transfer_host, transfer_port, rank + 1, world_size + 1,
                                                   self.device)
        self.version = -1
        self._progress: tuple = ()

    @torch.no_grad()
    def receive_weights(self, version: int) -> dict[str, tuple]:
        """The actor's weights after `version` updates, broadcast into this copy and loaded into the engine; the
        checksum of each tensor received, for the controller to compare with what the actor sent."""
        distributed.broadcast_tensors(self.transfer, [p for _, p in self.weights])
        if isinstance(self.engine, static_cache.StaticCacheEngine | VLLMEngine):
            self.engine.load_weights(self.model)
            if stale := self.engine.stale_tensors(self.model):
                raise StaleWeightsError(engine_name(self.engine), stale)
        self.version = version
        return checksums(self.weights)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, first_row: int) -> dict:
        """Responses to this rank's prompts from the weights it holds, each sampled token's log-prob under them,
        and which weights those were (`version`: updates applied)."""
        self._progress = ()
        if not prompts:
            return {}
        batch = self.engine.generate(prompts, params, first_row=first_row,
                                     progress=lambda *p: self._report("generation", *p))
        log_probs = batch.rollout_log_probs
        if log_probs is None:
            log_probs = self._log_probs(prompts, params.n, batch)
        return {"responses": batch.responses, "response_mask": batch.response_mask,
                "finish_reasons": batch.finish_reasons, "rollout_log_probs": log_probs, "version": self.version}

    def _log_probs(self, prompts: list[list[int]], n: int, batch: RolloutBatch) -> torch.Tensor:
        """(rows, R) fp32: the sampled tokens' log-probs under this copy, 0 at padding; micro-batched as the
        actor's old log-prob pass (actor_rollout_ref.rollout's log_prob_* keys)."""
        r = self.cfg.actor_rollout_ref.rollout
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], self.tokenizer.pad_token_id)
        response_len = batch.responses.shape[1]
        mask = torch.cat([prompt_mask, batch.response_mask.to(prompt_mask.dtype)], 1)
        inputs = to_device({"input_ids": torch.cat([prompt_ids, batch.responses], 1), "attention_mask": mask},
                           self.device)
        plan = MicroBatches(mask, response_len, r.log_prob_micro_batch_size_per_gpu,
                            self.cfg.actor_rollout_ref.log_prob_token_budget(r))
        parts = [response_log_probs(self.model, mb["input_ids"], mb["attention_mask"], mb_len, r.temperature)[0]
                 for mb, mb_len in plan.split(inputs)]
        return (plan.join(parts, response_len).float().cpu() * batch.response_mask.float())
