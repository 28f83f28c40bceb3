"""A step's actor update, saved by the run and replayed in one plain process: no Ray, no other ranks, so
`pdb` and breakpoints work in our code and in a reward function.

    runs/<run_id>/dumps/step_N/
      config.yaml        the run's config
      checkpoint/        the actor (weights, optimizer, learning-rate schedule) as the update found it
      batch.pt           every tensor the update consumed: ids, masks, advantages, returns, old / reference /
                         rollout log-probs (those the run computed)
      update.json        how the update was cut: rows per mini-batch, epochs, shuffle, ranks, total steps
      rng.pt             the controller's torch RNG state as the update began (its mini-batch shuffle)
      rewards.pkl        the rows' data_source, ground_truth and extra_info, the responses' text, their scores
      logged.json        the actor/* metrics the run logged for the step

A run writes a dump for each step in trainer.dump_steps, and for the next step after someone asks for one
(`dump_next` in the run directory: the Runs page's button). The folder appears whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.core.config import Config, load_config, to_dict, to_yaml

CHECKPOINT = "checkpoint"


class ReplayError(ValueError):
    """A folder that is not a whole step dump, or one this process cannot replay; the message says which."""


class StepDump:
    """The dump of step `step` of the run at `run_root`, written into a temporary folder until `commit`."""

    def __init__(self, run_root: Path, step: int, cfg: Config):
        self.step = step
        self.final = run_root / "dumps" / f"step_{step}"
        self.tmp = run_root / "dumps" / f".tmp_step_{step}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.checkpoint = self.tmp / CHECKPOINT
        (self.tmp / "config.yaml").write_text(to_yaml(cfg))

    def save_rewards(self, rows: list[dict], texts: list[str], scores: list[float]) -> None:
        plain = [{k: row[k] for k in ("data_source", "ground_truth", "extra_info")} for row in rows]
        with open(self.tmp / "rewards.pkl", "wb") as f:
            pickle.dump({"rows": plain, "texts": texts, "scores": scores}, f)

    def save_update(self, tensors: dict[str, torch.Tensor], mini_rows: int, epochs: int, shuffle: bool,
                    world_size: int, total_steps: int) -> None:
        """Called just before the update: the RNG state is the one its shuffle draws from."""
        torch.save(torch.get_rng_state(), self.tmp / "rng.pt")
        torch.save({k: v.cpu() for k, v in tensors.items()}, self.tmp / "batch.pt")
        (self.tmp / "update.json").write_text(json.dumps({
            "mini_rows": mini_rows, "epochs": epochs, "shuffle": shuffle, "world_size": world_size,
            "total_steps": total_steps}))

    def commit(self, metrics: dict[str, float]) -> Path:
        logged = {k: v for k, v in metrics.items() if k.startswith("actor/")}
        (self.tmp / "logged.json").write_text(json.dumps({"step": self.step, **logged}, indent=1))
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.tmp, self.final)
        return self.final


@dataclass
class Replayed:
    step: int
    device: str
    logged: dict[str, float]  # actor/* as the run logged them
    replayed: dict[str, float]  # the same keys, from this process's update
    scores: tuple[int, int] | None  # (rows whose score came out the same, rows); None: not re-scored
    not_rescored: str = ""  # why not
    deterministic: bool = False  # replayed with deterministic algorithms only, as the run's trainer.deterministic

    def rows(self, rtol: float = 1e-4, atol: float = 1e-6) -> list[tuple[str, float, float, bool]]:
        """(metric, logged, replayed, equal within tolerance) for each metric both have."""
        out = []
        for key in sorted(self.logged):
            if key in self.replayed and isinstance(self.logged[key], int | float):
                a, b = float(self.logged[key]), float(self.replayed[key])
                out.append((key, a, b, math.isclose(a, b, rel_tol=rtol, abs_tol=atol)))
        return out

    def equal(self) -> bool:
        same_scores = self.scores is None or self.scores[0] == self.scores[1]
        return same_scores and all(ok for *_, ok in self.rows())


def replay(folder: str | Path, device: str = "auto", *, in_this_thread: bool = False) -> Replayed:
    """Run a dumped step's reward scoring (rule scorer and reward functions) and its actor update again, in
    this process on one rank, from the dumped weights and inputs. `in_this_thread` scores without threads,
    so a debugger's breakpoints in a reward function stop there."""
    from backend.engine.distributed import local_meeting_point
    from backend.engine.rank import use_deterministic_algorithms
    from backend.engine.worker_group import update_shards
    from backend.engine.workers import ActorRolloutRefWorker

    folder = Path(folder)
    missing = [name for name in ("config.yaml", "batch.pt", "update.json", "rng.pt", "rewards.pkl", "logged.json")
               if not (folder / name).is_file()]
    if missing or not (folder / CHECKPOINT).is_dir():
        raise ReplayError(f"{folder} is not a whole step dump (missing {', '.join(missing) or CHECKPOINT + '/'}): "
                          "a run writes runs/<id>/dumps/step_N for each step in trainer.dump_steps")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ReplayError("--device cuda: this machine has no GPU torch can use; replay with --device cpu")
    cfg = load_config(folder / "config.yaml", [f"trainer.device={device}", "trainer.n_gpus_per_node=1",
                                               "trainer.nnodes=1"])
    logged = json.loads((folder / "logged.json").read_text())
    plan = json.loads((folder / "update.json").read_text())

    if cfg.trainer.deterministic:
        # As the run's ranks did: on a GPU, other algorithms would add up in another order than the run did.
        use_deterministic_algorithms()
    scores, why = _rescore(cfg, folder, in_this_thread)
    worker = ActorRolloutRefWorker(to_dict(cfg), 0, 1, *local_meeting_point(), device, plan["total_steps"])
    try:
        worker.load_checkpoint(str(folder / CHECKPOINT))
        batch = torch.load(folder / "batch.pt", weights_only=True)
        torch.set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
        ((rows, mini_rows, counts),) = update_shards(batch, plan["mini_rows"], plan["epochs"], plan["shuffle"], 1)
        replayed, _ = worker.update_actor(rows, mini_rows, counts)
    finally:
        worker.shutdown()
    step = int(logged.pop("step"))
    return Replayed(step, device, logged, replayed, scores, why, torch.are_deterministic_algorithms_enabled())


def _rescore(cfg: Config, folder: Path, in_this_thread: bool) -> tuple[tuple[int, int] | None, str]:
    from backend.rewards.registry import load_custom_reward
    from backend.rewards.scoring import combine, reward_terms

    if cfg.reward_model.enable:
        return None, "a reward model scores on the workers"
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return None, "an episode's environment reward needs its environment"
    with open(folder / "rewards.pkl", "rb") as f:
        saved = pickle.load(f)  # noqa: S301 - the run's own dump
    custom = cfg.custom_reward_function
    custom_fn = load_custom_reward(custom.path, custom.name) if custom.path else None
    functions = [(target.rpartition(":")[2], load_custom_reward(target, "")) for target in cfg.reward.functions]
    scored = combine(reward_terms(cfg.reward, saved["rows"], saved["texts"], custom_fn, functions, in_this_thread))
    same = sum(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(scored.scores, saved["scores"],
                                                                                strict=True))
    return (same, len(saved["scores"])), ""
