"""The worker: one rank of the run, holding the actor (FSDP2-sharded policy and its optimizer), the
reference (sharded the same way, no optimizer) and the rollout engine that samples with the actor's
own gathered weights (colocated, as verl's ActorRolloutRefWorker).

It runs as a Ray actor (see worker_group), but it is a plain class: every method takes and returns
tensors and dicts, and the collective ones (everything that runs the model except generation) must be
called on all ranks with the same number of rows. backend.engine.distributed says what each phase holds
in memory.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch._functorch.config

from backend.algos.losses import agg_loss, get_policy_loss_fn, kl_penalty, rollout_is_weights
from backend.core import checkpoint, lora
from backend.core.config import Config, from_dict
from backend.core.models import load_model, load_tokenizer
from backend.engine import distributed
from backend.engine.log_probs import response_log_probs
from backend.engine.rank import (
    COMPILED_WIDTH_MULTIPLE,
    CompileLedger,
    MarkedRows,
    MicroBatches,
    PeakMemory,
    RankWorker,
    lr_lambda,
    micro_batches_on_ranks,
    node_ip,
    step_counts,
    to_device,
)
from backend.engine.rollout_worker import build_rollout_engine, checksums, engine_name
from backend.rollout import static_cache
from backend.rollout.base import RolloutBatch, SamplingParams, StaleWeightsError
from backend.rollout.episodes import Episode, EpisodeSetup, play_episodes, run_episodes
from backend.rollout.vllm_engine import VLLMEngine

Batch = dict[str, torch.Tensor]


class ActorRolloutRefWorker(RankWorker):
    """Rank `rank` of `world_size`. `device` is "cuda" (the one GPU Ray gave this process) or "cpu"."""

    def __init__(self, cfg: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 device: str, total_steps: int, transfer: tuple[str, int, int] | None = None):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-file bars from every rank would flood the run's log
        self.cfg: Config = from_dict(cfg)
        arr = self.cfg.actor_rollout_ref
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        distributed.init_process_group(rank, world_size, master_addr, master_port, self.device)
        torch.manual_seed(self.cfg.trainer.seed)
        dtype = distributed.param_dtype(arr.actor.fsdp_config.param_dtype, self.device)

        compile_layers = arr.actor.use_torch_compile and self.device.type == "cuda"
        if compile_layers:
            # Read by the partitioner of every compiled graph with a backward in this process: only the
            # actor's layers train here (the reference and the vocabulary pass compile forward graphs).
            torch._functorch.config.activation_memory_budget = arr.actor.activation_memory_budget
        self.actor = load_model(arr.model.path, torch.device("cpu"))  # fp32 master weights, sharded below
        if arr.model.enable_gradient_checkpointing:
            self.actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = arr.model.lora_rank > 0
        if self.lora:
            self.actor = lora.wrap(self.actor, arr.model.lora_rank, arr.model.lora_alpha, arr.model.target_modules)
        self.gather_once = distributed.gathers_once(world_size, arr.actor.fsdp_config.offload_policy)
        self.ref_gather_once = distributed.gathers_once(world_size, arr.ref.fsdp_config.offload_policy)
        distributed.shard_model(self.actor, self.device, dtype, offload=arr.actor.fsdp_config.offload_policy,
                                compile_layers=compile_layers, per_layer=not self.gather_once)
        self.actor.train()
        opt = arr.actor.optim
        # With LoRA only the adapters train: the frozen base gets no gradients and no AdamW state.
        # Fused: one kernel for every parameter instead of a pass per operation and parameter (faster on the
        # GPU workload and on the CPU, docs/performance.md); offloaded parameters step on the CPU as before.
        fused = not arr.actor.fsdp_config.offload_policy
        self.optimizer = torch.optim.AdamW([p for p in self.actor.parameters() if p.requires_grad], lr=opt.lr,
                                           betas=tuple(opt.betas), weight_decay=opt.weight_decay, fused=fused or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(opt.lr_warmup_steps, total_steps, opt.warmup_style, opt.min_lr_ratio))

        self.ref = None
        # A LoRA run's reference is its own base with the adapters off (lora.reference_mode): no second copy.
        if (arr.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward) and not self.lora:
            # Stored in the compute dtype (no optimizer needs fp32 here): the same values the actor's
            # fp32 weights gather to, so the KL is exactly 0 before the first update. Its weights keep
            # requires_grad (its passes run without gradients all the same) because torch.compile guards on it:
            # so the actor's passes without gradients reuse the reference pass's layer graph, not a third one.
            self.ref = load_model(arr.model.path, torch.device("cpu"), dtype).eval()
            distributed.shard_model(self.ref, self.device, dtype, offload=arr.ref.fsdp_config.offload_policy,
                                    compile_layers=compile_layers, per_layer=not self.ref_gather_once)
        if self.device.type == "cpu" and dtype == torch.bfloat16:
            # PyTorch's fused CPU attention in bf16 made the passes over a micro-batch of the default config
            # half as slow again as attention written out in matrix products (which run at bf16 speed there).
            for model in (self.actor, self.ref):
                if model is not None:
                    model.set_attn_implementation("eager")
        self.tokenizer = load_tokenizer(arr.model.path, arr.model.tokenizer_path)
        self.episode_setup = EpisodeSetup.of(self.cfg, self.tokenizer) if arr.rollout.multi_turn.enable else None
        max_len = self.cfg.data.max_prompt_length + self.cfg.data.max_response_length
        if self.episode_setup is not None:
            max_len += self.episode_setup.renderer.tools_tokens  # an episode's first prompt offers the tools
        # With trainer.rollout_mode=async the rollout workers generate (rollout_worker); rank 0 sends them the
        # weights over a group of their own, `transfer` = (host, port, number of rollout workers).
        self.rollout = None if transfer else build_rollout_engine(self.cfg, self.actor, self.tokenizer, self.device,
                                                                  dtype, max_len, arr.rollout.free_cache_engine)
        self.transfer, self.compute_dtype = None, dtype
        if transfer and rank == 0:
            host, port, rollout_ranks = transfer
            self.transfer = distributed.transfer_group(host, port, 0, rollout_ranks + 1, self.device)
        self.temperature = arr.rollout.temperature
        self.compiled = compile_layers
        self.width_multiple = COMPILED_WIDTH_MULTIPLE if compile_layers else 1
        self.clip_low, self.clip_high = arr.actor.clip_range()
        self.policy_loss = get_policy_loss_fn(arr.actor.policy_loss.loss_mode)
        self._progress: tuple = ()
        self._peaks = PeakMemory(self.device)
        self._phase = self._peaks.phase
        self._compiles = CompileLedger()

    @staticmethod
    def _gathered(model, once: bool):
        """The model gathered once for a whole phase when `once` (distributed.gathers_once), else FSDP's
        gather and free around each layer."""
        return distributed.unsharded(model) if once else contextlib.nullcontext()

    # ---- rollout ----

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, first_row: int) -> dict:
        """Responses to this rank's prompts, sampled with the current weights gathered once for the
        whole generation (no collectives while decoding, so ranks finish independently)."""
        self._progress = ()
        if not prompts:
            return {}
        report = lambda *p: self._report("generation", *p)  # noqa: E731
        with self._phase("gen"):
            if isinstance(self.rollout, static_cache.StaticCacheEngine | VLLMEngine):
                # The engine keeps its own copy: gather, copy in, and free the gathered weights before it
                # decodes (vLLM wakes its KV cache only then).
                with distributed.unsharded(self.actor):
                    self._sync_engine()
                batch = self.rollout.generate(prompts, params, first_row=first_row, progress=report)
            else:
                with distributed.unsharded(self.actor):
                    batch = self.rollout.generate(prompts, params, first_row=first_row, progress=report)
        out = {"responses": batch.responses, "response_mask": batch.response_mask,
               "finish_reasons": batch.finish_reasons}
        if batch.rollout_log_probs is not None:
            out["rollout_log_probs"] = batch.rollout_log_probs
        return out

    @torch.no_grad()
    def episodes(self, rows: list[dict], params: SamplingParams, first_row: int) -> tuple[list[Episode], float]:
        """Episodes from this rank's rows (the environments run here, next to the engine), sampled with the
        current weights, and the seconds generation waited on environments (timing_s/tools). The
        workbench engine keeps each episode in its cache; the others take each turn's whole prefix."""
        self._progress = ()
        if not rows:
            return [], 0.0
        setup = self.episode_setup
        envs = setup.environments(len(rows))
        report = lambda text: self._report("episodes", text)  # noqa: E731
        timings: dict[str, float] = {}
        args = (self.tokenizer, setup.renderer, envs, rows, params, setup.limits, first_row, report, timings)
        with self._phase("gen"):
            if isinstance(self.rollout, static_cache.StaticCacheEngine):
                with distributed.unsharded(self.actor):
                    self._sync_engine()
                episodes = play_episodes(self.rollout, *args)
            elif isinstance(self.rollout, VLLMEngine):
                with self.rollout.awake():
                    episodes = run_episodes(self._vllm_turn, *args)
            else:
                with distributed.unsharded(self.actor):
                    episodes = run_episodes(self.rollout.generate, *args)
        return episodes, timings.get("timing_s/tools", 0.0)

    def _sync_engine(self) -> None:
        """Copy the gathered actor into the engine, then check that every tensor arrived (a fingerprint of
        each, compared on the device), so a sync that left a layer behind fails the step instead of sampling
        from stale weights."""
        model = lora.unwrap(self.actor)
        self.rollout.load_weights(model)
        if stale := self.rollout.stale_tensors(model):
            raise StaleWeightsError(engine_name(self.rollout), stale)

    @torch.no_grad()
    def send_weights(self) -> dict[str, tuple[float, float]]:
        """The actor's whole weights, broadcast from rank 0 to the rollout workers (trainer.rollout_mode=async).
        Every rank gathers (a collective); rank 0 returns each tensor's checksum as sent, the others nothing."""
        with distributed.unsharded(self.actor):
            if self.transfer is None:
                return {}
            # The rollout workers hold the compute dtype, which the gathered weights are already in on GPUs.
            weights = [(name, p.to(self.compute_dtype)) for name, p in self.actor.named_parameters()]
            distributed.broadcast_tensors(self.transfer, [p for _, p in weights])
            return checksums(weights)

    def _vllm_turn(self, prompts: list[list[int]], params: SamplingParams, row_ids: list[int]) -> RolloutBatch:
        """One lockstep turn on vLLM, pushing the weights before the first (vLLM stays awake for the rest)."""
        if not self.rollout.loaded:
            with distributed.unsharded(self.actor):
                self._sync_engine()
        return self.rollout.generate(prompts, params, row_ids=row_ids)

    # ---- log-probs ----

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, R) log-probs of the responses under the current policy, and the entropy per position."""
        self.actor.eval()
        response_len = batch["responses"].shape[1]
        plan = self._log_prob_plan(batch, self.cfg.actor_rollout_ref.rollout)
        lps, ents = [], []
        inputs = to_device({k: batch[k] for k in ("input_ids", "attention_mask")}, self.device)
        with self._phase("old_log_prob"), self._gathered(self.actor, self.gather_once):
            for mb, mb_response_len in plan.split(inputs):
                lp, ent = response_log_probs(self.actor, mb["input_ids"], mb["attention_mask"], mb_response_len,
                                             self.temperature, with_entropy=True, compiled=self.compiled)
                lps.append(lp)
                ents.append(ent)
            self.actor.reshard()  # FSDP keeps the root's parameters gathered after a forward without backward
        self.actor.train()
        # One copy to the host at the end, so the micro-batches run back to back on the device.
        return plan.join(lps, response_len).cpu(), plan.join(ents, response_len).cpu()

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        """(b, R) log-probs of the responses under the reference model."""
        model = self.ref if self.ref is not None else self.actor
        once = self.ref_gather_once if self.ref is not None else self.gather_once
        plan = self._log_prob_plan(batch, self.cfg.actor_rollout_ref.ref)
        inputs = to_device({k: batch[k] for k in ("input_ids", "attention_mask")}, self.device)
        reference = lora.reference_mode(self.actor) if self.ref is None else contextlib.nullcontext()
        with self._phase("ref"), reference, self._gathered(model, once):
            parts = [response_log_probs(model, mb["input_ids"], mb["attention_mask"], mb_response_len,
                                        self.temperature, compiled=self.compiled)[0]
                     for mb, mb_response_len in plan.split(inputs)]
            model.reshard()
        return plan.join(parts, batch["responses"].shape[1]).cpu()

    def _log_prob_plan(self, batch: Batch, section) -> MicroBatches:
        """The micro-batches of a log-prob pass configured by `section` (ref or rollout: its
        log_prob_* keys, each null meaning the actor's)."""
        return micro_batches_on_ranks(batch["attention_mask"], batch["responses"].shape[1],
                                      section.log_prob_micro_batch_size_per_gpu,
                                      self.cfg.actor_rollout_ref.log_prob_token_budget(section),
                                      self.world_size, self.device, self.width_multiple)

    # ---- the update ----

    def update_actor(self, batch: Batch, mini_rows: int, counts: list[tuple[float, float]] | None = None
                     ) -> tuple[dict[str, float], MarkedRows | None]:
        """PPO-clip update; returns this rank's actor/* metrics and what it computed for the marked rows.

        batch: this rank's rows, already in update order (the controller shuffles and gives each rank
        an equal part of every mini-batch), holding input_ids, attention_mask, responses, response_mask,
        advantages, and old_log_probs / ref_log_probs when used. Every `mini_rows` rows are one optimizer
        step. `counts` holds each step's valid tokens and non-empty responses over all ranks (rank.step_counts;
        one rank alone counts its own rows): every micro-batch's loss is its share of the whole mini-batch's,
        so each token weighs the same whichever micro-batch or rank it falls in, as in verl 0.9.1. Without
        old_log_probs the update is on-policy: the ratio is exactly 1 and only its gradient counts. With
        rollout_log_probs (the sampling engine's own, vllm) each token's policy loss is weighted by
        rollout_is_weights against old_log_probs (on-policy: the detached current log-probs) unless
        algorithm.rollout_correction.rollout_is is null; rollout/* metrics say how far the two engines
        disagree. Rows whose `token_row` (optional) is k >= 0 get their log-probs under the updated weights
        at the end, and, when the update is one optimizer step, its forward's log-probs and entropies: the
        token view's "after" and "before" without passes of their own (MarkedRows).
        """
        self._progress = ()
        a = self.cfg.actor_rollout_ref.actor
        total = batch["responses"].shape[0]
        response_len = batch["responses"].shape[1]
        counts = counts if counts is not None else step_counts(batch["response_mask"], mini_rows)
        # Metrics stay on the device until the update ends: reading one per micro-batch would make the host
        # wait for the device there, and it could no longer queue the next micro-batch's work. Loss terms add
        # up over a step's micro-batches (each is its share of the step's loss) and average over steps; the
        # rates (clip fractions, IS weights) average over micro-batches, peaks take the largest.
        means: dict[str, list] = {}
        peaks: dict[str, list] = {}
        rc = self.cfg.algorithm.rollout_correction
        marked = batch.get("token_row")
        first_forward: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        max_tokens = a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None
        plans = [micro_batches_on_ranks(batch["attention_mask"][start:start + mini_rows], response_len,
                                        a.ppo_micro_batch_size_per_gpu, max_tokens, self.world_size, self.device,
                                        self.width_multiple)
                 for start in range(0, total, mini_rows)]
        n_micro_total = sum(len(plan) for plan in plans)
        done = skipped = 0
        batch = to_device(batch, self.device)
        with self._phase("update_actor"):
            for step, start in enumerate(range(0, total, mini_rows)):
                mini = {k: v[start:start + mini_rows] for k, v in batch.items()}
                num_tokens, num_seqs = counts[step]
                agg = {"loss_agg_mode": a.loss_agg_mode, "num_tokens": num_tokens, "num_seqs": num_seqs,
                       "loss_scale_factor": a.loss_scale_factor or self.cfg.data.max_response_length}
                self.optimizer.zero_grad(set_to_none=True)
                step_losses: dict[str, torch.Tensor] = {}
                plan = plans[step]
                with self._gathered(self.actor, self.gather_once):
                    for i, (mb, mb_response_len) in enumerate(plan.split(mini)):
                        if self.gather_once:
                            # Unreduced gradients accumulate in fp32 (FSDP's reduce dtype) until the last
                            # micro-batch reduces them into the shards once.
                            self.actor.set_requires_gradient_sync(i == len(plan) - 1)
                        mask = mb["response_mask"].float()
                        log_probs, entropy = response_log_probs(
                            self.actor, mb["input_ids"], mb["attention_mask"], mb_response_len, self.temperature,
                            with_entropy=True, entropy_grad=a.entropy_coeff > 0, compiled=self.compiled)
                        old = mb.get("old_log_probs", log_probs.detach())
                        if "token_row" in mb and step == 0:
                            # As the log-prob passes give them: 0 past each row's response, width response_len.
                            inside = mb["attention_mask"][:, -mb_response_len:].bool()
                            pad = (0, response_len - mb_response_len)
                            first_forward.append((mb["token_row"], *(
                                torch.nn.functional.pad(torch.where(inside, v.detach(), 0.0), pad)
                                for v in (log_probs, entropy))))
                        is_weights = None
                        if "rollout_log_probs" in mb:
                            weights, is_metrics = rollout_is_weights(old, mb["rollout_log_probs"], mask,
                                                                     rc.rollout_is_threshold)
                            is_weights = weights if rc.rollout_is else None
                            for k, v in is_metrics.items():
                                (peaks if k.endswith("_max") else means).setdefault(k, []).append(v)
                        pg_loss, pg_metrics = self.policy_loss(
                            old, log_probs, mb["advantages"], mask, clip_ratio_low=self.clip_low,
                            clip_ratio_high=self.clip_high, clip_ratio_c=a.clip_ratio_c, rollout_is_weights=is_weights,
                            **agg)
                        entropy_loss = agg_loss(entropy, mask, **agg)
                        terms = {"actor/pg_loss": pg_loss, "actor/entropy": entropy_loss}
                        loss = pg_loss - a.entropy_coeff * entropy_loss if a.entropy_coeff else pg_loss
                        if a.use_kl_loss:
                            terms["actor/kl_loss"] = agg_loss(kl_penalty(log_probs, mb["ref_log_probs"],
                                                                         a.kl_loss_type), mask, **agg)
                            loss = loss + a.kl_loss_coef * terms["actor/kl_loss"]
                        # FSDP averages the ranks' gradients: each rank's share of the step's loss counts
                        # world_size times, so the average is the gradient of the whole step's loss.
                        (loss * self.world_size).backward()
                        for k, v in terms.items():
                            step_losses[k] = step_losses.get(k, 0.0) + v.detach() * self.world_size
                        for k, v in pg_metrics.items():
                            means.setdefault(k, []).append(v)
                        done += 1
                        self._report("the actor update", done, n_micro_total)
                grad_norm = distributed.global_grad_norm(self.actor.parameters(), a.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                for k, v in {**step_losses, "actor/grad_norm": grad_norm}.items():
                    means.setdefault(k, []).append(v)
        metrics = self._read_metrics(means, peaks)
        if a.use_kl_loss:
            metrics["actor/kl_coef"] = a.kl_loss_coef
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        metrics["actor/lr"] = lr
        metrics["actor/skipped_steps"] = float(skipped)
        marked_rows = self._marked_rows(marked, first_forward, batch, response_len, one_step=total <= mini_rows)
        metrics.update(self.memory())
        # After the marked rows' pass, whose first compilation belongs to this step.
        metrics.update(self._compiles.take())
        return metrics, marked_rows

    def _read_metrics(self, means: dict[str, list], peaks: dict[str, list]) -> dict[str, float]:
        """Each metric's mean over its values (or, for a peak, the largest), read from the device in one copy."""
        def stacked(values: list) -> torch.Tensor:
            return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device) for v in values])

        names = [*means, *peaks]
        if not names:
            return {}
        values = [stacked(means[k]).mean() for k in means] + [stacked(peaks[k]).max() for k in peaks]
        return dict(zip(names, torch.stack(values).tolist(), strict=True))

    def _marked_rows(self, marks: torch.Tensor | None, first_forward: list, batch: Batch, response_len: int,
                     one_step: bool) -> MarkedRows | None:
        """The marked rows' log-probs after the update (each row once, though epochs repeat it), and the first
        forward's values when the update was one optimizer step."""
        if marks is None:
            return None
        first: dict[int, int] = {}
        for i, mark in enumerate(marks.tolist()):
            if mark >= 0:
                first.setdefault(mark, i)
        rows = torch.tensor(list(first), dtype=torch.long)
        index = torch.tensor(list(first.values()), dtype=torch.long)
        after = self._log_probs_after_update({k: batch[k][index.to(batch[k].device)]
                                              for k in ("input_ids", "attention_mask")}, response_len)
        if not one_step or not first_forward:
            return MarkedRows(rows, after)
        forward_rows, lps, ents = (torch.cat(parts) for parts in zip(*first_forward, strict=True))
        keep = forward_rows >= 0
        order = forward_rows[keep].argsort()
        by_mark = rows.argsort()
        return MarkedRows(rows[by_mark], after[by_mark], lps[keep][order].cpu(), ents[keep][order].cpu())

    @torch.no_grad()
    def _log_probs_after_update(self, inputs: Batch, response_len: int) -> torch.Tensor:
        """(k, R) log-probs of the k rows of `inputs` under the weights the update left, on the host: the
        token view's "after", in the update's own call. The model is gathered whole, so a rank with fewer
        rows than another (or none) runs no collective but the gather every rank makes."""
        self.actor.eval()
        plan = MicroBatches(inputs["attention_mask"], response_len,
                            self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu,
                            width_multiple=self.width_multiple)
        with distributed.unsharded(self.actor):
            parts = [response_log_probs(self.actor, mb["input_ids"], mb["attention_mask"], mb_response_len,
                                        self.temperature, compiled=self.compiled)[0]
                     for mb, mb_response_len in plan.split(inputs)]
        self.actor.train()
        return plan.join(parts, response_len).cpu()

    def memory(self) -> dict[str, float]:
        """Peak GPU memory of this rank in each phase since the last call and over all of them, in GiB:
        perf/max_memory_{allocated,reserved}_gb[/<phase>] (nothing on CPU)."""
        return self._peaks.take(overall=True)

    # ---- checkpoints and export ----

    def save_checkpoint(self, folder: str) -> None:
        checkpoint.save_sharded(Path(folder), self.actor, self.optimizer, self.scheduler, self.rank)
        if self.lora and self.rank == 0:
            model = self.cfg.actor_rollout_ref.model
            lora.save_settings(Path(folder), model.lora_rank, model.lora_alpha)

    def load_checkpoint(self, folder: str) -> None:
        checkpoint.load_sharded(Path(folder), self.actor, self.optimizer, self.scheduler, self.rank)

    def export(self, folder: str) -> None:
        """The current weights, gathered from every rank, as a Hugging Face folder written by rank 0."""
        state = distributed.full_state_dict(self.actor)
        if self.rank == 0 and self.lora:
            model = self.cfg.actor_rollout_ref.model
            state = lora.merge_state_dict(state, model.lora_rank, model.lora_alpha)
        if self.rank == 0:
            checkpoint.save_hf(state, self.actor.config, self.actor.generation_config, Path(folder))
            (Path(folder) / "grpo_workbench.json").write_text(
                json.dumps({"base_model": self.cfg.actor_rollout_ref.model.path}))

    # ---- debugging ----

    def debug_listen(self, port: int) -> tuple[str, int]:
        """Start a debugpy server on this worker's node; returns where a client attaches."""
        import debugpy

        host = node_ip()
        _, bound = debugpy.listen((host, port))
        return host, bound

    def debug_wait(self) -> None:
        import debugpy

        debugpy.wait_for_client()

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


