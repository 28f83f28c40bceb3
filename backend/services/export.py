"""Turning a run's checkpoint into a plain Hugging Face model folder.

A run checkpoint (`<run>/checkpoints/step_N/`) is sharded, one file set per worker (backend.core.checkpoint
has the layout); `export_checkpoint` merges the shards into full weights and writes them with the config,
the tokenizer and a model card (`README.md`) that records where the model came from: base model, resolved
config, training data, step and the evaluations of the run. It also takes a run's export/ or any Hugging
Face folder. The result loads with `AutoModelForCausalLM.from_pretrained(folder)` alone.

`tokenizer_source` is the same lookup for anything that loads a checkpoint directly (the compare page,
`python -m backend eval --run-dir`): the checkpoint's own huggingface/ tokenizer, else the run's config."""


from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from backend.core import checkpoint
from backend.core.models import SHIPPED, SMOLLM2, ModelError, load_tokenizer
from backend.core.runs import (
    checkpoint_step,
    config_get,
    has_tokenizer,
    read_metrics,
    read_run_config,
    run_dir_of,
    tokenizer_source,
)
from backend.services.compare import list_evaluations

# Files of a checkpoint that are training state, not model: left out of an export.
TRAINING_STATE = {"optim.pt", "trainer_state.json"}  # and extra_state_rank_*.pt of sharded checkpoints
# Written fresh by the export, so a copied one would be stale.
REWRITTEN = {"README.md", "grpo_workbench.json"}
WEIGHT_SUFFIXES = (".safetensors", ".bin")
# Shipped names whose Hub id a model card can name as base_model.
HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}


class ExportError(ModelError):
    """A folder that cannot be exported; the message says what to do."""


# ---- export ----

def export_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, *, tokenizer_source: str | None = None,
                      overwrite: bool = False) -> Path:
    """Write `checkpoint_dir` (a run checkpoint, a run's export/, or any Hugging Face folder) to
    `output_dir` as a plain Hugging Face folder: weights, config.json, generation_config.json, the
    tokenizer and a model card README.md. Written into a temporary folder beside the target and renamed
    into place, so a reader never sees half an export. An existing `output_dir` is an error unless
    `overwrite`. Returns the output folder."""
    source = Path(checkpoint_dir).expanduser().resolve()
    output = Path(output_dir).expanduser().resolve()
    _check_source(source)
    if output == source or source in output.parents:
        raise ExportError(f"the output folder {output} lies inside the checkpoint {source}: choose another one")
    if output.exists() and not overwrite:
        raise ExportError(f"{output} already exists: choose another output folder (or overwrite it)")
    tok_from = tokenizer_source or _tokenizer_source_or_fail(source)

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if checkpoint.is_sharded(source):
            checkpoint.merge(source, tmp)
        for item in sorted(source.iterdir()):
            if item.is_file() and item.name not in TRAINING_STATE | REWRITTEN and not item.name.startswith(".") \
                    and not item.name.startswith("extra_state_rank_"):
                shutil.copy2(item, tmp / item.name)
        if not has_tokenizer(tmp):
            try:
                load_tokenizer(tok_from).save_pretrained(tmp)
            except Exception as e:  # noqa: BLE001 - any loader failure becomes one message
                raise ExportError(f"cannot load the tokenizer from '{tok_from}' for {source}: {e}; pass "
                                  "tokenizer_source (CLI: --tokenizer) naming the base model") from None
        if not (tmp / "generation_config.json").is_file():
            _write_generation_config(tmp)
        info = model_info(source)
        (tmp / "grpo_workbench.json").write_text(json.dumps(
            {"base_model": info["base_model"], "run": info["run"], "step": info["step"], "source": str(source),
             "exported": time.time()}, indent=1))
        (tmp / "README.md").write_text(model_card(source, name=output.name))
        if output.exists():
            shutil.rmtree(output)
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def _check_source(source: Path) -> None:
    if not source.is_dir():
        raise ExportError(f"checkpoint folder {source} does not exist")
    if checkpoint.is_sharded(source):
        if not (source / checkpoint.HF / "config.json").is_file():
            raise ExportError(f"{source} has shards but no {checkpoint.HF}/config.json: the checkpoint is incomplete")
        return
    if not (source / "config.json").is_file():
        raise ExportError(f"{source} has no config.json: point at a checkpoint (runs/<id>/checkpoints/step_N), "
                          "a run's export/ or a Hugging Face model folder")
    if not any(p.suffix in WEIGHT_SUFFIXES and p.is_file() for p in source.iterdir()):
        raise ExportError(f"{source} holds no weights (*.safetensors or *.bin): the checkpoint is incomplete")


def _tokenizer_source_or_fail(source: Path) -> str:
    found = tokenizer_source(source)
    if found == str(source) and not has_tokenizer(source):
        raise ExportError(f"{source} has no tokenizer and is not inside a run directory whose config.yaml names "
                          "the base model: pass tokenizer_source (CLI: --tokenizer) naming the base model")
    return found


def _write_generation_config(folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    generation.save_pretrained(folder)


# ---- model card ----

def model_info(model_dir: str | Path) -> dict[str, Any]:
    """What a model card records about a folder: run, base model, step, config, data files, evaluations."""
    path = Path(model_dir).resolve()
    run_dir = run_dir_of(path)
    cfg = read_run_config(run_dir) if run_dir is not None else {}
    base = config_get(cfg, "actor_rollout_ref.model.path")
    if not base:
        try:
            base = json.loads((path / "grpo_workbench.json").read_text()).get("base_model")
        except (OSError, json.JSONDecodeError, AttributeError):
            base = None
    step = checkpoint_step(path)
    evaluations: list[dict] = []
    validation: dict[str, float] = {}
    if run_dir is not None:
        evaluations = list_evaluations(run_dir)
        for line in read_metrics(run_dir):
            if line.get("step") == step:
                validation = {k: v for k, v in line.items() if k.startswith("val/") and isinstance(v, (int, float))}
    return {"run": run_dir.name if run_dir is not None else None, "run_dir": str(run_dir) if run_dir else None,
            "checkpoint": path.name, "base_model": base, "step": step, "config": cfg,
            "train_files": config_get(cfg, "data.train_files") or [],
            "val_files": config_get(cfg, "data.val_files") or [],
            "evaluations": evaluations, "validation": validation}


def model_card(model_dir: str | Path, *, name: str | None = None) -> str:
    """A README.md for the exported folder (Hugging Face model card: YAML front matter, then Markdown)."""
    info = model_info(model_dir)
    cfg = info["config"]
    front: dict[str, Any] = {"library_name": "transformers",
                             "tags": ["grpo-workbench", "reinforcement-learning",
                                      str(config_get(cfg, "algorithm.adv_estimator", "grpo"))]}
    hub_base = HUB_IDS.get(info["base_model"]) if info["base_model"] in SHIPPED else info["base_model"]
    if hub_base and "/" in hub_base and not Path(hub_base).expanduser().exists():
        front["base_model"] = hub_base
    title = name or info["checkpoint"]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    origin = f"run `{info['run']}`, checkpoint `{info['checkpoint']}`" if info["run"] else f"`{model_dir}`"
    estimator = config_get(cfg, "algorithm.adv_estimator", "unknown estimator")
    total = config_get(cfg, "trainer.total_training_steps")
    step = "unknown" if info["step"] is None else str(info["step"]) + (f" of {total}" if total else "")
    lines += [f"Trained with GRPO Workbench ({estimator}) from base model **{info['base_model'] or 'unknown'}**: "
              f"{origin}, step {step}.", ""]
    lines += ["## Training data", ""]
    files = [f"- train: `{f}`" for f in info["train_files"]] + [f"- validation: `{f}`" for f in info["val_files"]]
    lines += (files or ["Not recorded (no run config found)."]) + [""]

    lines += ["## Evaluations", ""]
    if info["validation"]:
        shown = ", ".join(f"{k} = {v:.4f}" for k, v in sorted(info["validation"].items()))
        lines += [f"Validation during training at step {info['step']}: {shown}.", ""]
    if info["evaluations"]:
        lines += ["Greedy accuracy, scored by each data set's reward (`python -m backend eval --run-dir`):", "",
                  "| checkpoint | step | data file | questions | accuracy | evaluated |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for ev in info["evaluations"]:
            acc = ev.get("metrics", {}).get("val/accuracy")
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(ev.get("timestamp", 0)))
            mark = " (this model)" if ev.get("checkpoint") == info["checkpoint"] else ""
            lines.append(f"| {ev.get('checkpoint')}{mark} | {ev.get('step', '')} | `{ev.get('data_file')}` | "
                         f"{ev.get('n', '')} | {'—' if acc is None else f'{acc:.4f}'} | {when} |")
        lines.append("")
    if not info["validation"] and not info["evaluations"]:
        lines += ["None recorded in the run directory.", ""]

    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{title}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{title}")', "```", ""]
    if cfg:
        lines += ["## Training config (resolved)", "", "```yaml", yaml.safe_dump(cfg, sort_keys=False).strip(),
                  "```", ""]
    return "\n".join(lines)


