"""verl launch scripts to and from our config, and TRL / verl runs read into run directories the Runs and
Rollouts pages already show."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from backend.core import config as C
from backend.services import rollouts
from backend.services.interop import (
    OWN_KEYS,
    InteropError,
    from_verl_script,
    import_external_run,
    read_trl_output,
    read_verl_dump,
    to_verl_command,
)
from backend.services.launcher import list_runs, read_run

ROOT = Path(__file__).resolve().parents[1]

# verl's documented GRPO example (examples/grpo_trainer/run_qwen2-7b.sh), with a variable and Hydra's + form
GSM8K_GRPO = r"""set -x
# GRPO on GSM8K
MODEL=Qwen/Qwen2-7B-Instruct
export VLLM_ATTENTION_BACKEND=XFORMERS
gsm8k_train_path=$HOME/data/gsm8k/train.parquet

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$gsm8k_train_path \
    data.val_files="['/data/gsm8k/test.parquet', '/data/math/test.parquet']" \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=${MODEL} \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.top_k=-1 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console','wandb','swanlab'] \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    ++trainer.max_actor_ckpt_to_keep=3 \
    +trainer.val_before_train=False \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@ 2>&1 | tee verl_demo.log
"""


# ---- from verl ----

def test_from_verl_script_reads_values_variables_quotes_and_hydra_prefixes():
    raw, _ = from_verl_script(GSM8K_GRPO)
    cfg = C.from_dict(raw)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.train_files == [os.path.expanduser("~") + "/data/gsm8k/train.parquet"]
    assert cfg.data.val_files == ["/data/gsm8k/test.parquet", "/data/math/test.parquet"]
    assert cfg.data.train_batch_size == 1024 and cfg.data.truncation == "error"
    assert cfg.data.filter_overlong_prompts is True
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2-7B-Instruct"
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.actor.entropy_coeff == 0.0
    assert cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.actor_rollout_ref.rollout.top_k == 0  # verl's -1 is our 0: off
    assert cfg.trainer.max_checkpoints_to_keep == 3  # renamed: verl's max_actor_ckpt_to_keep
    assert cfg.trainer.val_before_train is False and cfg.trainer.total_epochs == 15
    assert cfg.trainer.logger == ["console", "wandb", "jsonl"]  # wandb is one of ours too (trackers)
    C.validate_config(cfg)


def test_from_verl_script_lists_what_does_not_carry_over():
    raw, notes = from_verl_script(GSM8K_GRPO)
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2: not supported here" in notes
    assert "actor_rollout_ref.model.use_remove_padding=True: not supported here" in notes
    assert raw["trainer"]["critic_warmup"] == 0  # PPO's critic warm-up is ours too
    assert not any(n.startswith("actor_rollout_ref.rollout.name") for n in notes)  # vLLM's part: our engine
    assert any(n.startswith("trainer.logger") and "swanlab" in n for n in notes)
    assert raw["trainer"]["n_gpus_per_node"] == 8  # carried over: the workers are Ray ranks now
    assert raw["actor_rollout_ref"]["rollout"]["name"] == "auto"
    assert not any("$@" in n or "tee" in n for n in notes)


def test_from_verl_script_reports_unset_variables_and_bad_values():
    script = ("python3 -m verl.trainer.main_ppo data.train_files=$DATA/train.parquet "
              "algorithm.adv_estimator=grpo_passk data.train_batch_size=lots ~trainer.logger # a comment\n")
    raw, notes = from_verl_script(script)
    assert raw["data"]["train_files"] == ["$DATA/train.parquet"]
    assert "$DATA is not set in the script; left as written" in notes
    assert any(n.startswith("algorithm.adv_estimator=grpo_passk: not supported here") for n in notes)
    assert any(n.startswith("data.train_batch_size=lots: must be an integer") for n in notes)
    assert "~trainer.logger: not supported here (only key=value overrides are read)" in notes


def test_from_verl_script_without_a_verl_command_is_an_error():
    with pytest.raises(InteropError, match="no `python3 -m verl.trainer.main_ppo`"):
        from_verl_script("echo hello\n")


# ---- to verl ----

def test_to_verl_command_round_trips_through_from_verl_script():
    cfg = C.load_config(None, [
        "data.train_files=[a.parquet, b.parquet]", "data.val_files=[]", "data.train_batch_size=8",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "actor_rollout_ref.actor.optim.lr=3e-6",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.top_k=50", "actor_rollout_ref.model.tokenizer_path=tok",
        "algorithm.adv_estimator=rloo", "trainer.experiment_name=my run", "trainer.max_checkpoints_to_keep=5",
        "trainer.val_before_train=true", "custom_reward_function.path=my reward.py",
    ])
    command = to_verl_command(cfg)
    assert command.startswith("python3 -m verl.trainer.main_ppo \\\n")
    assert "data.tokenizer=tok" in command and "trainer.max_actor_ckpt_to_keep=5" in command
    raw, notes = from_verl_script(command)
    assert notes == []
    back = C.from_dict(raw)
    for key in C.field_specs():
        if key not in OWN_KEYS or key in ("actor_rollout_ref.model.tokenizer_path",
                                          "trainer.max_checkpoints_to_keep"):
            assert C.get_value(back, key) == C.get_value(cfg, key), key


def test_to_verl_command_leaves_out_our_own_keys_and_keeps_the_essentials():
    cfg = C.load_config(None, ["trainer.device=cpu", "trainer.runs_root=elsewhere", "reward.timeout_s=3",
                               "trainer.token_log_max=0", "data.val_max_samples=5"])
    command = to_verl_command(cfg)
    for own in ("trainer.device", "trainer.runs_root", "reward.", "token_log_max", "val_max_samples"):
        assert own not in command
    for essential in ("data.train_files=", "actor_rollout_ref.model.path=", "data.train_batch_size=",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=", "actor_rollout_ref.rollout.n=",
                      "algorithm.adv_estimator="):
        assert essential in command
    assert "jsonl" not in command  # not a verl logger


def test_an_async_config_one_step_off_is_verls_one_step_off_recipe_and_reads_back():
    cfg = C.load_config(None, ["trainer.rollout_mode=async", "trainer.n_gpus_per_node=2",
                               "actor_rollout_ref.rollout.n_gpus_per_node=3"])
    command = to_verl_command(cfg)
    assert command.startswith("python3 -m recipe.one_step_off_policy.main_ppo \\\n")
    lines = [line.strip(" \\") for line in command.splitlines()[1:]]
    for line in ("actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=3",
                 "trainer.n_gpus_per_node=2"):
        assert line in lines, line
    raw, notes = from_verl_script(command)
    assert notes == []
    back = C.from_dict(raw)
    assert (back.trainer.rollout_mode, back.trainer.max_staleness, back.trainer.n_gpus_per_node,
            back.actor_rollout_ref.rollout.n_gpus_per_node) == ("async", 1, 2, 3)
    # At staleness 0 nothing overlaps: verl's main_ppo trains the same thing, on the actor's GPUs.
    on_policy = to_verl_command(C.load_config(None, ["trainer.rollout_mode=async", "trainer.max_staleness=0"]))
    assert on_policy.startswith("python3 -m verl.trainer.main_ppo")
    assert "rollout.n_gpus_per_node" not in on_policy and "hybrid_engine" not in on_policy


def test_a_one_step_off_recipe_script_reads_as_an_async_run_and_says_what_does_not_carry_over():
    script = """
n_gpus_rollout=2
n_gpus_training=$((8 - n_gpus_rollout))
python3 -m recipe.one_step_off_policy.main_ppo \\
    algorithm.adv_estimator=grpo \\
    actor_rollout_ref.hybrid_engine=False \\
    actor_rollout_ref.rollout.calculate_log_probs=True \\
    trainer.n_gpus_per_node=6 \\
    rollout.nnodes=2 \\
    rollout.n_gpus_per_node=${n_gpus_rollout}
"""
    raw, notes = from_verl_script(script)
    cfg = C.from_dict(raw)
    assert (cfg.trainer.rollout_mode, cfg.trainer.max_staleness, cfg.trainer.n_gpus_per_node,
            cfg.actor_rollout_ref.rollout.n_gpus_per_node) == ("async", 1, 6, 2)
    assert notes == ["actor_rollout_ref.rollout.calculate_log_probs=True: not supported here",
                     "rollout.nnodes=2: not supported here"]


# ---- CLI ----

def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


@pytest.mark.slow
def test_cli_config_from_verl_writes_a_yaml_that_validates_and_to_verl_prints_it_back(tmp_path):
    (tmp_path / "run.sh").write_text(GSM8K_GRPO)
    done = _cli("config", "from-verl", "run.sh", "--output", "x.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tensor_model_parallel_size=2: not supported here" in done.stderr
    cfg = C.load_config(tmp_path / "x.yaml")
    assert cfg.actor_rollout_ref.rollout.n == 5 and cfg.data.train_batch_size == 1024
    shown = _cli("config", "to-verl", "x.yaml", "actor_rollout_ref.rollout.n=6", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "actor_rollout_ref.rollout.n=6 \\" in shown.stdout
    assert "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct" in shown.stdout


@pytest.mark.slow
def test_cli_config_from_verl_without_a_verl_command_exits_2(tmp_path):
    (tmp_path / "run.sh").write_text("echo nothing\n")
    done = _cli("config", "from-verl", "run.sh", cwd=tmp_path)
    assert done.returncode == 2 and "no `python3 -m verl.trainer.main_ppo`" in done.stderr


# ---- other tools' runs ----

def _trl_folder(root: Path) -> Path:
    """A TRL GRPOTrainer output_dir: trainer_state.json and completions/ (log_completions=True)."""
    root.mkdir()
    log_history = [
        {"step": 5, "epoch": 0.1, "loss": 0.01, "reward": 0.25, "reward_std": 0.4, "kl": 0.002,
         "grad_norm": 1.5, "learning_rate": 1e-6, "completions/mean_length": 42.0, "entropy": 0.9,
         "clip_ratio/region_mean": 0.0, "rewards/accuracy_reward/mean": 0.25},
        {"step": 10, "epoch": 0.2, "loss": 0.02, "reward": 0.5, "reward_std": 0.3, "kl": 0.004,
         "grad_norm": 1.2, "learning_rate": 1e-6, "completions/mean_length": 40.0},
        {"step": 10, "train_runtime": 12.5, "train_loss": 0.015},
    ]
    (root / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": log_history}))
    (root / "completions").mkdir()
    pq.write_table(pa.table({
        "step": ["10"] * 4,
        "prompt": ["What is 2+2?", "What is 2+2?", "What is 3+3?", "What is 3+3?"],
        "completion": ["4", "five i think", "6", "6"],
        "accuracy_reward": [1.0, 0.0, 1.0, 1.0],
        "reward": [1.0, 0.0, 1.0, 1.0],
        "advantage": [0.7, -0.7, 0.0, 0.0],
    }), root / "completions" / "completions_00010.parquet")
    return root


def _verl_folder(root: Path) -> Path:
    """verl's rollout dump (trainer.rollout_data_dir): one <step>.jsonl per step."""
    root.mkdir()
    lines = [{"input": "user: 1+1?", "output": "2", "gts": "2", "score": 1.0, "step": 10, "acc": 1.0},
             {"input": "user: 1+1?", "output": "3", "gts": "2", "score": 0.0, "step": 10, "acc": 0.0},
             {"input": "user: 2+5?", "output": "the answer is 7", "gts": "7", "score": 1.0, "step": 10, "acc": 1.0}]
    (root / "10.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"input": "torn')
    return root


def test_read_trl_output_maps_metric_names_and_groups_completions_by_prompt(tmp_path):
    out = read_trl_output(_trl_folder(tmp_path / "trl"))
    by_step = {m["step"]: m for m in out["metrics"]}
    assert by_step[5]["critic/score/mean"] == 0.25 and by_step[5]["actor/kl_loss"] == 0.002
    assert by_step[5]["actor/pg_loss"] == 0.01 and by_step[5]["response_length/mean"] == 42.0
    assert by_step[5]["actor/lr"] == 1e-6 and by_step[5]["actor/entropy"] == 0.9
    assert by_step[5]["rewards/accuracy_reward/mean"] == 0.25  # unmapped: its own name
    assert by_step[10]["train_runtime"] == 12.5  # entries of one step are merged
    rows = out["rollouts"][10]
    assert [r["group"] for r in rows] == [0, 0, 1, 1]
    assert rows[0]["index"] == rows[1]["index"] != rows[2]["index"]
    assert rows[1]["response_length"] == 3 and rows[1]["advantage"] == -0.7
    assert rows[0]["reward_accuracy_reward"] == 1.0 and rows[0]["data_source"] == "trl"


def test_read_verl_dump_reads_each_step_file_and_skips_a_torn_line(tmp_path):
    out = read_verl_dump(_verl_folder(tmp_path / "verl"))
    rows = out["rollouts"][10]
    assert len(rows) == 3 and [r["group"] for r in rows] == [0, 0, 1]
    assert rows[2]["ground_truth"] == "7" and rows[2]["response_length"] == 4
    assert rows[1]["reward"] == 0.0 and rows[1]["reward_acc"] == 0.0 and math.isnan(rows[1]["advantage"])
    assert out["metrics"] == [{"step": 10, "critic/score/mean": 2 / 3, "critic/score/max": 1.0,
                               "critic/score/min": 0.0}]


@pytest.mark.parametrize("make", [_trl_folder, _verl_folder], ids=["trl", "verl"])
def test_an_imported_run_reads_like_our_own_runs(tmp_path, make):
    source = make(tmp_path / "source")
    run_dir = import_external_run(source, tmp_path / "runs", "imported")
    run = read_run(run_dir)
    assert run["status"]["state"] == "succeeded"
    assert run["status"]["imported_from"] == str(source.resolve())
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == {}
    assert run["metrics"] and all("step" in m for m in run["metrics"])
    assert any("critic/score/mean" in m for m in run["metrics"])
    assert rollouts.rollout_steps(run_dir) == [10]
    rows = rollouts.load_step(run_dir, 10)
    groups = rollouts.group_rows(rows)
    assert len(groups) == 2 and rows[0]["finish_reason"] == "unknown"
    [summary] = list_runs(tmp_path / "runs")
    assert (summary.name, summary.state, summary.step) == ("imported", "succeeded", 10)
    with pytest.raises(FileExistsError):
        import_external_run(source, tmp_path / "runs", "imported")


def test_importing_a_folder_that_is_neither_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InteropError, match="not a TRL output folder"):
        import_external_run(tmp_path / "empty", tmp_path / "runs", "x")
    assert not (tmp_path / "runs" / "x").exists()


def test_config_page_loads_a_pasted_verl_script_into_the_editor(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    at = AppTest.from_file(str(ROOT / "pages" / "config.py"), default_timeout=60).run()
    at.text_area(key="config_verl_script").set_value(GSM8K_GRPO)
    at.button(key="config_from_verl").click().run()
    assert not at.exception
    text = at.session_state["config_yaml_text"]
    assert C.from_dict(yaml.safe_load(text)).actor_rollout_ref.rollout.n == 5
    assert any("tensor_model_parallel_size=2" in m.value for m in at.markdown)
    assert any(c.value.startswith("python3 -m verl.trainer.main_ppo") for c in at.code)
