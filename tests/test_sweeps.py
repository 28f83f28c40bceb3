"""Sweeps: what a user asks is checked before anything runs, the grid runs in the order written, and a real
sweep of tiny-model runs ends with one trial finished, one stopped early by Optuna's pruner and the trials of a
broken model failed, after its own process was killed and resumed midway."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from backend.core.config import load_config
from backend.core.models import resolve_model
from backend.core.runs import checkpoint_step, latest_checkpoint
from backend.services import launcher, sweeps

from .conftest import REPO, finished_trials, tiny_overrides, wait_for

LR = "actor_rollout_ref.actor.optim.lr"
N = "actor_rollout_ref.rollout.n"
Axis = sweeps.SweepParam
MODEL = "actor_rollout_ref.model.path"


@pytest.fixture
def base(sample_sets):
    return load_config(None, tiny_overrides(sample_sets))


def spec(*params: sweeps.SweepParam, **fields) -> sweeps.SweepSpec:
    return sweeps.SweepSpec(params=list(params), **fields)


def test_grid_and_range_flags_parse_into_axes_and_ranges():
    grid = sweeps.parse_grid([f"{LR}=1e-6,3e-6", "actor_rollout_ref.rollout.n=4,8"])
    assert [(p.key, p.values) for p in grid] == [(LR, ["1e-6", "3e-6"]), (N, [4, 8])]
    (r,) = sweeps.parse_ranges([f"{LR}=1e-7:1e-4:log"])
    assert (r.key, r.low, r.high, r.log) == (LR, 1e-7, 1e-4, True)
    for bad in (f"{LR}", f"{LR}=1:2:cube", f"{LR}=a:b"):
        with pytest.raises(sweeps.SweepError, match=LR.split(".")[0] if "=" not in bad else "range"):
            sweeps.parse_ranges([bad])
    with pytest.raises(sweeps.SweepError, match="at least one value"):
        sweeps.parse_grid([f"{LR}="])


def test_a_sweep_yaml_names_its_unknown_fields_and_malformed_ranges():
    s = sweeps.spec_from_dict({"grid": {LR: [1e-6, 1e-5]}, "metric": "val/accuracy", "steps": 5})
    assert (s.params[0].values, s.metric, s.steps) == ([1e-6, 1e-5], "val/accuracy", 5)
    with pytest.raises(sweeps.SweepError, match="unknown field.*budget"):
        sweeps.spec_from_dict({"grid": {LR: [1e-6]}, "budget": 3})
    with pytest.raises(sweeps.SweepError, match=f"ranges.{LR} needs low: and high:"):
        sweeps.spec_from_dict({"ranges": {LR: {"low": 1e-6}}})


@pytest.mark.parametrize(("bad", "message"), [
    (spec(Axis("actor.optim.lr", values=[1e-6])), f"actor.optim.lr is not a config key; did you mean {LR}"),
    (spec(Axis(N, values=[4, 0])),
     r"the trial actor_rollout_ref.rollout.n=0 is not a valid config: .*actor_rollout_ref.rollout.n"),
    (spec(Axis(LR, low=0.0, high=1e-4, log=True), trials=4), "a log scale needs a positive low"),
    (spec(Axis(LR, low=1e-4, high=1e-6), trials=4), "the range .* is empty"),
    (spec(Axis(LR, low=1e-6, high=1e-4)), r"need a number of trials \(--trials N\)"),
    (spec(Axis(LR, values=[1e-6]), Axis(N, low=2, high=8), trials=2),
     "a grid or random ranges, not both"),
    (spec(Axis("trainer.logger", low=1, high=2), trials=2), "trainer.logger is not a number"),
    (spec(Axis(LR, values=[1e-6]), direction="up"), "direction 'up': use max or min"),
    (spec(), "varies at least one key"),
])
def test_a_bad_sweep_is_refused_with_the_key_and_value_and_writes_nothing(base, tmp_path, bad, message):
    with pytest.raises(sweeps.SweepError, match=message):
        sweeps.create_sweep(base, bad, name="bad", runs_root=tmp_path)
    assert not (tmp_path / "sweeps" / "bad").exists()


def test_the_grid_is_queued_in_the_order_written_with_values_of_the_keys_type(base, tmp_path):
    folder = sweeps.create_sweep(base, spec(Axis(LR, values=["1e-6", "1e-5"]),
                                            Axis(N, values=[2, 4])),
                                 name="grid", runs_root=tmp_path)
    sweep = sweeps.read_sweep(folder)
    assert [(t.state, t.values) for t in sweep["trials"]] == [("waiting", {LR: v, N: n})
                                                             for v in (1e-6, 1e-5) for n in (2, 4)]
    assert sweeps.list_sweeps(tmp_path) == [folder]
    assert launcher.list_runs(tmp_path) == []  # the sweep's own folder is not a run
    with pytest.raises(sweeps.SweepError, match="a sweep named grid already exists"):
        sweeps.create_sweep(base, spec(Axis(LR, values=[1e-6])), name="grid", runs_root=tmp_path)


def test_random_ranges_draw_within_bounds_on_a_log_scale_and_whole_numbers_for_int_keys(base, tmp_path):
    s = spec(Axis(LR, low=1e-7, high=1e-3, log=True), Axis(N, low=2, high=8),
             trials=40)
    folder = sweeps.create_sweep(base, s, name="random", runs_root=tmp_path)
    study = sweeps._study(folder, s)
    draws = []
    for _ in range(40):
        trial = study.ask()
        draws.append({p.key: sweeps._suggest(trial, p) for p in s.params})
    lrs = [d[LR] for d in draws]
    assert all(1e-7 <= v <= 1e-3 for v in lrs)
    assert sum(v < 1e-5 for v in lrs) >= 10  # half the log range lies below 1e-5; uniformly, 1% would
    assert all(isinstance(d[N], int) and 2 <= d[N] <= 8
               for d in draws)


def test_a_trial_asked_for_but_never_launched_runs_again_and_a_trial_that_cannot_start_fails_alone(sample_sets,
                                                                                                   tmp_path):
    base = load_config(None, tiny_overrides(sample_sets, **{"data.train_files": f"[{tmp_path / 'gone.parquet'}]"}))
    s = spec(Axis(LR, values=[1e-3]))
    folder = sweeps.create_sweep(base, s, name="requeue", runs_root=tmp_path)
    sweeps._study(folder, s).ask()  # the sweep's process killed between choosing a trial and launching its run
    assert sweeps.run_sweep(folder, poll_s=0.01) == "finished"
    (trial,) = sweeps.read_sweep(folder)["trials"]
    assert (trial.values, trial.state, trial.run) == ({LR: 1e-3}, "fail", None)
    assert trial.reason.startswith("could not start: ") and "gone.parquet" in trial.reason


def test_deleting_a_sweep_refuses_a_running_one_and_removes_its_trials_runs_only_when_asked(base, tmp_path):
    s = spec(Axis(LR, values=[1e-3, 1e-6]))
    kept = sweeps.create_sweep(base, s, name="kept", runs_root=tmp_path)
    kept_runs = finished_trials(kept, s, tmp_path)
    sweeps._write_state(kept, state="running", pid=os.getpid(), host=socket.gethostname())
    with pytest.raises(sweeps.SweepError, match="sweep kept is running: stop it before deleting it"):
        sweeps.delete_sweep(kept, with_runs=True)
    assert kept.is_dir() and all(r.is_dir() for r in kept_runs)

    sweeps.request_stop(kept)
    sweeps._write_state(kept, state="stopped")
    sweeps.delete_sweep(kept)
    assert not kept.exists() and all(r.is_dir() for r in kept_runs)  # the trials stay as ordinary runs

    gone = sweeps.create_sweep(base, s, name="gone", runs_root=tmp_path)
    gone_runs = finished_trials(gone, s, tmp_path)
    sweeps.delete_sweep(gone, with_runs=True)
    assert not gone.exists() and not any(r.exists() for r in gone_runs)
    assert sweeps.list_sweeps(tmp_path) == [] and all(r.is_dir() for r in kept_runs)


def test_placement_puts_a_trial_on_the_gpu_with_most_room_within_the_margin_and_a_huge_one_alone():
    h200 = [141.0, 141.0]  # 119.85 GiB each usable with the 15% margin
    assert sweeps.place(20.0, [0.0, 0.0], h200) == 0
    assert sweeps.place(20.0, [40.0, 20.0], h200) == 1
    assert sweeps.place(20.0, [100.0, 99.0], h200) == 1  # 119 <= 119.85
    assert sweeps.place(20.0, [100.0, 100.0], h200) is None  # 120 > 119.85: it waits
    assert sweeps.place(130.0, [10.0, 0.0], h200) == 1  # larger than the margin allows: alone on an empty GPU
    assert sweeps.place(130.0, [10.0, 5.0], h200) is None
    # trials predicted at 12 GiB: nine share one H200 (108 GiB), a tenth waits
    used = [0.0]
    for _ in range(9):
        assert sweeps.place(12.0, used, [141.0]) == 0
        used[0] += 12.0
    assert sweeps.place(12.0, used, [141.0]) is None



def test_on_a_cluster_trials_ask_ray_for_shares_of_a_gpu_that_fit_as_many_as_the_margin_allows(sample_sets):
    assert sweeps.gpu_share(11.46, 79.2) == 0.1703  # 11.46 GiB of the 67.32 the margin leaves, rounded up
    assert sweeps.gpu_share(70.0, 79.2) == 1.0  # more than the margin leaves: a whole GPU
    assert sweeps.gpu_share(11.46, 0.0) == 1.0  # a GPU whose memory the cluster could not say

    def fill(ray_address: str, gpus: list[float]) -> list[tuple[str | None, dict]]:
        """Place trials of the tiny config until none fits: each one's pin and recorded placement."""
        placed: list[optuna.trial.FrozenTrial] = []
        pins = []
        while True:
            cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.device": "cuda",
                                                                  "trainer.ray_address": ray_address}))
            where = sweeps._place_trial(cfg, need, placed, gpus)
            if where is None:
                return pins
            pins.append((sweeps._pin(cfg, where), where))
            assert cfg.trainer.gpu_share == where.get("gpu_share", 1.0)
            placed.append(optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs=where))

    need = sweeps._predicted_gib(load_config(None, tiny_overrides(sample_sets, **{"trainer.device": "cuda"})), 2.0)
    gpus = [need * 3.5, need * 3.5]  # room for 2.975 trials in each within the margin
    here, cluster = fill("", gpus), fill("127.0.0.1:6379", gpus)
    assert [pin for pin, _ in here] == ["0", "1", "0", "1"]  # pinned to the GPU with the most room
    assert [pin for pin, _ in cluster] == [None] * 4  # Ray picks the GPU, held to the shares
    (share,) = {where["gpu_share"] for _, where in cluster}
    assert share == sweeps.gpu_share(need, gpus[0]) and 4 * share <= 2 < 6 * share
    assert sorted(where["gpu"] for _, where in cluster) == [0, 0, 1, 1]


@pytest.mark.slow
def test_a_trial_that_ran_out_of_memory_runs_again_alone_and_the_planners_miss_is_recorded(sample_sets, tmp_path):
    base = load_config(None, tiny_overrides(sample_sets, **{"data.val_files": "[]"}))
    s = spec(Axis(LR, values=[1e-3]), steps=2, metric="actor/lr")
    folder = sweeps.create_sweep(base, s, name="oom", runs_root=tmp_path)
    # The first trial's run as a worker's CUDA out-of-memory error leaves it (this CPU cannot run out of GPU
    # memory), launched beside trial #7 with the planner's prediction recorded as the sweep records it.
    trial = sweeps._study(folder, s).ask()
    trial.suggest_categorical(LR, [1e-3])
    run = tmp_path / "20260101-000000-oom-000"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({
        "state": "failed", "host": "gpu-node", "error": "WorkerError: worker rank 0 died during update: "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}))
    for name, value in (("run", str(run)), ("gpu", 0), ("predicted_gib", 30.5), ("beside", [7])):
        trial.set_user_attr(name, value)

    assert sweeps.run_sweep(folder, poll_s=0.2) == "finished"
    first, retry = sweeps.read_sweep(folder)["trials"]
    assert (first.state, retry.state, retry.values) == ("fail", "complete", first.values)
    assert first.reason.startswith("out of memory beside trial(s) #7 (the planner predicted 30.5 GiB for it); "
                                   "retried alone. WorkerError"), first.reason
    assert launcher.read_run(retry.run)["status"]["state"] == "succeeded"


# A deterministic reward, slow enough (0.2 s a response, a step about 1.6 s) that the sweep sees each step.
PACED_REWARD = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.2)
    return 0.0
"""


@pytest.mark.slow
def test_a_sweep_finishes_one_trial_stops_one_early_fails_a_broken_one_and_survives_its_process_killed(
        sample_sets, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(resolve_model("tiny-qwen3"), broken)
    for weights in glob.glob(str(broken / "*.safetensors")):
        Path(weights).write_bytes(b"not weights")
    reward = tmp_path / "paced_reward.py"
    # A step of over a second: the sweep, reading its trials every second, sees trial 1 running past its first
    # step (at 0.2 s, trial 1's four steps could all land between two reads, and it ended complete).
    reward.write_text(PACED_REWARD.replace("time.sleep(0.2)", "time.sleep(1.0)"))
    runs = tmp_path / "runs"
    overrides = tiny_overrides(sample_sets, **{"custom_reward_function.path": reward, "data.val_files": "[]"})
    # The lr each trial logs (actor/lr) is the metric: trial 1 (lr 1e-6) trails trial 0 (lr 1e-3) at every step,
    # so the median pruner stops it once trial 0 has finished.
    cmd = [sys.executable, "-m", "backend", "sweep", "defaults", *overrides, "--grid",
           f"{MODEL}=tiny-qwen3,{broken}", f"{LR}=1e-3,1e-6", "--metric", "actor/lr", "--steps", "4",
           "--early-stopping", "median", "--startup-trials", "1", "--runs-root", str(runs), "--name", "lr", "--quiet"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    folder = runs / "sweeps" / "lr"

    def trial_running() -> bool:
        return folder.exists() and any(t.state == "running" and t.run for t in sweeps.read_sweep(folder)["trials"])

    wait_for(trial_running, timeout=120)
    first.send_signal(signal.SIGKILL)  # the workbench or its machine going away: the trial's run goes on
    first.wait()
    assert sweeps.read_sweep(folder)["state"]["state"] == "interrupted"
    resumed = subprocess.run([sys.executable, "-m", "backend", "sweep", "--resume", str(folder), "--quiet"],
                             cwd=REPO, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    sweep = sweeps.read_sweep(folder)
    trials = sweep["trials"]
    assert sweep["state"]["state"] == "finished"
    assert [t.state for t in trials] == ["complete", "pruned", "fail", "fail"]
    assert trials[0].value == pytest.approx(1e-3) and sweep["best"].number == 0
    assert trials[1].reason.startswith("stopped early at step ") and "actor/lr 1e-06" in trials[1].reason
    assert launcher.read_run(trials[1].run)["status"]["state"] == "stopped"
    assert trials[1].step < 4
    for t in trials[2:]:
        assert "SafetensorError" in t.reason, t.reason
    # Every trial is an ordinary run, once: the killed sweep's running trial was watched, not started again.
    listed = launcher.list_runs(runs)
    assert sorted(s.path for s in listed) == sorted(Path(t.run) for t in trials)
    for t in trials:
        status = json.loads((Path(t.run) / "status.json").read_text())
        assert status["sweep"] == {"name": "lr", "trial": t.number}
    assert "best: #0 actor/lr=0.001" in resumed.stdout
    best = sweeps.best_config(folder)
    assert (best.actor_rollout_ref.actor.optim.lr, best.actor_rollout_ref.model.path) == (1e-3, "tiny-qwen3")
    assert best.trainer.total_training_steps == 4
    assert os.path.getsize(folder / "study.journal") > 0


def test_a_clone_needs_a_running_sweep_and_a_checkpoint(base, tmp_path):
    s = spec(Axis(LR, values=[1e-3, 1e-6]))
    folder = sweeps.create_sweep(base, s, name="clone", runs_root=tmp_path)
    finished_trials(folder, s, tmp_path)
    with pytest.raises(sweeps.SweepError, match="sweep clone is not running: a clone joins a running sweep"):
        sweeps.clone_trial(folder, 0, base)
    sweeps._write_state(folder, state="running", pid=os.getpid(), host=socket.gethostname())
    with pytest.raises(sweeps.SweepError, match="trial #0 has no checkpoint yet to clone from"):
        sweeps.clone_trial(folder, 0, base)
    with pytest.raises(sweeps.SweepError, match="sweep clone has no trial #5 with a run"):
        sweeps.clone_trial(folder, 5, base)
    assert len(sweeps.read_sweep(folder)["trials"]) == 2


@pytest.mark.slow
def test_a_trial_cloned_with_an_edited_config_joins_the_running_sweep_from_its_checkpoint(sample_sets, tmp_path):
    reward = tmp_path / "paced_reward.py"
    reward.write_text(PACED_REWARD)
    base = load_config(None, tiny_overrides(sample_sets, **{"custom_reward_function.path": reward,
                                                            "data.val_files": "[]", "trainer.save_freq": 1}))
    s = spec(Axis(LR, values=[1e-3]), steps=6, metric="actor/lr")
    folder = sweeps.create_sweep(base, s, name="clone", runs_root=tmp_path)
    sweeps.start_sweep(folder)

    def checkpointed() -> Path | None:
        trials = sweeps.read_sweep(folder)["trials"]
        return trials and trials[0].run and latest_checkpoint(trials[0].run)

    wait_for(checkpointed, timeout=180)
    parent = sweeps.read_sweep(folder)["trials"][0]
    edited = load_config(Path(parent.run) / "config.yaml", [f"{LR}=1e-6"])
    number = sweeps.clone_trial(folder, 0, edited)
    wait_for(lambda: sweeps.read_sweep(folder)["state"]["state"] == "finished", timeout=300)

    sweep = sweeps.read_sweep(folder)
    original, clone = sweep["trials"]
    assert number == clone.number == 1 and clone.clone_of == 0
    assert (original.state, clone.state) == ("complete", "complete")
    assert clone.values == {LR: 1e-6} and clone.value == pytest.approx(1e-6)  # the sweep read the clone's metric
    assert sweep["best"].number == 0
    status = launcher.read_run(clone.run)["status"]
    # It started from a copy: the parent, saving every step and keeping two, deletes the original meanwhile.
    checkpoint = Path(status["forked_from"]["checkpoint"])
    assert status["forked_from"]["run"] == Path(parent.run).name and checkpoint.parent.parent == folder / "clones"
    assert status["sweep"] == {"name": "clone", "clone_of": 0} and status["state"] == "succeeded"
    assert 0 < checkpoint_step(checkpoint) < clone.step == 6
