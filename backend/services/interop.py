"""Moving between this workbench and the tools people already use.

    from_verl_script(text)      a verl launch script (`python3 -m verl.trainer.main_ppo key=value ...`, or
                                its one-step-off recipe's) -> our config dict, plus a message for every key
                                that does not carry over
    to_verl_command(cfg)        our config -> the verl command line that trains the same thing
    read_trl_output(folder)     a TRL GRPOTrainer output_dir -> metrics (verl names) and rollouts
    read_verl_dump(folder)      verl's rollout dump (trainer.rollout_data_dir: <step>.jsonl) -> rollouts
    import_external_run(...)    either of those as a regular run directory, so the Runs and Rollouts
                                pages show it as they show our own runs

Rollouts come out in the rollouts/step_N.parquet schema (see trainer.rollout_rows); what the other tool
does not record is filled in plainly: finish_reason "unknown", ground_truth "" or advantage NaN.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from backend.core import config as C
from backend.core.runs import RunDir
from backend.core.trackers import TRACKERS
from backend.core.workspace import check_name


class InteropError(ValueError):
    """A script or folder that cannot be read as what it was meant to be; the message says why."""


# ---- verl launch scripts ----

# Keys of our schema that verl does not have (or that mean something else there): never put on a verl
# command line. Everything else in config.field_specs is spelled the way verl spells it.
OWN_KEYS = frozenset({
    "data.val_max_samples",                          # verl validates on the whole val set
    "actor_rollout_ref.rollout.generation_batch_size",  # our HF generation chunking
    "actor_rollout_ref.model.tokenizer_path",        # verl: data.tokenizer (see RENAMED)
    "trainer.max_checkpoints_to_keep",               # verl: trainer.max_actor_ckpt_to_keep (see RENAMED)
    "reward.timeout_s",
    "reward.gsm8k_scorer",                            # verl scores GSM8K one way (ours: reward.gsm8k_scorer=verl)
    "trainer.export_at_end",
    "trainer.stall_warning_s",
    "trainer.hang_timeout_s",
    "trainer.dump_steps",
    "trainer.token_log_max",
    "actor_rollout_ref.actor.activation_memory_budget",  # a torch.compile setting verl does not expose
    "trainer.rollout_log_max",
    "trainer.runs_root",
    "trainer.device",
    "trainer.seed",
    "trainer.deterministic",
    # verl overlaps generation and training in recipes of their own, each with its own entry point and keys
    # (ONE_STEP_OFF below): main_ppo takes none of these.
    "trainer.rollout_mode",
    "trainer.max_staleness",
    "actor_rollout_ref.rollout.n_gpus_per_node",
})

# verl's trainer, and its one-step-off recipe: rollout on GPUs of its own, the next batch generated while this
# one trains, which is our trainer.rollout_mode=async at trainer.max_staleness=1.
MAIN_PPO = "verl.trainer.main_ppo"
ONE_STEP_OFF = "recipe.one_step_off_policy.main_ppo"
# The recipe's keys for its rollout GPUs -> ours; and what its command always holds for one of our async runs:
# no hybrid engine (what async means here), and the rollout workers on one node (as ours run).
ONE_STEP_OFF_KEYS = {"rollout.n_gpus_per_node": "actor_rollout_ref.rollout.n_gpus_per_node"}
ONE_STEP_OFF_FIXED = {"actor_rollout_ref.hybrid_engine": False, "rollout.nnodes": 1}

# verl key -> our key, for settings both have under different names.
RENAMED = {
    "data.tokenizer": "actor_rollout_ref.model.tokenizer_path",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints_to_keep",
}

# Always written by to_verl_command, default or not: what a reader of the command needs to see, and the
# micro-batch sizes verl refuses to start without.
ESSENTIAL = (
    "algorithm.adv_estimator",
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "trainer.logger",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
)

# verl writes "off" as -1 or null where we write 0.
_OFF_AS_ZERO = ("actor_rollout_ref.rollout.top_k", "trainer.save_freq", "trainer.test_freq",
                "trainer.total_training_steps", "trainer.max_checkpoints_to_keep",
                "actor_rollout_ref.actor.optim.lr_warmup_steps")
# verl rollout engines that from_verl_script maps to our fast engine (rollout.name=auto).
_FAST_ENGINES = ("vllm", "sglang")
_ASSIGN = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)
_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::?-([^}]*))?\}|([A-Za-z_]\w*))")
_SHELL_OPS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>&1", "1>&2"}


def _logical_lines(text: str) -> list[str]:
    """The script's commands: continuation lines joined, blank lines dropped."""
    return [line for line in re.sub(r"\\\r?\n", " ", text).splitlines() if line.strip()]


def _expand(text: str, env: dict[str, str], unknown: set[str]) -> str:
    """$VAR, ${VAR} and ${VAR:-default} from the script's own assignments (and $HOME); others as written."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if name == "HOME" and "HOME" in os.environ:
            return os.environ["HOME"]
        if m.group(2) is not None:
            return m.group(2)
        unknown.add(name)
        return m.group(0)
    return _VAR.sub(sub, text)


def _split(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def _verl_tokens(text: str) -> tuple[list[str], set[str], str]:
    """The arguments after `verl.trainer.main_ppo` (or the one-step-off recipe's entry point), with the
    script's variables expanded, and which of the two it is."""
    env: dict[str, str] = {}
    unknown: set[str] = set()
    for line in _logical_lines(text):
        try:
            tokens = _split(_expand(line, env, unknown))
        except ValueError as e:  # an unclosed quote
            raise InteropError(f"cannot read the line {line.strip()[:80]!r}: {e}") from None
        if tokens[:1] == ["export"]:
            tokens = tokens[1:]
        if tokens and all(_ASSIGN.match(t) for t in tokens):
            for t in tokens:
                name, value = _ASSIGN.match(t).groups()
                env[name] = value
            continue
        starts = [i for i, t in enumerate(tokens) if t in (MAIN_PPO, ONE_STEP_OFF) or t.endswith("main_ppo.py")]
        if starts:
            args = []
            for t in tokens[starts[0] + 1:]:
                if t in _SHELL_OPS:
                    break
                args.append(t)
            entry = tokens[starts[0]]
            return args, unknown, ONE_STEP_OFF if "one_step_off_policy" in entry else MAIN_PPO
    raise InteropError(f"no `python3 -m {MAIN_PPO}` (or `python3 -m {ONE_STEP_OFF}`) command found in the script")


def _read_value(raw: str) -> Any:
    """A Hydra override's value, read as YAML: `8`, `1e-6`, `True`, `['a','b']`, `null`."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def from_verl_script(text: str) -> tuple[dict, list[str]]:
    """(our config as a nested dict, messages). The dict holds every `key=value` of the verl command
    that our schema has (under verl's name or a RENAMED one), with verl's "off" values (-1, null) as our
    0; each message names an override that did not carry over and why. The one-step-off recipe's command
    is our trainer.rollout_mode=async at trainer.max_staleness=1. Raises InteropError when the text holds
    no verl command."""
    args, unknown_vars, entry = _verl_tokens(text)
    one_step_off = entry == ONE_STEP_OFF
    specs = C.field_specs()
    flat: dict[str, Any] = {"trainer.rollout_mode": "async", "trainer.max_staleness": 1} if one_step_off else {}
    notes: list[str] = []
    for arg in args:
        if arg in ("$@", "$*"):
            continue
        if arg.startswith("-") or "=" not in arg:
            notes.append(f"{arg}: not supported here (only key=value overrides are read)")
            continue
        raw_key, raw = arg.split("=", 1)
        key = RENAMED.get(raw_key.lstrip("+"), raw_key.lstrip("+"))
        if one_step_off:
            if key in ONE_STEP_OFF_FIXED and _read_value(raw) == ONE_STEP_OFF_FIXED[key]:
                continue
            key = ONE_STEP_OFF_KEYS.get(key, key)
        if raw_key.startswith("~") or key not in specs:
            notes.append(f"{arg}: not supported here")
            continue
        value = _read_value(raw)
        tp, meta = specs[key]
        if key in _OFF_AS_ZERO and (value is None or value == -1):
            value = 0
        if key == "actor_rollout_ref.rollout.name" and value in _FAST_ENGINES:
            value = "auto"  # verl's fast engines; here the workbench engine plays their part
        elif key == "actor_rollout_ref.rollout.name" and value != "hf":
            notes.append(f"{arg}: needs the {value} engine, which is not built here; generation uses auto")
            continue
        if key == "trainer.logger":
            value = value if isinstance(value, list) else [value]
            dropped = [v for v in value if v not in TRACKERS]
            if dropped:
                notes.append(f"{arg}: {', '.join(map(str, dropped))} not available here; "
                             f"choose from {', '.join(TRACKERS)}")
            # metrics.jsonl is what the dashboard reads, so it is always on
            value = [v for v in value if v in TRACKERS and v != "jsonl"] + ["jsonl"]
        try:
            value = C._coerce(value, tp)
        except TypeError:
            notes.append(f"{arg}: must be {C._type_name(tp)}; not carried over")
            continue
        if meta["choices"] and value not in meta["choices"]:
            notes.append(f"{arg}: not supported here (choose one of: {', '.join(meta['choices'])})")
            continue
        flat[key] = value
    for name in sorted(unknown_vars):
        notes.append(f"${name} is not set in the script; left as written")
    return C._nest(flat), notes


def _verl_value(key: str, value: Any) -> Any:
    if key == "actor_rollout_ref.rollout.name" and value in ("auto", "workbench"):
        return "vllm"  # verl has no workbench engine; vLLM is its fast one
    if key in _OFF_AS_ZERO and value == 0:
        return None if key in ("trainer.total_training_steps", "trainer.max_checkpoints_to_keep") else -1
    if key == "trainer.logger":
        return [v for v in value if v != "jsonl"]
    return value


def to_verl_command(cfg: C.Config) -> str:
    """`python3 -m verl.trainer.main_ppo \\` and one `key=value \\` line per setting: every field that
    differs from our defaults plus the ESSENTIAL ones, under verl's names, leaving out OWN_KEYS. A config
    that generates one step off the policy on workers of its own (trainer.rollout_mode=async,
    trainer.max_staleness=1) becomes verl's one-step-off recipe with as many rollout GPUs; at staleness 0 it
    trains as main_ppo does. from_verl_script reads it back to the same values."""
    defaults = C.Config()
    verl_name = {ours: theirs for theirs, ours in RENAMED.items()}
    entry, lines = MAIN_PPO, []
    if cfg.trainer.rollout_mode == "async" and cfg.trainer.max_staleness == 1:
        entry = ONE_STEP_OFF
        gpus = {theirs: C.get_value(cfg, ours) for theirs, ours in ONE_STEP_OFF_KEYS.items()}
        lines = [f"{k}={v}" for k, v in {**ONE_STEP_OFF_FIXED, **gpus}.items()]
    for key in C.field_specs():
        value = C.get_value(cfg, key)
        if key in OWN_KEYS and key not in verl_name:
            continue
        if key not in ESSENTIAL and value == C.get_value(defaults, key):
            continue
        lines.append(shlex.quote(f"{verl_name.get(key, key)}={C.yaml_value(_verl_value(key, value))}"))
    return " \\\n    ".join([f"python3 -m {entry}", *lines])


# ---- other tools' runs ----

# TRL GRPOTrainer's log_history names -> the verl names our charts read. Others keep their own name.
TRL_METRICS = {
    "reward": "critic/score/mean",
    "reward_std": "critic/score/std",
    "kl": "actor/kl_loss",
    "loss": "actor/pg_loss",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
    "entropy": "actor/entropy",
    "completions/mean_length": "response_length/mean",
    "completions/max_length": "response_length/max",
    "completions/min_length": "response_length/min",
    "completions/clipped_ratio": "response_length/clip_ratio",
    "completion_length": "response_length/mean",  # older TRL
    "clip_ratio/region_mean": "actor/pg_clipfrac",
    "clip_ratio/low_mean": "actor/pg_clipfrac_lower",
}
_TRL_PLAIN_COLUMNS = {"step", "prompt", "completion", "advantage", "reward"}


def _prompt_text(prompt: Any) -> str:
    """A TRL prompt: plain text, or a conversation (list of {"role", "content"}) shown one turn a line."""
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def _prompt_index(prompt: str) -> int:
    """A stable id for a prompt (the other tools' files do not carry the dataset row)."""
    return int(hashlib.sha1(prompt.encode()).hexdigest()[:12], 16)


def _float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _rollout_row(step: int, group: int, source: str, prompt: str, response: str, reward: float,
                 advantage: float, ground_truth: str = "", parts: dict[str, float] | None = None) -> dict:
    row = {"step": step, "group": group, "data_source": source, "index": _prompt_index(prompt),
           "prompt": prompt, "response": response, "ground_truth": ground_truth, "pred": None,
           "reward": reward, "advantage": advantage, "response_length": len(response.split()),
           "finish_reason": "unknown"}
    row.update({f"reward_{k}": v for k, v in (parts or {}).items()})
    return row


def _groups(prompts: list[str]) -> list[int]:
    """Group number of each response: responses to the same prompt share one, numbered in order."""
    seen: dict[str, int] = {}
    return [seen.setdefault(p, len(seen)) for p in prompts]


def _trl_state(folder: Path) -> dict | None:
    path = folder / "trainer_state.json"
    if not path.is_file():
        ckpts = sorted(folder.glob("checkpoint-*/trainer_state.json"),
                       key=lambda p: int(p.parent.name.split("-")[-1]) if p.parent.name.split("-")[-1].isdigit()
                       else -1)
        path = ckpts[-1] if ckpts else None
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InteropError(f"{path} is not valid JSON: {e}") from None


def read_trl_output(folder: str | Path) -> dict:
    """A TRL GRPOTrainer output_dir: {"metrics": one dict per logged step (TRL names mapped by
    TRL_METRICS), "rollouts": {step: rows}} from trainer_state.json (or the newest checkpoint-N's) and
    completions/completions_*.parquet (written with log_completions=True)."""
    folder = Path(folder)
    state = _trl_state(folder)
    by_step: dict[int, dict] = {}
    for entry in (state or {}).get("log_history", []):
        if "step" not in entry:
            continue
        step = int(entry["step"])
        m = by_step.setdefault(step, {"step": step})
        for k, v in entry.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                m[TRL_METRICS.get(k, k)] = v
    rollouts: dict[int, list[dict]] = {}
    for path in sorted((folder / "completions").glob("completions_*.parquet")):
        table = pq.read_table(path).to_pylist()
        for r in table:
            step = int(r.get("step") or re.sub(r"\D", "", path.stem) or 0)
            rollouts.setdefault(step, []).append(r)
    out_rollouts = {}
    for step, raw in sorted(rollouts.items()):
        prompts = [_prompt_text(r.get("prompt")) for r in raw]
        rows = []
        for r, prompt, group in zip(raw, prompts, _groups(prompts), strict=True):
            parts = {k: _float(v) for k, v in r.items() if k not in _TRL_PLAIN_COLUMNS}
            reward = _float(r["reward"]) if "reward" in r else math.fsum(v for v in parts.values() if v == v)
            rows.append(_rollout_row(step, group, "trl", prompt, _prompt_text(r.get("completion")), reward,
                                     _float(r.get("advantage")), parts=parts))
        out_rollouts[step] = rows
    if state is None and not out_rollouts:
        raise InteropError(f"{folder} holds no trainer_state.json and no completions/*.parquet: not a TRL "
                           "output folder")
    return {"metrics": sorted(by_step.values(), key=lambda m: m["step"]), "rollouts": out_rollouts}


def _verl_files(folder: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.stem), p) for p in folder.glob("*.jsonl") if p.stem.isdigit())


def read_verl_dump(folder: str | Path) -> dict:
    """verl's rollout dump (trainer.rollout_data_dir: one <step>.jsonl per step, lines with input,
    output, score, gts, step and the reward function's extra fields): {"metrics": score statistics per
    step, "rollouts": {step: rows}}. Numeric extra fields become reward_<name> columns."""
    folder = Path(folder)
    files = _verl_files(folder)
    if not files:
        raise InteropError(f"{folder} holds no <step>.jsonl files: not a verl rollout dump")
    rollouts: dict[int, list[dict]] = {}
    metrics = []
    for step, path in files:
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a blank line, or the torn last line of a dump cut short
        prompts = [str(r.get("input", "")) for r in records]
        rows = []
        for r, prompt, group in zip(records, prompts, _groups(prompts), strict=True):
            reward = _float(r.get("score", r.get("reward")))
            parts = {k: _float(v) for k, v in r.items()
                     if k not in ("input", "output", "gts", "score", "reward", "step")
                     and isinstance(v, (int, float)) and not isinstance(v, bool)}
            gts = r.get("gts", "")
            rows.append(_rollout_row(step, group, "verl", prompt, str(r.get("output", "")), reward, math.nan,
                                     ground_truth="" if gts is None else str(gts), parts=parts))
        rollouts[step] = rows
        scores = [row["reward"] for row in rows if row["reward"] == row["reward"]]
        if scores:
            metrics.append({"step": step, "critic/score/mean": sum(scores) / len(scores),
                            "critic/score/max": max(scores), "critic/score/min": min(scores)})
    return {"metrics": metrics, "rollouts": rollouts}


def _columns(rows: list[dict]) -> dict[str, list]:
    """Row dicts -> parquet columns; a reward part missing from a row is NaN."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k, math.nan if k.startswith("reward_") else None) for r in rows] for k in names}


def import_external_run(folder: str | Path, runs_root: str | Path, name: str) -> Path:
    """Convert a TRL output_dir or a verl rollout dump into the run directory runs_root/name
    (config.yaml `{}`, status.json "succeeded" with "imported_from", metrics.jsonl, rollouts/step_N.parquet)
    and return it. Raises InteropError when the folder is neither, FileExistsError when the run exists."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InteropError(f"{folder} is not a folder")
    if _verl_files(folder):
        kind, data = "verl", read_verl_dump(folder)
    else:
        kind, data = "trl", read_trl_output(folder)
    root = Path(runs_root) / check_name(name, "run name")
    if root.exists():
        raise FileExistsError(f"run {root} exists already: choose another name")
    run = RunDir(root).create()
    run.config.write_text("{}\n")
    for m in data["metrics"]:
        run.append_metrics(m)
    for step, rows in data["rollouts"].items():
        if rows:
            run.write_rollouts(step, _columns(rows))
    steps = [m["step"] for m in data["metrics"]] + list(data["rollouts"])
    run.write_status("succeeded", imported_from=str(folder.resolve()), imported_kind=kind,
                     step=max(steps, default=0), stage="succeeded")
    return root
