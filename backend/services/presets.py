"""Where a config can start from: the shipped presets in `configs/`, the configs of earlier runs
(`runs/<id>/config.yaml`), and configs the user saved from the UI (`configs/saved/<name>.yaml`).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from backend.core import workspace
from backend.core.config import Config, ConfigError, config_from_yaml_text, dump_yaml, to_dict

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

# The UI's contract: st.session_state[SESSION_KEY] holds the YAML text of the config being edited (the
# Config page writes it; the Runs page launches it). Absent until the Config page has run once; then
# DEFAULT_PRESET's text is the sensible fallback.
SESSION_KEY = "config_yaml_text"
# The workbench opens on the quick try: a newcomer's first run shows its charts within half a minute on two CPU
# cores, where configs/default.yaml (SmolLM2) takes most of a minute a step.
DEFAULT_PRESET = "Quick try (tiny random model)"

# name -> file in configs/ (None: the schema defaults, no file)
_PRESETS: dict[str, str | None] = {
    DEFAULT_PRESET: "quick_try.yaml",
    "GRPO on the arithmetic sample": "default.yaml",
    "GSM8K GRPO": "gsm8k_grpo.yaml",
    "Dr.GRPO": "drgrpo.yaml",
    # The recipes of `python -m backend recipe` (docs/results.md); the GSM8K one needs its data made first.
    "Recipe: arithmetic, one GPU": "recipes/arithmetic.yaml",
    "Recipe: arithmetic, CPU (about 15 min)": "recipes/arithmetic-cpu.yaml",
    "Recipe: GSM8K, one GPU": "recipes/gsm8k.yaml",
    "blank": None,
}


def list_presets() -> dict[str, Path | None]:
    """Preset name -> its YAML file (None for "blank", the schema defaults), in the order to offer them."""
    return {name: (CONFIGS_DIR / file if file else None) for name, file in _PRESETS.items()}


def _preset_path(name: str) -> Path | None:
    presets = list_presets()
    if name not in presets:
        raise KeyError(f"no preset named {name!r}; presets: {', '.join(presets)}")
    return presets[name]


def load_preset(name: str) -> dict:
    """The preset as a YAML dict (the schema defaults, in full, for "blank")."""
    path = _preset_path(name)
    if path is None:
        return to_dict(Config())
    return yaml.safe_load(path.read_text()) or {}


def preset_yaml_text(name: str) -> str:
    """The preset's YAML text, comments included (the schema defaults written out for "blank")."""
    path = _preset_path(name)
    return path.read_text() if path else dump_yaml(to_dict(Config()))


def time_estimate(name: str) -> str:
    """How long the preset's run takes on this machine, in words: its model, its steps and their time as
    backend.services.planner predicts it here (start-up, validation and checkpoints not counted). A shipped
    model that has not been made yet is named instead of made: converting SmolLM2 takes most of a minute."""
    # Here, not at the top: the planner and the models bring torch (seconds), which every page imports this
    # module for, and only the Config page's estimate needs.
    from backend.core.models import SHIPPED, cache_dir, is_model_folder
    from backend.services import planner

    cfg, problems = config_from_yaml_text(preset_yaml_text(name))
    if cfg is None:
        return f"not valid: {problems[0]}"
    model = cfg.actor_rollout_ref.model.path
    if model in SHIPPED and not is_model_folder(cache_dir() / model):
        return f"{model}; the time is estimated once the model is made (on its first use)"
    try:
        step_s = planner.plan(cfg).step_seconds
    except (ConfigError, ValueError) as e:  # ModelError is a ValueError: a model this machine cannot read
        return f"{model}; no estimate ({e})"
    if step_s is None:
        return f"{model}; no estimate of its time here"
    steps = cfg.trainer.total_training_steps
    if not steps:
        return f"{model}, about {_duration(step_s)} a step here"
    return f"{model}, {steps} steps: about {_duration(steps * step_s)} here"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def run_configs(runs_root: str | Path) -> dict[str, Path]:
    """Run id -> runs/<id>/config.yaml for every run directory that has one, newest first."""
    root = Path(runs_root)
    if not root.is_dir():
        return {}
    found = [d / "config.yaml" for d in root.iterdir() if (d / "config.yaml").is_file()]
    found.sort(key=lambda p: (p.stat().st_mtime, p.parent.name), reverse=True)
    return {p.parent.name: p for p in found}


def list_saved_configs() -> dict[str, Path]:
    """Saved config name -> configs/saved/<name>.yaml, by name."""
    folder = workspace.saved_configs_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.glob("*.yaml")) if p.is_file()}


def save_config(name: str, yaml_text: str, *, overwrite: bool = False) -> Path:
    """Write `yaml_text` to configs/saved/<name>.yaml and return the path. The name must pass
    workspace.check_name (PathError otherwise); an existing file is kept unless overwrite=True
    (FileExistsError); a text that is not a YAML mapping is refused (ConfigError). A config that does
    not validate may be saved: it is a draft."""
    name = name.strip()
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    workspace.check_name(name, "config name")
    try:
        raw = yaml.safe_load(yaml_text or "")
    except yaml.YAMLError as e:
        raise ConfigError([f"the YAML is not valid, so it was not saved: {e}"]) from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(["the YAML is not a mapping of sections (data:, actor_rollout_ref:, ...); not saved"])
    folder = workspace.saved_configs_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    if path.exists() and not overwrite:
        raise FileExistsError(f"a saved config named {name!r} exists ({path}); choose another name or overwrite it")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(yaml_text if yaml_text.endswith("\n") else yaml_text + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
