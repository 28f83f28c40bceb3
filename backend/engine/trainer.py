"""The single-controller training loop: one Python loop drives rollout, reward, log-probs,
advantages and the update, and writes everything into the run directory.

    prompts ─ rollout ─► n responses each ─ reward ─► scores ─ actor/ref ─► log-probs
            ─ algos ─► advantages ─ actor ─► PPO-clip update ─► metrics, rollouts, checkpoint
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm import tqdm

from backend.algos.advantages import compute_advantage, groups_with_signal, overlong_penalty
from backend.algos.losses import AdaptiveKLController, FixedKLController, apply_kl_penalty, explained_variance
from backend.core import checkpoint, data, trackers
from backend.core.config import Config, ConfigError, batch_plan, to_yaml, uses_critic, validate_config
from backend.core.models import load_tokenizer
from backend.core.runs import NICE_ENV, RunDir, atomic_write_text, latest_checkpoint, new_run_dir, read_status
from backend.engine.checks import check_or_raise, resume_problems
from backend.engine.evaluation import evaluate
from backend.engine.inference import Generator
from backend.engine.rank import MarkedRows, freeze_heap
from backend.engine.replay import StepDump
from backend.engine.step_log import TableWriter, rollout_rows, token_rows
from backend.engine.step_metrics import batch_metrics, stats, summary_line, timer
from backend.engine.worker_group import (
    PendingGeneration,
    Stall,
    WorkerError,
    WorkerGroup,
    WorkerOutOfMemory,
    WorkerStaleWeights,
    start_ray,
)
from backend.rewards.registry import load_custom_reward
from backend.rewards.scoring import ScoredBatch, combine, concat_scored, from_scores, reward_terms
from backend.rollout.base import RolloutBatch, SamplingParams, concat_rows
from backend.rollout.episodes import (
    Episode,
    episode_batch,
    episode_metrics,
    first_tool_error,
)

T = TypeVar("T")
# The stale tensors a failed run's diagnosis lists (a sync that skipped a whole model would name hundreds).
STALE_SHOWN = 50
# How a write the disk refused reads: the errno's words, or PyTorch's zip writer's, which sees only that a file
# it wrote (a checkpoint's) came out shorter than what it handed over.
DISK_FULL = ("No space left on device", "unexpected pos")


class RunStopped(BaseException):
    """The run was asked to stop (SIGTERM / SIGINT); it ends in state `stopped`. A BaseException, as
    KeyboardInterrupt is: a library's `except Exception` (Ray's start-up has several) must not turn a stop
    into an error or swallow it."""


class NonFiniteError(RuntimeError):
    """An update met a non-finite loss or gradient and actor_rollout_ref.actor.nan_policy=stop."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """One run: its workers, data and run directory. `train()` runs it; `evaluate`, `generate` and
    `export` work before, during (between steps) or after training, on the current weights. The
    workers (Ray actors) live until `close()`, the end of a `with` block, or the Trainer is dropped."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, *, show_progress: bool = True):
        validate_config(cfg)
        check_or_raise(cfg)
        run_dir = Path(run_dir) if run_dir else new_run_dir(cfg.trainer.runs_root, cfg.trainer.experiment_name)
        status = read_status(run_dir)
        # A run directory the launcher prepared (state "queued") is this run's own; any other is taken.
        if status and status.get("state") != "queued" and cfg.trainer.resume_mode == "disable":
            raise ConfigError([f"run directory {run_dir} already holds a run (state {status.get('state')}): "
                               "continue it with trainer.resume_mode=auto, or choose another run directory"])
        if status and status.get("state") == "running" and _alive(status.get("pid")):
            raise ConfigError([f"run directory {run_dir} is in use by a running process (pid {status['pid']})"])
        self.cfg = cfg
        self.clip_low, self.clip_high = cfg.actor_rollout_ref.actor.clip_range()
        self.has_critic = uses_critic(cfg)
        self.remax = cfg.algorithm.adv_estimator == "remax"
        self.optimizer_steps = batch_plan(cfg).optimizer_steps_per_step
        self.run = RunDir(run_dir)
        self.show_progress = show_progress
        self._last_stage_write = 0.0
        self._step = 0
        self._ready = False
        self.tables = TableWriter()
        self.tracking = trackers.Tracking({})  # opened by train(): evaluate or generate alone start no tracker run

    # ---- status ----

    def stage(self, text: str, force: bool = False) -> None:
        """What the run is doing now, for the dashboard's live stage line (at most one write a second).

        A lost Ray head raises here, at the next phase at the latest: the watch thread's interrupt never
        reaches a main thread that ignores SIGINT (as a script's background job, `cmd &`, does), and the
        run must not go on writing "running" over the failure the watch thread recorded."""
        if lost := self._head_lost():
            raise WorkerError(lost)
        now = time.time()
        if force or now - self._last_stage_write > 1.0:
            self.run.write_status("running", stage=text, stage_started=now, step=self._step)
            self._last_stage_write = now

    def _head_lost(self) -> str | None:
        """Why the Ray head is gone, as the head's watch thread recorded it; None while it answers (or before
        the workers exist)."""
        return self.workers.head.lost if self._ready else None

    def _generation_stage(self, rows_done: int, rows: int, tokens: int, max_tokens: int) -> None:
        chunk = f" (rows {rows_done + 1}-)" if rows_done else ""
        self.stage(f"generating token {tokens}/{max_tokens} of {rows} responses{chunk}")

    # ---- setup ----

    def setup(self) -> None:
        """Load data, models and (with resume) the last checkpoint; done once, on first need."""
        if self._ready:
            return
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        self.run.create()
        self.run.config.write_text(to_yaml(cfg))
        self.stage("loading data", force=True)
        self.tokenizer = load_tokenizer(arr.model.path, arr.model.tokenizer_path)
        self.train_set = self._dataset(cfg.data.train_files)
        val = self._dataset(cfg.data.val_files) if cfg.data.val_files else None
        limit = cfg.data.val_max_samples
        self.val_items = [val[i] for i in range(len(val) if not limit else min(limit, len(val)))] if val else []
        self.sampler = data.PromptSampler(len(self.train_set), cfg.data.train_batch_size, seed=cfg.data.seed,
                                          shuffle=cfg.data.shuffle)
        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * self.sampler.steps_per_epoch
        self.reward_fns = [(target.rpartition(":")[2], load_custom_reward(target, ""))
                           for target in cfg.reward.functions]
        self.custom_fn = None
        if cfg.custom_reward_function.path:
            self.custom_fn = load_custom_reward(cfg.custom_reward_function.path,
                                                        cfg.custom_reward_function.name)
        ckpt = self._resume_point()
        if ckpt is not None and resume_problems(cfg, ckpt):
            raise ConfigError(resume_problems(cfg, ckpt))
        self.stage("starting Ray", force=True)
        start_ray(cfg)
        world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        self.stage(f"starting {world} worker(s) and loading models", force=True)
        seed_everything(cfg.trainer.seed)
        # The watch thread gets the run directory, not the trainer: holding the trainer would keep a dropped
        # one (and its workers) alive.
        self.workers = WorkerGroup(cfg, self.total_steps, pad_id=self.tokenizer.pad_token_id,
                                   on_head_lost=functools.partial(_record_head_lost, self.run),
                                   on_stall=functools.partial(_record_stall, self.run))
        self.run.write_status("running", workers=self.workers.where, rollout_workers=self.workers.rollout_where)
        if os.environ.get(NICE_ENV):
            yield_cpu(int(os.environ[NICE_ENV]))
        self.has_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.rollout = self.workers  # the group is the rollout engine: each rank generates its share
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive"
                        else FixedKLController(kl.kl_coef))
        self.start_step = 0
        if ckpt is not None:
            self.stage(f"resuming from {ckpt.name}", force=True)
            self._load(ckpt)
        # trainer.rollout_mode=async: the actor's updates so far, those in the rollout workers' weights (None: no
        # push yet), and the next step's generation while it runs (a resumed run generates its first batch anew).
        self._updates, self._rollout_version = self.start_step, None
        self._pending: PendingBatch | None = None
        self._ready = True

    def _dataset(self, files: list[str]) -> data.PromptDataset:
        return data.PromptDataset(data.load_many(files), self.tokenizer, self.cfg.data.max_prompt_length,
                                  truncation=self.cfg.data.truncation,
                                  filter_overlong_prompts=self.cfg.data.filter_overlong_prompts,
                                  source=", ".join(files))

    def _resume_point(self) -> Path | None:
        t = self.cfg.trainer
        if t.resume_mode == "auto":
            return latest_checkpoint(self.run.root)
        if t.resume_mode == "resume_path":
            path = Path(t.resume_from_path)
            if not (path / "trainer_state.json").is_file():
                raise FileNotFoundError(f"trainer.resume_from_path={path} is not a checkpoint folder "
                                        "(no trainer_state.json)")
            return path
        return None

    # ---- the loop ----

    def train(self) -> dict[str, float]:
        """Train to total steps; returns the last step's metrics. Always leaves a final status."""
        self.run.create()
        # Its own pid: a run submitted as a Ray job has no launcher that saw the process start.
        self.run.write_status("running", total_steps=None, step=0, started=time.time(), error=None, pid=os.getpid())
        stop = _install_stop_handlers()
        try:
            self.setup()
            self.tracking = trackers.open_trackers(self.cfg.trainer.logger, self.run.root, self.cfg)
            self.run.write_status("running", total_steps=self.total_steps, step=self.start_step)
            metrics = self._loop()
            self.stage("exporting", force=True)
            if self.cfg.trainer.export_at_end:
                self.export(self.run.export)
            self.run.write_status("succeeded", stage="done", step=self._step, finished=time.time())
            return metrics
        except BaseException as e:
            if not _stopped(e):
                self._record_failure(e)
                raise
            lost = self._head_lost()
            if lost is None:
                self.run.write_status("stopped", stage="stopped", finished=time.time(), error=None, traceback=None)
                if isinstance(e, RunStopped | KeyboardInterrupt):
                    raise
                raise RunStopped(f"stopped ({type(e).__name__} on the way: {e})") from e
            self._record_failure(WorkerError(lost))
            raise WorkerError(lost) from e
        finally:
            stop()
            gc.unfreeze()  # what this run held can be collected once it is gone
            self.tables.finish()
            self.tracking.close()

    def _record_failure(self, e: BaseException) -> None:
        """Stop the workers and write the failure, with what to do, into status.json."""
        self.close()
        error = f"{type(e).__name__}: {e}"
        if any(words in error for words in DISK_FULL):
            last = latest_checkpoint(self.run.root)
            free = shutil.disk_usage(self.run.root).free / 2**20
            error += (f"\nThe disk holding {self.run.root} is full ({free:.1f} MiB free now). Free space there (or "
                      f"move the run directory), then resume with trainer.resume_mode=auto: the last whole "
                      f"checkpoint is {last.name if last else 'none yet'}.")
        diagnosis = {}
        if isinstance(e, WorkerOutOfMemory):  # what the planner says of it is added by whoever holds a planner
            diagnosis = {"diagnosis": {"kind": "out of memory", "call": e.what, "rank": e.who, **e.memory,
                                       "at": time.time()}}
        elif isinstance(e, WorkerStaleWeights):
            diagnosis = {"diagnosis": {"kind": "stale weights", "call": e.what, "rank": e.who, "engine": e.engine,
                                       "count": len(e.tensors), "tensors": e.tensors[:STALE_SHOWN],
                                       "at": time.time()}}
        try:
            self.run.write_status("failed", stage="failed", finished=time.time(), error=error,
                                  traceback="".join(traceback.format_exc().splitlines(True)[-30:]), **diagnosis)
        except OSError as write_error:  # e.g. still no space: the dashboard sees the process gone instead
            print(f"could not record the failure in {self.run.status}: {write_error}\n{error}", flush=True)

    def _loop(self) -> dict[str, float]:
        t = self.cfg.trainer
        metrics: dict[str, float] = {}
        if t.val_before_train and self.start_step == 0 and self.val_items:
            self._log_metrics({"step": 0, **self.validate()})
        bar = tqdm(total=self.total_steps, initial=self.start_step, desc="train", unit="step",
                   disable=not self.show_progress, dynamic_ncols=True)
        for step in range(self.start_step + 1, self.total_steps + 1):
            self._step = step
            if t.debug.attach_rank >= 0 and step == t.debug.attach_step:
                self._wait_for_debugger(t.debug.attach_rank, t.debug.port)
            metrics = self.train_step(step)
            if step == self.start_step + 1:
                # What the first step compiled and cached, out of every full collection from now on.
                freeze_heap()
                self.workers.freeze_heap()
            last = step == self.total_steps
            if self.val_items and ((t.test_freq and step % t.test_freq == 0) or last):
                with timer("testing", metrics):
                    metrics.update(self.validate())
            if (t.save_freq and step % t.save_freq == 0) or last:
                with timer("save_checkpoint", metrics):
                    self.tables.wait()  # a checkpoint at this step resumes after it: its tables must be whole
                    self.save(step)
            self._log_metrics(metrics)
            self.run.write_status("running", step=step, stage=f"finished step {step}", stage_started=time.time())
            bar.update(1)
            bar.write(summary_line(metrics, self.total_steps))
        bar.close()
        return metrics

    def _wait_for_debugger(self, rank: int, port: int) -> None:
        host, port = self.workers.attach_debugger(rank, port)
        where = f"{host}:{port}"
        message = (f"worker rank {rank} is waiting for a debugger at {where} (VS Code: 'Python Debugger: Remote "
                   f"Attach' to that host and port); step {self._step} starts once one attaches")
        print(message, flush=True)
        # The stage first: a reader that sees `debugger` must also see the stage that explains it.
        self.stage(message, force=True)
        self.run.write_status("running", debugger=where)
        self.workers.wait_for_debugger(rank, heartbeat=lambda: self.stage(message))
        self.run.write_status("running", debugger=None)

    def _log_metrics(self, metrics: dict) -> None:
        """metrics.jsonl first (the run directory contract), then the trackers of trainer.logger."""
        self.run.append_metrics(metrics)
        self.tracking.log(metrics, metrics["step"])

    def train_step(self, step: int) -> dict[str, float]:
        """One step of the algorithm: rollout, reward, log-probs, advantages, update, metrics."""
        cfg = self.cfg
        timings: dict[str, float] = {}
        # Sampling depends only on (seed, step), so a resumed run draws what an uninterrupted one would.
        seed_everything(self._seed(step))
        epoch = self.sampler.epoch
        dump = self._step_dump(step)  # this step's update inputs, saved for `python -m backend replay`
        with timer("step", timings):
            # ---- rollout: n responses per prompt; the rule scorers start on a thread ----
            rollout = self._rollout(step, timings)
            batch, group_ids = rollout.batch, rollout.batch.prompt_index
            response_mask = batch.response_mask.float()  # (B, R)
            tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                       "responses": batch.responses, "response_mask": batch.response_mask}
            if batch.rollout_log_probs is not None:  # the engine's own (vLLM): the update corrects for them
                tensors["rollout_log_probs"] = batch.rollout_log_probs

            # ---- log-probs (while the scorers run) ----
            old_entropy = None
            if self.optimizer_steps > 1:
                # With one optimizer step the update is on-policy: the old log-probs equal its own first
                # forward's, the ratio is exactly 1, and this pass would be wasted.
                with self._phase("old_log_prob", "computing old log-probs", timings):
                    tensors["old_log_probs"], old_entropy = self.workers.compute_log_prob(tensors)
            if self.has_ref:
                with self._phase("ref", "computing reference log-probs", timings):
                    tensors["ref_log_probs"] = self.workers.compute_ref_log_prob(tensors)
            if self.has_critic:
                with self._phase("values", "computing critic values", timings):
                    tensors["values"] = self.workers.compute_values(tensors)

            # ---- reward ----
            texts, scored = self._wait(rollout.scoring)
            scores, token_level_rewards, reward_metrics = self._rewards(scored, tensors, response_mask,
                                                                        len(rollout.items))
            baselines = self._greedy_baselines(rollout.items, step, timings)[group_ids] if self.remax else None
            if dump is not None:
                dump.save_rewards([rollout.items[i] for i in group_ids.tolist()], texts, scored.scores)

            # ---- advantages ----
            with timer("adv", timings):
                a = cfg.algorithm
                tensors["advantages"], tensors["returns"] = compute_advantage(
                    a.adv_estimator, token_level_rewards=token_level_rewards, response_mask=response_mask,
                    group_ids=group_ids, values=tensors.get("values"), reward_baselines=baselines, gamma=a.gamma,
                    lam=a.lam, norm_adv_by_std=a.norm_adv_by_std_in_grpo)

            # ---- update ----
            update_metrics, marked = self._update(step, tensors, timings, dump)
            if dump is not None:
                dump.commit(update_metrics)

        # ---- metrics and tables ----
        metrics = {"step": step, "epoch": epoch, "time": time.time(), **update_metrics, **reward_metrics,
                   **scored.metrics, **rollout.metrics, **timings}
        if baselines is not None:
            metrics["reward/greedy_baseline/mean"] = baselines.mean().item()
        if scored.first_error:
            metrics["reward/first_error"] = scored.first_error
        if self.has_critic:
            metrics.update(stats("critic/values", tensors["values"][response_mask.bool()]))
        metrics.update(batch_metrics(batch, scores, token_level_rewards, tensors["advantages"],
                                     tensors["returns"], group_ids, cfg.data.max_response_length))
        metrics["perf/total_num_tokens"] = int(batch.attention_mask.sum())
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / timings["timing_s/step"]
        self._write_tables(step, rollout, texts, scored, tensors, marked, old_entropy)
        return metrics

    @contextmanager
    def _phase(self, name: str, stage: str, timings: dict[str, float]) -> Iterator[None]:
        """A timed phase of the step (timing_s/<name>), shown on the dashboard's stage line meanwhile."""
        self.stage(stage, force=True)
        with timer(name, timings):
            yield

    def _seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 1_000_003 + step

    def _sampling(self, step: int) -> SamplingParams:
        r, cfg = self.cfg.actor_rollout_ref.rollout, self.cfg
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=cfg.data.max_response_length, seed=self._seed(step),
                              ignore_eos=r.ignore_eos)

    def _rollout(self, step: int, timings: dict[str, float]) -> Rollout:
        """The step's prompts and their responses, and the responses' text and scores as a future. The rule
        scorers run on a thread while the workers compute log-probs (as verl's launch_reward_fn_async), so a
        slow reward costs no time while the workers are busy. With algorithm.filter_groups (DAPO's dynamic
        sampling), which needs the scores to choose the rows, or a reward model, which runs on the workers,
        scoring happens here: a group whose responses all score the same is dropped (its advantages are all
        0) and more prompts are drawn, up to max_num_gen_batches rounds, until data.train_batch_size groups
        are kept."""
        if self.cfg.trainer.rollout_mode == "async":
            return self._async_rollout(step, timings)
        fg, params = self.cfg.algorithm.filter_groups, self._sampling(step)
        want = self.cfg.data.train_batch_size
        kept_items: list[dict] = []
        kept_batches: list[tuple[RolloutBatch, torch.Tensor]] = []
        kept_scores: list[tuple[ScoredBatch, list[int]]] = []
        kept_texts: list[str] = []
        rounds = fg.max_num_gen_batches if fg.enable else 1
        for round_ in range(rounds):
            items = [self.train_set[i] for i in self.sampler.next_batch()]
            # Each round draws new samples: its own seed, still a function of (seed, step) for resumes.
            round_params = dataclasses.replace(params, seed=params.seed + round_ * 1_000_000_007)
            with timer("gen", timings):
                batch, episodes = self._generate(items, round_params, timings)
            if not fg.enable and not self.cfg.reward_model.enable:
                return Rollout(items, batch, in_background(functools.partial(self._decode_and_score, items, batch,
                                                                             timings, episodes)),
                               _episode_metrics(episodes), episodes)
            self.stage("scoring", force=True)
            texts, scored = self._decode_and_score(items, batch, timings, episodes)
            if not fg.enable:
                return Rollout(items, batch, finished((texts, scored)), _episode_metrics(episodes), episodes)
            keep = groups_with_signal(torch.tensor(scored.scores), batch.prompt_index)
            groups = batch.prompt_index[keep].unique().tolist()[:want - len(kept_items)]
            chosen = torch.nonzero(torch.isin(batch.prompt_index, torch.tensor(groups, dtype=torch.long))).flatten()
            kept_items += [items[g] for g in groups]
            kept_batches.append((batch, chosen))
            kept_scores.append((scored, chosen.tolist()))
            kept_texts += [texts[i] for i in chosen.tolist()]
            if len(kept_items) >= want:
                break
        if not kept_items:
            raise RuntimeError(f"algorithm.filter_groups: every group of {rounds} generation round(s) scored the "
                               "same for all its responses, so no step can learn from them; raise "
                               "algorithm.filter_groups.max_num_gen_batches or rollout.n, or check the reward")
        return Rollout(kept_items, concat_rows(kept_batches, self.tokenizer.pad_token_id),
                       finished((kept_texts, concat_scored(kept_scores))),
                       {"batch/dynamic_sampling_rounds": round_ + 1, "batch/kept_groups": len(kept_items)})

    def _async_rollout(self, step: int, timings: dict[str, float]) -> Rollout:
        """trainer.rollout_mode=async: the step's batch from the rollout workers, sampled by weights at most
        trainer.max_staleness updates behind the actor's. With max_staleness=1 the next step's generation starts
        (on the weights of the update before this one) as soon as this batch is in, and runs while this step
        trains; the update's importance weights correct for the gap."""
        if self._pending is None:  # the first step, a resumed run's first, or every step at max_staleness=0
            self._launch(step, timings)
        pending, self._pending = self._pending, None
        with timer("gen", timings):
            batch = self.workers.collect(pending.generation, progress=self._generation_stage)
        if self.cfg.trainer.max_staleness and step < self.total_steps:
            self._launch(step + 1, timings)
        metrics = {"rollout/staleness": self._updates - batch.weights_version,
                   "rollout/weights_version": batch.weights_version}
        return Rollout(pending.items, batch, in_background(functools.partial(
            self._decode_and_score, pending.items, batch, timings, None)), metrics, None)

    def _launch(self, step: int, timings: dict[str, float] | None = None) -> None:
        """Start generating `step`'s batch on the rollout workers, after giving them the actor's weights if
        theirs are older."""
        self._push_weights(timings)
        before = self.sampler.state_dict()
        items = [self.train_set[i] for i in self.sampler.next_batch()]
        generation = self.workers.launch([it["prompt_ids"] for it in items], self._sampling(step))
        self._pending = PendingBatch(items, generation, before)

    def _push_weights(self, timings: dict[str, float] | None = None) -> None:
        """The actor's current weights to the rollout workers, unless they hold them already. A push waits for a
        generation the workers are running (they take calls in order)."""
        if self.cfg.trainer.rollout_mode != "async" or self._rollout_version == self._updates:
            return
        self.stage("broadcasting the weights to the rollout workers", force=True)
        with timer("weight_push", timings if timings is not None else {}):
            self.workers.push_weights(self._updates)
        self._rollout_version = self._updates

    def _generate(self, items: list[dict], params: SamplingParams, timings: dict[str, float] | None = None
                  ) -> tuple[RolloutBatch, list[Episode] | None]:
        """n responses per prompt: one generation, or with multi_turn.enable one episode each."""
        if not self.cfg.actor_rollout_ref.rollout.multi_turn.enable:
            return self.rollout.generate([it["prompt_ids"] for it in items], params,
                                         progress=self._generation_stage), None
        episodes = self._episodes([it for it in items for _ in range(params.n)], params, timings)
        group_ids = torch.arange(len(items)).repeat_interleave(params.n)
        return episode_batch(episodes, group_ids, self.tokenizer.pad_token_id,
                             with_log_probs=self.cfg.actor_rollout_ref.rollout.name == "vllm"), episodes

    def _episodes(self, rows: list[dict], params: SamplingParams, timings: dict[str, float] | None = None
                  ) -> list[Episode]:
        """One episode per row, each with its own environment, played on the ranks."""
        episodes, waited = self.rollout.episodes(rows, params, progress=lambda text: self.stage(text, force=True))
        if timings is not None:
            timings["timing_s/tools"] = timings.get("timing_s/tools", 0.0) + waited
        return episodes

    def _wait(self, scoring: concurrent.futures.Future) -> tuple[list[str], ScoredBatch]:
        if not scoring.done():
            self.stage("scoring", force=True)
        return scoring.result()

    def _rewards(self, scored: ScoredBatch, tensors: dict[str, torch.Tensor], response_mask: torch.Tensor,
                 prompts: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Each response's score with DAPO's overlong penalty when asked (B,), the (B, R) token-level rewards
        (that score on the last token, less the KL penalty when algorithm.use_kl_in_reward), and what shaped
        them."""
        cfg, metrics = self.cfg, {}
        scores = torch.tensor(scored.scores, dtype=torch.float32)  # (B,)
        ob = cfg.reward.overlong_buffer
        if ob.enable:
            penalty = overlong_penalty(response_mask.sum(-1), cfg.data.max_response_length, ob.len, ob.penalty_factor)
            scores = scores + penalty
            metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
            metrics["reward/overlong_penalty/frac"] = (penalty < 0).float().mean().item()
        rewards = _place_at_last_token(scores, response_mask)
        if cfg.algorithm.use_kl_in_reward:
            old = tensors.get("old_log_probs")
            if old is None:
                old, _ = self.workers.compute_log_prob(tensors)
            rewards, kl_metrics = apply_kl_penalty(rewards, old, tensors["ref_log_probs"], response_mask,
                                                   self.kl_ctrl.value, cfg.algorithm.kl_penalty)
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=prompts)
            metrics.update(kl_metrics)
        return scores, rewards, metrics

    def _step_dump(self, step: int) -> StepDump | None:
        """A dump of this step when trainer.dump_steps lists it or someone asked for the next one. A step of the
        critic's warm-up has no actor update to dump: a request waits for the first step that has."""
        asked = self.run.dump_request.exists()
        if step not in self.cfg.trainer.dump_steps and not asked:
            return None
        if self.has_critic and step <= self.cfg.trainer.critic_warmup:
            return None
        self.run.dump_request.unlink(missing_ok=True)
        return StepDump(self.run.root, step, self.cfg)

    def _update(self, step: int, tensors: dict[str, torch.Tensor], timings: dict[str, float],
                dump: StepDump | None = None) -> tuple[dict[str, float], MarkedRows | None]:
        """PPO's updates: the critic's when there is one, then the actor's, unless the critic is still warming
        up (its first trainer.critic_warmup steps fit the values and leave the policy). The actor's update
        also returns what the token view needs of its first rows. With `dump`, what the actor's update is
        about to consume (its weights and optimizer included) is saved first."""
        a, metrics = self.cfg.actor_rollout_ref.actor, {}
        shape = {"mini_rows": a.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n, "epochs": a.ppo_epochs,
                 "shuffle": a.shuffle}
        if self.has_critic:
            with self._phase("update_critic", "updating the critic", timings):
                metrics.update(self.workers.update_critic(tensors, **shape))
            metrics["critic/explained_variance"] = explained_variance(
                tensors["values"], tensors["returns"], tensors["response_mask"]).item()
            if step <= self.cfg.trainer.critic_warmup:
                return metrics, None
        if dump is not None:
            self.stage(f"saving step {step}'s update for replay", force=True)
            self.workers.save_checkpoint(dump.checkpoint)
            dump.save_update(tensors, world_size=self.workers.world_size, total_steps=self.total_steps, **shape)
        k = min(self.cfg.trainer.token_log_max, self.cfg.trainer.rollout_log_max, len(tensors["responses"]))
        marks = {"token_row": token_row_marks(len(tensors["responses"]), k)} if k else {}
        with timer("update_actor", timings):
            actor_metrics, marked = self.workers.update_actor(
                {**tensors, **marks}, **shape,
                progress=lambda done, total: self.stage(f"updating micro-batch {done}/{total} (rank 0)"))
        self._updates += 1
        self._check_finite(step, actor_metrics)
        return {**metrics, **actor_metrics}, marked

    def _write_tables(self, step: int, rollout: Rollout, texts: list[str], scored: ScoredBatch,
                      tensors: dict[str, torch.Tensor], marked: MarkedRows | None,
                      old_entropy: torch.Tensor | None) -> None:
        """Queue the step's rollout table and token view for the writer thread (off the step's path). The
        token view's "before" comes from the update's own forward when the update was one optimizer step,
        else from the old log-probs pass; its "after" from the update's last pass."""
        batch = rollout.batch
        if self.cfg.trainer.rollout_log_max:
            rows = [rollout.items[i] for i in batch.prompt_index.tolist()]
            self.tables.submit(step, lambda: self.run.write_rollouts(step, rollout_rows(
                step, rows, texts, scored, tensors["advantages"], batch, self.cfg.trainer.rollout_log_max,
                rollout.episodes)))
        if marked is not None:
            k = len(marked.rows)
            sample = {key: value[:k] for key, value in tensors.items()}
            sample["before_log_probs"] = marked.before if marked.before is not None else tensors["old_log_probs"][:k]
            sample["entropy"] = marked.entropy if marked.entropy is not None else old_entropy[:k]
            self.tables.submit(step, lambda: self.run.write_token_log(step, token_rows(
                sample, marked.after, self.tokenizer, self.clip_low, self.clip_high)))

    def _decode_and_score(self, items: list[dict], batch: RolloutBatch, timings: dict[str, float],
                          episodes: list[Episode] | None = None) -> tuple[list[str], ScoredBatch]:
        """The responses' text and scores; an episode is scored on its last assistant message."""
        with timer("reward", timings):
            texts = self._decode(batch) if episodes is None else [e.last_assistant_text() for e in episodes]
            return texts, self._score([items[i] for i in batch.prompt_index.tolist()], texts, episodes)

    def _greedy_baselines(self, items: list[dict], step: int, timings: dict[str, float]) -> torch.Tensor:
        """ReMax's baseline: the score of one greedy response per prompt, (prompts,)."""
        with self._phase("gen_baseline", "generating greedy baselines", timings):
            greedy = dataclasses.replace(self._sampling(step), n=1, greedy=True)
            batch, episodes = self._generate(items, greedy, timings)
            _, scored = self._decode_and_score(items, batch, timings, episodes)
            return torch.tensor(scored.scores, dtype=torch.float32)

    def _decode(self, batch: RolloutBatch) -> list[str]:
        return self.tokenizer.batch_decode(batch.responses * batch.response_mask, skip_special_tokens=True)

    def _score(self, rows: list[dict], texts: list[str], episodes: list[Episode] | None = None) -> ScoredBatch:
        """Each response's score: the rule scorer (data_source's, or custom_reward_function) times
        reward.rule_weight, plus each of reward.functions and the reward model times its weight, plus an
        episode's environment reward parts; an episode whose environment failed scores 0."""
        terms = reward_terms(self.cfg.reward, rows, texts, self.custom_fn, self.reward_fns)
        if self.cfg.reward_model.enable:
            values = self.workers.score_with_reward_model([row["messages"] for row in rows], texts)
            terms.append(("reward_model", self.cfg.reward_model.weight, from_scores(values)))
        if episodes is not None:
            terms.append(("environment", 1.0, from_scores([sum(e.reward.values()) for e in episodes])))
        scored = combine(terms)
        if episodes is not None:
            scored.scores = [0.0 if e.error else s for e, s in zip(episodes, scored.scores, strict=True)]
        return scored

    def _check_finite(self, step: int, actor_metrics: dict[str, float]) -> None:
        """Say when optimizer steps were dropped for a non-finite loss or gradient; stop if so configured."""
        skipped = int(actor_metrics.get("actor/skipped_steps", 0))
        if not skipped:
            return
        total = self.optimizer_steps
        message = (f"step {step}: {skipped} of {total} optimizer step(s) met a non-finite loss or gradient norm "
                   f"(grad_norm {actor_metrics.get('actor/grad_norm')})")
        if self.cfg.actor_rollout_ref.actor.nan_policy == "stop":
            raise NonFiniteError(f"{message}; actor_rollout_ref.actor.nan_policy=stop ends the run here. The last "
                                 "checkpoint is intact: lower the learning rate (or check the reward) and resume")
        warnings = (read_status(self.run.root) or {}).get("warnings") or []
        warnings = [*warnings, f"{message}: skipped (actor_rollout_ref.actor.nan_policy=skip)"][-20:]
        self.run.write_status("running", warnings=warnings)
        print(f"warning: {warnings[-1]}", flush=True)

    # ---- validation, checkpoints, export ----

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the configured validation rows (data.val_files, data.val_max_samples)."""
        self._push_weights()
        self.stage("validating", force=True)
        result = evaluate(self.rollout, self.tokenizer, self.val_items, self.cfg.data.max_response_length,
                          custom_fn=self.custom_fn, gsm8k_scorer=self.cfg.reward.gsm8k_scorer,
                          timeout_s=self.cfg.reward.timeout_s, batch_size=self.cfg.data.val_batch_size,
                          progress=lambda d, n: self.stage(f"validating {d}/{n}"),
                          episodes=self._episodes if self.cfg.actor_rollout_ref.rollout.multi_turn.enable else None)
        return result.metrics

    def evaluate(self, data_file: str | Path | None = None, *, limit: int = 0) -> dict[str, float]:
        """Greedy accuracy of the current weights: on the validation set, or on any parquet file."""
        self.setup()
        if data_file is None:
            return self.validate()
        self._push_weights()
        return self._generator().evaluate(
            data_file, limit=limit, max_new_tokens=self.cfg.data.max_response_length,
            max_prompt_length=self.cfg.data.max_prompt_length, batch_size=self.cfg.data.val_batch_size,
            custom_fn=self.custom_fn, gsm8k_scorer=self.cfg.reward.gsm8k_scorer,
            timeout_s=self.cfg.reward.timeout_s).metrics

    def generate(self, prompts: str | list[str], *, n: int = 1, temperature: float = 0.0,
                 max_new_tokens: int | None = None) -> list[list[str]]:
        """Answers of the current weights to user prompts (chat template applied; temperature 0 = greedy)."""
        self.setup()
        self._push_weights()
        prompts = [prompts] if isinstance(prompts, str) else prompts
        return self._generator().generate(prompts, n=n, temperature=temperature,
                                          max_new_tokens=max_new_tokens or self.cfg.data.max_response_length)

    def _generator(self) -> Generator:
        return Generator(self.workers, self.tokenizer)

    def save(self, step: int) -> Path:
        """A sharded checkpoint (backend.core.checkpoint has the layout): each rank writes its own files."""
        self.stage(f"saving checkpoint step_{step}", force=True)
        tmp = self.run.begin_checkpoint(step)
        try:
            self.workers.save_checkpoint(tmp)
            self.tokenizer.save_pretrained(tmp / checkpoint.HF)
            # The next step's batch, if its generation has started, is not in the checkpoint: resumed, the run
            # draws the same prompts again and generates them anew.
            sampler = self._pending.sampler_before if self._pending else self.sampler.state_dict()
            state = {"step": step, "sampler": sampler, "kl_coef": self.kl_ctrl.value,
                     "seed": self.cfg.trainer.seed, "world_size": self.workers.world_size}
            (tmp / "trainer_state.json").write_text(json.dumps(state))
        except BaseException:
            # A half-written checkpoint is never resumed from; removing it also gives back the space a
            # full disk needs to record the failure.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.run.commit_checkpoint(tmp, step, self.cfg.trainer.max_checkpoints_to_keep)

    def _load(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        self.workers.load_checkpoint(ckpt)
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = state["kl_coef"]
        self.start_step = self._step = state["step"]
        self.run.truncate_metrics(self.start_step)

    def export(self, folder: str | Path | None = None) -> Path:
        """The current weights as a plain Hugging Face folder (default: the run's export/)."""
        self.setup()
        folder = Path(folder) if folder else self.run.export
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.workers.export(tmp)
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    def close(self) -> None:
        """Stop the workers; a later call that needs them starts them again from the base model."""
        if self._ready:
            self.workers.shutdown()
            self._ready = False

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- helpers of the loop ----

@dataclasses.dataclass
class PendingBatch:
    """A step's batch being generated ahead of it (trainer.rollout_mode=async): its prompts, the generation, and
    the sampler's state before they were drawn (what a checkpoint saved meanwhile keeps)."""

    items: list[dict]
    generation: PendingGeneration
    sampler_before: dict


@dataclasses.dataclass
class Rollout:
    """A step's rollout: its prompts, their responses, and the responses' text and scores (a future while the
    scorers run); `metrics` says what dynamic sampling did."""

    items: list[dict]
    batch: RolloutBatch
    scoring: concurrent.futures.Future
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    episodes: list[Episode] | None = None  # with multi_turn.enable: each row's turns, tool calls and reward parts


def _episode_metrics(episodes: list[Episode] | None) -> dict:
    if episodes is None:
        return {}
    metrics: dict = episode_metrics(episodes)
    error = first_tool_error(episodes)
    if error:
        metrics["tool/first_error"] = error[:500]
    return metrics


def token_row_marks(rows: int, k: int) -> torch.Tensor:
    """(rows,) int64: i for the token view's i-th response (the first k), -1 for the others."""
    marks = torch.arange(rows)
    marks[k:] = -1
    return marks


def finished(value: T) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def in_background(fn: Callable[[], T]) -> concurrent.futures.Future:
    """fn() on a daemon thread, as a future: a hung reward function must not keep the process alive at its
    end (a pool's threads are joined at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the waiting caller
            future.set_exception(e)

    threading.Thread(target=run, name="scoring", daemon=True).start()
    return future


def _place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, R) token-level scores, the score on each response's last token the policy
    sampled (an episode's response may end with an observation, and hold observations inside)."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    positions = torch.arange(response_mask.shape[1]).expand_as(response_mask)
    last = torch.where(response_mask.bool(), positions, -1).max(-1).values.clamp(min=0)
    out[torch.arange(len(scores)), last] = scores * (response_mask.sum(-1) > 0)
    return out


# The stop signal this process received, if any: from then on whatever ends the run, ends it as `stopped`.
_stop_signal: int | None = None
# Whether that signal's RunStopped is yet to be raised where it propagates (see _install_stop_handlers), whether
# the main thread is inside the unraisable hook (where a raise would be lost), and the thread that signals again.
_stop_pending = False
_in_unraisable_hook = False
_resender: threading.Thread | None = None
RESEND_STOP_S = 0.05


def _install_stop_handlers() -> Callable[[], None]:
    """SIGTERM (the UI's stop button) ends the run cleanly as `stopped`; returns an undo function.

    The first signal raises RunStopped wherever the main thread is; later ones are ignored, so a second
    stop cannot cut short the writing of the first one's final status. Where an exception cannot propagate
    (a __del__, a weakref callback, the at-fork hooks of `logging` that run as Ray starts its processes),
    Python hands it to sys.unraisablehook, which prints "Exception ignored in" and goes on: the run went on
    untouched until the launcher killed it. A RunStopped lost that way is not printed; a thread signals the
    main thread again until one is raised where it propagates."""
    global _stop_signal, _stop_pending
    _stop_signal, _stop_pending = None, False

    def handler(signum, frame):
        global _stop_signal, _stop_pending
        if _stop_signal is None:
            _stop_signal, _stop_pending = signum, True
        elif not _stop_pending:
            return
        if _in_unraisable_hook:  # raised here, it would be lost without a word
            _resend_stop()
            return
        _stop_pending = False
        raise RunStopped(f"received signal {signum}")

    def unraisable(args) -> None:
        global _stop_pending, _in_unraisable_hook
        if threading.current_thread() is not threading.main_thread():
            hook(args)
            return
        _in_unraisable_hook = True
        try:
            if isinstance(args.exc_value, RunStopped):
                _stop_pending = True
                _resend_stop()
            else:
                hook(args)
        finally:
            _in_unraisable_hook = False

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. a UI test harness): nothing to install
        return lambda: None
    hook, sys.unraisablehook = sys.unraisablehook, unraisable

    def undo() -> None:
        global _stop_pending
        _stop_pending = False
        if _resender is not None:  # its next signal must not meet the default handler, which kills
            _resender.join()
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = hook
    return undo


def _resend_stop() -> None:
    """Signal the main thread every RESEND_STOP_S while a stop is pending. From a thread: a signal the main
    thread sends itself runs its handler at once, still inside the hook. A real signal, aimed at the main
    thread, so that one blocked in a system call (a sleep, a wait on Ray) wakes to it."""
    global _resender

    def resend() -> None:
        while _stop_pending:
            time.sleep(RESEND_STOP_S)
            if _stop_pending:
                signal.pthread_kill(threading.main_thread().ident, _stop_signal)

    if _resender is None or not _resender.is_alive():
        _resender = threading.Thread(target=resend, name="resend-stop", daemon=True)
        _resender.start()


def _stopped(e: BaseException) -> bool:
    """Whether the run ends because it was asked to stop. Once a stop signal has arrived, any exception
    counts: the RunStopped its handler raised may come back as something else (Ray's C extension reports
    it as a SystemError caused by it; a call into Ray cut short may fail on its own). Without one, a
    stop is RunStopped or Ctrl-C, also found as the cause of another exception."""
    if _stop_signal is not None:
        return True
    while e is not None:
        if isinstance(e, RunStopped | KeyboardInterrupt):
            return True
        e = e.__cause__
    return False


def _alive(pid: int | None) -> bool:
    if not pid or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def yield_cpu(nice: int) -> None:
    """Lower this run's CPU priority to `nice`: every process of its process group (the trainer, its Ray
    and its workers; ones started later inherit it) and, under Linux's autogroup scheduling, its session's
    group, which is what the kernel weighs against other sessions (such as the workbench's) whatever the
    nice of their processes. A run started in the background leads its own session, so this changes
    nothing else."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, 0, nice)
    for _ in range(40):
        try:
            Path("/proc/self/autogroup").write_text(str(nice))
            return
        except BlockingIOError:  # the kernel takes one autogroup change per 100 ms from an unprivileged user
            time.sleep(0.05)
        except OSError:  # no autogroup scheduling on this kernel
            return


def _record_stall(run: RunDir, stall: Stall) -> None:
    """A call to the workers that runs far too long: every process's Python stacks into diagnosis/, what each
    rank is doing into status.json (the Runs page's Diagnosis panel) and the log."""
    status = read_status(run.root) or {}
    if stall.done:
        if status.get("diagnosis"):
            run.write_status("running", diagnosis={**status["diagnosis"], "done_after_s": round(stall.seconds)})
        return
    step = status.get("step", 0)  # the step being taken (0: before the first)
    run.diagnosis.mkdir(exist_ok=True)
    path = run.diagnosis / f"hang_step_{step}.txt"
    atomic_write_text(path, f"{stall.summary()}\n\n{stall.stacks}")
    run.write_status("running", diagnosis={
        "kind": "hang", "call": stall.what, "step": step, "seconds": round(stall.seconds), "ranks": stall.ranks,
        "final": stall.final, "file": str(path.relative_to(run.root)), "at": time.time()})
    print(f"warning: {stall.summary()} (every process's stacks: {path})", flush=True)


def _record_head_lost(run: RunDir, message: str) -> None:
    """Called from the head-watch thread: the status says failed, with why, even if Ray ends the process
    (it does 60 s after losing its head) before the main thread gets to `Trainer._record_failure`. A run
    already ended (stopped: its Ray is ended with it) keeps its state."""
    if (read_status(run.root) or {}).get("state", "running") != "running":
        return
    try:
        run.write_status("failed", stage="failed", finished=time.time(), error=f"{WorkerError.__name__}: {message}")
    except OSError as write_error:
        print(f"could not record the lost Ray head in {run.status}: {write_error}\n{message}", flush=True)
