"""Checks that need files, not just the config: run before a run starts, in the CLI and the UI alike."""

from __future__ import annotations

from pathlib import Path

from backend.core import checkpoint, data
from backend.core.config import Config, ConfigError, uses_critic
from backend.core.models import ModelError, load_tokenizer, model_config, resolve_model
from backend.envs.environment import load_environment
from backend.envs.tools import ToolError, resolve_tools
from backend.rewards.registry import RewardError, get_scorer, load_custom_reward
from backend.rollout import static_cache
from backend.rollout.episodes import ChatRenderer, end_of_turn_ids


def preflight(cfg: Config) -> list[str]:
    """Problems that would stop the run once started: missing or malformed data files, a model that
    cannot be found, lengths past the model's context, a custom reward that cannot be loaded, data
    sources without a scorer. Empty when the run can start."""
    problems: list[str] = []
    sources: set[str] = set()
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for f in files:
            if not Path(f).is_file():
                problems.append(f"{key}: {f} does not exist")
                continue
            try:
                sources.update(r["data_source"] for r in data.load_rows(f))
            except data.DataError as e:
                problems.append(f"{key}: {e}")
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    tools: list = []
    if mt.enable:
        try:
            tools = resolve_tools(mt.tools, mt.tool_config_path)
            load_environment(mt.environment)
        except ToolError as e:
            problems.append(str(e))
    model = cfg.actor_rollout_ref.model.path
    try:
        resolved = resolve_model(model)
        config = model_config(model) if Path(resolved).exists() else None
        limit = getattr(config, "max_position_embeddings", None)
        total = cfg.data.max_prompt_length + cfg.data.max_response_length
        what = "data.max_prompt_length + data.max_response_length"
        if tools and limit is not None:
            # An episode's first prompt also offers the tools: the engines' context holds those tokens too.
            tokenizer = load_tokenizer(model, cfg.actor_rollout_ref.model.tokenizer_path)
            offered = ChatRenderer(tokenizer, tools, end_of_turn_ids(tokenizer, model)).tools_tokens
            total += offered
            what = f"data.max_prompt_length + the tools' {offered} prompt tokens + data.max_response_length"
        if limit is not None and total > limit:
            problems.append(f"{what} = {total} is longer than the model's context ({limit} positions for {model}): "
                            "lower data.max_prompt_length or data.max_response_length")
        reason = static_cache.unsupported_reason(config) if config is not None else None
        if cfg.actor_rollout_ref.rollout.name == "workbench" and reason:
            problems.append(f"actor_rollout_ref.rollout.name=workbench cannot run {model}: {reason}; "
                            "use rollout.name=hf (or auto, which picks hf for it)")
    except (ModelError, OSError) as e:
        problems.append(f"actor_rollout_ref.model.path: {e}")
    if uses_critic(cfg) and cfg.critic.model.path:
        try:
            model_config(cfg.critic.model.path)
        except (ModelError, OSError) as e:
            problems.append(f"critic.model.path: {e}")
    t = cfg.trainer
    if t.resume_mode == "resume_path" and t.resume_from_path and \
            not (Path(t.resume_from_path) / "trainer_state.json").is_file():
        problems.append(f"trainer.resume_from_path={t.resume_from_path} is not a checkpoint folder "
                        "(no trainer_state.json); checkpoints are runs/<id>/checkpoints/step_N")
    elif t.resume_mode == "resume_path" and t.resume_from_path:
        problems.extend(resume_problems(cfg, Path(t.resume_from_path)))
    for target in cfg.reward.functions:
        try:
            load_custom_reward(target, "")
        except RewardError as e:
            problems.append(f"reward.functions: {target}: {e}")
    if cfg.reward_model.enable and cfg.reward_model.model.path:
        try:
            model_config(cfg.reward_model.model.path)
        except (ModelError, OSError) as e:
            problems.append(f"reward_model.model.path: {e}")
    crf = cfg.custom_reward_function
    if crf.path and cfg.reward.rule_weight:
        try:
            load_custom_reward(crf.path, crf.name)
        except RewardError as e:
            problems.append(f"custom_reward_function: {e}")
    elif cfg.reward.rule_weight:
        for source in sorted(sources):
            try:
                get_scorer(source)
            except RewardError as e:
                problems.append(str(e))
    return problems


def resume_problems(cfg: Config, ckpt: Path) -> list[str]:
    """A sharded checkpoint resumes only on as many workers as wrote it."""
    written_by = checkpoint.world_size_of(ckpt)
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if written_by is None or written_by == world:
        return []
    return [f"checkpoint {ckpt} was written by {written_by} worker(s) and this run has {world} "
            f"(trainer.n_gpus_per_node x trainer.nnodes): resume with {written_by}, or merge it "
            f"(python -m backend merge {ckpt} --output DIR) and start a new run from DIR"]


def check_or_raise(cfg: Config) -> None:
    problems = preflight(cfg)
    if problems:
        raise ConfigError(problems)
