"""Exporting a run's checkpoint: a plain Hugging Face folder that loads on its own, with a model card
that says where it came from; the CLI does the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.core import checkpoint
from backend.core.config import load_config
from backend.core.runs import checkpoint_step, has_tokenizer, run_dir_of, tokenizer_source
from backend.engine.trainer import Trainer
from backend.services import compare
from backend.services.export import ExportError, export_checkpoint
from backend.services.model_picker import model_choices

from .conftest import REPO, tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "20260101-000000-tiny"
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.save_freq": 1}))
    Trainer(cfg, run_dir, show_progress=False).train()
    compare.evaluate_checkpoint(run_dir, "step_2", sample_sets["val"], limit=3)
    return run_dir


def test_a_checkpoint_keeps_its_tokenizer_beside_the_shards_and_an_export_holds_its_own(tiny_run):
    ckpt = tiny_run / "checkpoints" / "step_2"
    assert not has_tokenizer(ckpt)
    assert run_dir_of(ckpt) == tiny_run.resolve()
    assert tokenizer_source(ckpt) == str(ckpt / "huggingface")  # each checkpoint keeps a copy
    assert tokenizer_source(tiny_run / "export") == str(tiny_run / "export")  # it has its own
    assert tokenizer_source("tiny-llama") == "tiny-llama"
    assert checkpoint_step(ckpt) == 2 and checkpoint_step(tiny_run / "export") == 2


def test_an_exported_checkpoint_loads_with_transformers_alone(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tiny_run / "checkpoints" / "step_2"
    out = export_checkpoint(ckpt, tmp_path / "exported")
    assert out == tmp_path / "exported"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= names
    assert not names & {"shards", "trainer_state.json", "extra_state_rank_0.pt", "huggingface"}
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left behind
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == model.config.vocab_size and tokenizer.chat_template
    exported, original = load_file(out / "model.safetensors"), checkpoint.merged_state_dict(ckpt)
    assert exported.keys() <= original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in exported)
    info = json.loads((out / "grpo_workbench.json").read_text())
    assert info["base_model"] == "tiny-qwen3" and info["step"] == 2 and info["run"] == tiny_run.name


def test_the_model_card_records_base_model_step_data_config_and_evaluations(tiny_run, tmp_path, sample_sets):
    out = export_checkpoint(tiny_run / "checkpoints" / "step_2", tmp_path / "card")
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    assert "base model **tiny-qwen3**" in card
    assert f"run `{tiny_run.name}`, checkpoint `step_2`, step 2 of 2" in card
    assert f"- train: `{sample_sets['train']}`" in card and f"- validation: `{sample_sets['val']}`" in card
    [evaluation] = [e for e in compare.list_evaluations(tiny_run) if e["checkpoint"] == "step_2"]
    accuracy = evaluation["metrics"]["val/accuracy"]
    assert f"| step_2 (this model) | 2 | `{sample_sets['val']}` | 3 | {accuracy:.4f} |" in card
    assert "Validation during training at step 2: val/accuracy = " in card  # from metrics.jsonl
    assert "## Training config (resolved)" in card and "kl_loss_coef" in card


def test_a_runs_export_and_an_older_checkpoint_export_too(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    for source in (tiny_run / "export", tiny_run / "checkpoints" / "step_1"):
        out = export_checkpoint(source, tmp_path / source.name)
        AutoModelForCausalLM.from_pretrained(out)
        assert has_tokenizer(out)
    assert "step 1 of 2" in (tmp_path / "step_1" / "README.md").read_text()


def test_export_refuses_an_existing_folder_unless_told_to_replace_it(tiny_run, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(tiny_run / "checkpoints" / "step_2", target)
    assert (target / "keep.txt").exists()
    export_checkpoint(tiny_run / "checkpoints" / "step_2", target, overwrite=True)
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").exists()


def test_export_explains_folders_it_cannot_export(tiny_run, tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out")
    # Weights without a tokenizer, outside any run: nothing says which tokenizer belongs to them...
    loose = tmp_path / "loose"
    loose.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (loose / name).write_bytes((tiny_run / "export" / name).read_bytes())
    with pytest.raises(ExportError, match="tokenizer_source"):
        export_checkpoint(loose, tmp_path / "out")
    # ...unless the caller says so.
    out = export_checkpoint(loose, tmp_path / "out", tokenizer_source="tiny-qwen3")
    assert has_tokenizer(out)
    with pytest.raises(ExportError, match="inside the checkpoint"):
        export_checkpoint(loose, loose / "sub")


def test_model_choices_list_shipped_models_exports_and_checkpoints(tiny_run, tmp_path):
    exports = tmp_path / "exports"
    export_checkpoint(tiny_run / "checkpoints" / "step_1", exports / "mine")
    choices = dict(model_choices(tiny_run.parent, exports))
    assert choices["tiny-qwen3 (shipped)"] == "tiny-qwen3"
    assert choices[f"run {tiny_run.name} · export"] == str(tiny_run / "export")
    assert choices[f"run {tiny_run.name} · step_2"] == str(tiny_run / "checkpoints" / "step_2")
    assert choices[f"run {tiny_run.name} · step_1"] == str(tiny_run / "checkpoints" / "step_1")
    assert choices["export mine"] == str(exports / "mine")
    labels = list(choices)
    assert labels.index(f"run {tiny_run.name} · step_2") < labels.index(f"run {tiny_run.name} · step_1")


# ---- the command line ----

def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cli_export_writes_the_same_folder_and_refuses_to_overwrite(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_run / "checkpoints" / "step_2"
    result = cli("export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "cli"))
    assert result.returncode == 0, result.stderr
    AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert "step 2 of 2" in (tmp_path / "cli" / "README.md").read_text()
    again = cli("export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "cli"))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_cli_evaluates_a_checkpoint_of_a_run_and_a_checkpoint_folder(tiny_run, sample_sets):
    result = cli("eval", "--run-dir", str(tiny_run), "--checkpoint", "step_1", "--data", str(sample_sets["val"]),
                 "--limit", "2")
    assert result.returncode == 0, result.stderr
    assert "val/accuracy:" in result.stdout and (tiny_run / "evals" / "step_1__arithmetic_val.json").exists()
    # A checkpoint folder has no tokenizer of its own: eval --model finds the run's.
    plain = cli("eval", "--model", str(tiny_run / "checkpoints" / "step_1"), "--data", str(sample_sets["val"]),
                "--limit", "2", "--max-new-tokens", "4")
    assert plain.returncode == 0, plain.stderr
    assert "val/accuracy:" in plain.stdout
    missing = cli("eval", "--data", str(sample_sets["val"]))
    assert missing.returncode == 2 and "--run-dir" in missing.stderr
