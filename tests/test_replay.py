"""A step dumped by a run replays in one plain process (no Ray) to the values the run logged, says so when it
does not, and runs under pdb with breakpoints in a reward function."""

from __future__ import annotations

import ast
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from backend.core.runs import list_dumps, read_status
from backend.engine.replay import ReplayError, replay
from backend.rewards import rules

from .conftest import REPO, tiny_overrides


@pytest.fixture(scope="module")
def dumped_run(sample_sets, tmp_path_factory):
    """A one-rank CPU run of the tiny model that dumps step 2 (trainer.dump_steps) and step 1 (a request file,
    as the Runs page's button writes). Two optimizer steps a step over two shuffled epochs, KL loss on: the
    update draws from the RNG and computes every metric it logs."""
    run_dir = tmp_path_factory.mktemp("replay") / "run"
    run_dir.mkdir()
    (run_dir / "dump_next").touch()
    overrides = tiny_overrides(sample_sets, **{
        "trainer.dump_steps": "[2]", "data.val_files": "[]", "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
        "actor_rollout_ref.actor.ppo_epochs": 2, "actor_rollout_ref.actor.shuffle": True,
        "actor_rollout_ref.actor.use_kl_loss": True, "trainer.export_at_end": False})
    done = subprocess.run([sys.executable, "-m", "backend", "train", "defaults", *overrides, "--run-dir",
                           str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def replay_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend", "replay", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, input=stdin)


@pytest.mark.slow
def test_a_dumped_step_replays_in_one_process_to_the_loss_kl_clip_fraction_and_grad_norm_the_run_logged(
        dumped_run):
    assert read_status(dumped_run)["state"] == "succeeded"
    assert [d.name for d in list_dumps(dumped_run)] == ["step_1", "step_2"]
    assert not (dumped_run / "dump_next").exists()  # the request was taken
    out = replay_cli(str(dumped_run / "dumps" / "step_2"), "--device", "cpu")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    table = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.startswith("actor/")}
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm", "actor/entropy"):
        assert table[key][-1] == "yes", out.stdout
    assert "rewards: 8 of 8 responses score as they did in the run" in out.stdout
    assert "without Ray" in out.stdout and "equal within tolerance" in out.stdout
    assert "deterministic" not in out.stdout  # the run did not ask for it


@pytest.mark.slow
def test_a_replay_that_computes_other_values_says_which_and_exits_1(dumped_run, tmp_path):
    changed = tmp_path / "step_2"
    shutil.copytree(dumped_run / "dumps" / "step_2", changed)
    batch = torch.load(changed / "batch.pt", weights_only=True)
    batch["advantages"] = -batch["advantages"]
    torch.save(batch, changed / "batch.pt")
    with open(changed / "rewards.pkl", "rb") as f:
        rewards = pickle.load(f)
    rewards["scores"][0] += 1.0
    with open(changed / "rewards.pkl", "wb") as f:
        pickle.dump(rewards, f)
    out = replay_cli(str(changed), "--device", "cpu")
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    pg_loss = next(line for line in out.stdout.splitlines() if line.startswith("actor/pg_loss "))
    assert pg_loss.endswith("NO")
    assert "rewards: 7 of 8 responses score as they did in the run" in out.stdout
    assert "DIFFERENT from what the run logged" in out.stdout


@pytest.mark.slow
def test_a_step_of_a_deterministic_run_replays_with_deterministic_algorithms(dumped_run, tmp_path):
    dump = tmp_path / "step_2"
    shutil.copytree(dumped_run / "dumps" / "step_2", dump)
    cfg = yaml.safe_load((dump / "config.yaml").read_text())
    cfg["trainer"]["deterministic"] = True
    (dump / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = replay_cli(str(dump), "--device", "cpu")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "with deterministic algorithms only (trainer.deterministic)" in out.stdout
    assert "equal within tolerance" in out.stdout


def _first_statement_line(function) -> int:
    source = (REPO / "backend" / "rewards" / "rules.py").read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body  # past the docstring
    return body[0].lineno


@pytest.mark.slow
def test_replay_under_pdb_stops_at_a_breakpoint_in_the_reward_function(dumped_run):
    line = _first_statement_line(rules.arithmetic_score.__name__)
    commands = f"b backend/rewards/rules.py:{line}\nc\np 'reward-breakpoint', solution_str is not None\ncl 1\nc\n"
    out = replay_cli(str(dumped_run / "dumps" / "step_1"), "--device", "cpu", "--pdb", stdin=commands)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "('reward-breakpoint', True)" in out.stdout
    assert "equal within tolerance" in out.stdout


def test_a_folder_that_is_not_a_whole_dump_is_named_with_what_it_lacks(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    with pytest.raises(ReplayError, match=r"is not a whole step dump \(missing batch.pt, update.json"):
        replay(tmp_path, "cpu")
