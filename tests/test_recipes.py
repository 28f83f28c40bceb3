"""Recipes and the plots in docs/: a recipe trains, validates before and after, and reports both; the plot
command draws what runs logged and names what they did not."""

from __future__ import annotations

import json
import struct

import pyarrow.parquet as pq
import pytest

from backend.core import data
from backend.core.config import load_config
from backend.services import plotting, recipes

from .conftest import SHARED, tiny_overrides
from .test_cli import cli

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

GSM8K = SHARED / "data/gsm8k/train.jsonl"


def png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_every_recipe_config_validates(name, tmp_path):
    recipe = recipes.get_recipe(name)
    cfg = load_config(recipe.config, [])
    assert cfg.trainer.val_before_train, "a recipe reports accuracy before training: it must validate at step 0"
    assert cfg.actor_rollout_ref.model.path == "smollm2-135m-instruct"


def test_the_cpu_recipe_trains_and_reports_accuracy_before_and_after(tmp_path, sample_sets):
    run_dir = tmp_path / "run"
    # The CPU recipe's own settings, with the tiny model and a two-step budget so the test is quick.
    overrides = [o for o in tiny_overrides(sample_sets) if o.split("=")[0] in
                 ("actor_rollout_ref.model.path", "data.train_files", "data.val_files", "trainer.total_training_steps")]
    result = cli("recipe", "arithmetic-cpu", *overrides, "data.max_response_length=8", "data.val_max_samples=4",
                 "trainer.test_freq=1", "--run-dir", str(run_dir), "--quiet")
    assert result.returncode == 0, result.stderr
    report = json.loads((run_dir / "recipe.json").read_text())
    assert [s for s, _ in report["curve"]] == [0, 1, 2]
    assert report["before"] == report["curve"][0][1] and report["after"] == report["curve"][-1][1]
    assert report["steps"] == 2 and report["train_s"] > 0 and report["wall_s"] >= report["train_s"]
    assert report["command"].startswith("python -m backend recipe arithmetic-cpu ")
    assert report["environment"]["torch"] and report["environment"]["cpus"] >= 1
    assert png_size(run_dir / "plots/val_accuracy.png")[0] > 400
    assert "held-out accuracy" in result.stdout and "before" in result.stdout
    assert (run_dir / "export/config.json").is_file(), "a recipe's model is exported for plain transformers"


def test_the_gsm8k_recipe_holds_out_a_fixed_draw_never_trained_on(tmp_path):
    inputs = {"gsm8k_jsonl": str(GSM8K), "data_dir": str(tmp_path)}
    overrides, notes = recipes.prepare(recipes.get_recipe("gsm8k"), inputs)
    train = data.load_rows(tmp_path / "gsm8k_recipe_train.parquet")
    val = data.load_rows(tmp_path / "gsm8k_recipe_val.parquet")
    assert len(val) == recipes.GSM8K_HELD_OUT
    assert len(train) + len(val) == len(GSM8K.read_text().splitlines())
    assert not {r["prompt"][0]["content"] for r in val} & {r["prompt"][0]["content"] for r in train}
    assert overrides == [f"data.train_files=[{tmp_path / 'gsm8k_recipe_train.parquet'}]",
                         f"data.val_files=[{tmp_path / 'gsm8k_recipe_val.parquet'}]"]
    again = tmp_path / "again"
    recipes.prepare(recipes.get_recipe("gsm8k"), {**inputs, "data_dir": str(again)})
    first, second = (pq.read_table(d / "gsm8k_recipe_val.parquet") for d in (tmp_path, again))
    assert second.equals(first)


def test_a_recipe_without_its_data_or_with_a_bad_override_says_what_to_give(tmp_path):
    missing = cli("recipe", "gsm8k", "--data-dir", str(tmp_path))
    assert missing.returncode == 2 and "--gsm8k-jsonl" in missing.stderr
    bad = cli("recipe", "gsm8k", "--gsm8k-jsonl", str(GSM8K), "--data-dir", str(tmp_path), "trainer.total_steps=3")
    assert bad.returncode == 2 and "trainer.total_steps" in bad.stderr
    assert not list(tmp_path.iterdir()), "a bad override must be refused before any data is made"
    unknown = cli("recipe", "arithmetics")
    assert unknown.returncode == 2 and "arithmetic-cpu" in unknown.stderr
    listed = cli("recipe", "list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in recipes.RECIPES)


def write_metrics(run_dir, lines):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def test_series_takes_the_later_line_of_a_step_logged_twice_and_skips_steps_without_the_metric(tmp_path):
    write_metrics(tmp_path / "r", [{"step": 1, "a/b": 0.1}, {"step": 2}, {"step": 3, "a/b": 0.3},
                                   {"step": 3, "a/b": 0.35}, {"step": 4, "a/b": True}])
    assert plotting.series(tmp_path / "r", "a/b") == ([1, 3], [0.1, 0.35])


def test_max_step_cuts_every_run_at_the_same_step(tmp_path):
    write_metrics(tmp_path / "long", [{"step": s, "m/x": 1.0} for s in range(1, 50)])
    write_metrics(tmp_path / "late", [{"step": s, "m/x": 1.0} for s in range(40, 50)])
    plotting.plot_metric([tmp_path / "long"], "m/x", tmp_path / "ok.png", max_step=10)
    with pytest.raises(plotting.PlotError, match="no run logged 'm/x' up to step 10"):
        plotting.plot_metric([tmp_path / "late"], "m/x", tmp_path / "none.png", max_step=10)


def test_plot_draws_one_line_per_run_and_names_the_metrics_that_exist(tmp_path):
    write_metrics(tmp_path / "grpo", [{"step": s, "val/accuracy": s / 10} for s in range(5)])
    write_metrics(tmp_path / "ppo", [{"step": s, "val/accuracy": s / 20, "critic/vf_loss": 1.0} for s in range(5)])
    out = tmp_path / "docs/acc.png"
    result = cli("plot", str(tmp_path / "grpo"), str(tmp_path / "ppo"), "--label", "GRPO, lr 1e-5", "--label", "PPO",
                 "--smooth", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert png_size(out)[0] > 400
    missing = cli("plot", str(tmp_path / "grpo"), "--metric", "reward/mean", "--out", str(tmp_path / "x.png"))
    assert missing.returncode == 2 and "val/accuracy" in missing.stderr
    assert "reward/mean" in missing.stderr and not (tmp_path / "x.png").exists()
    with pytest.raises(plotting.PlotError, match="no metrics.jsonl"):
        plotting.plot_metric([tmp_path / "nothing"], "val/accuracy", tmp_path / "y.png")
    with pytest.raises(plotting.PlotError, match="2 labels for 1 runs"):
        plotting.plot_metric([tmp_path / "grpo"], "val/accuracy", tmp_path / "y.png", labels=["a", "b"])
