"""Successive halving in sweeps: a rung is ranked once every running trial has reached it, so trials that run at
once are judged together whatever order they arrive in; of N trials the best N/4 at the first rung are never
stopped, however the trials arrive; and the sweep stops the losers' runs and records why."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys

import pytest
from optuna.trial import TrialState

from backend.core.config import load_config
from backend.services import launcher, sweeps
from backend.services.halving import RungTrial, Verdict, judge

from .conftest import tiny_overrides

# Validation accuracy at step 10 of the arithmetic recipe's grid on one H200 (docs/sweeps.md): learning rate x
# group size, the group-size-4 trials reach step 10 first.
AT_10 = {"3e-6 n4": 0.175, "3e-6 n8": 0.19, "1e-5 n4": 0.175, "1e-5 n8": 0.28,
         "3e-5 n4": 0.38, "3e-5 n8": 0.455, "1e-4 n4": 0.05, "1e-4 n8": 0.53}
NAMES = list(AT_10)


def test_trials_that_reach_a_rung_first_wait_for_the_slower_ones_and_the_best_quarter_of_all_goes_on():
    # The group-size-4 trials have logged steps 10 and 12; the others are at step 8.
    early = [RungTrial(i, {8: 0.1, 10: AT_10[n], 12: 0.9}, running=True) if n.endswith("n4")
             else RungTrial(i, {8: 0.1}, running=True) for i, n in enumerate(NAMES)]
    assert judge(early, 10, maximize=True, total=8) == []

    arrived = [RungTrial(t.number, {**t.curve, 10: AT_10[NAMES[t.number]]}, running=True) for t in early]
    verdicts = judge(arrived, 10, maximize=True, total=8)
    # The best 8 / 4 = 2 go on, judged on their step-10 value, not the later 0.9.
    assert {NAMES[v.number] for v in verdicts if v.goes_on} == {"1e-4 n8", "3e-5 n8"}
    assert {(v.rung, v.rung_step, v.kept, v.of) for v in verdicts} == {(0, 10, 2, 8)}
    assert [v.value for v in verdicts] == list(AT_10.values())


def test_a_rung_above_waits_for_a_trial_still_below_the_first_and_then_counts_every_earlier_value():
    # Eight trials, four at once: #0 passed step 10 (its 0.4 was the best of the first four there) and logged
    # step 40; #1 and #2 were stopped at step 10; #3 has just started. Then #3 reaches step 10 (0.5) and 40 (0.7).
    done = [RungTrial(1, {10: 0.2}, judged=[0.2], counts=False), RungTrial(2, {10: 0.3}, judged=[0.3], counts=False)]
    first = RungTrial(0, {10: 0.4, 40: 0.6}, judged=[0.4], running=True)
    assert judge([first, *done, RungTrial(3, {}, running=True)], 10, maximize=True, total=8) == []

    verdicts = judge([first, *done, RungTrial(3, {10: 0.5, 40: 0.7}, running=True)], 10, maximize=True, total=8)
    assert verdicts == [
        Verdict(3, 0, 10, 0.5, goes_on=True, kept=2, of=4),   # among the best 2 of 0.4, 0.2, 0.3 and 0.5
        Verdict(0, 1, 40, 0.6, goes_on=False, kept=1, of=2),  # 8 / 16: one trial goes past step 40
        Verdict(3, 1, 40, 0.7, goes_on=True, kept=1, of=2),
    ]


def test_what_counts_at_a_rung_finished_trials_yes_stopped_and_failed_ones_only_for_rungs_they_were_judged_at():
    trials = [
        RungTrial(0, {4: 0.9, 16: 0.9}),                                     # completed without a verdict: counts
        RungTrial(1, {4: 0.8, 16: 0.95}, judged=[0.8], counts=False),        # stopped at rung 0, logged on after
        RungTrial(2, {4: 0.99, 16: 0.99}, counts=False),                     # failed: never counts
        RungTrial(3, {4: 0.1, 16: 0.85}, judged=[0.1], running=True),
    ]
    assert judge(trials, 4, maximize=True, total=4) == [Verdict(3, 1, 16, 0.85, goes_on=False, kept=1, of=2)]
    # Lower is better, and a trial cloned at step 30 is judged at rung 1 on its first value, at step 30.
    clone = RungTrial(4, {30: 0.05}, judged=[0.1], running=True)
    assert judge([*trials[:3], clone], 4, maximize=False, total=5) == [
        Verdict(4, 1, 16, 0.05, goes_on=True, kept=1, of=2)]


@pytest.mark.parametrize("seed", range(20))
def test_however_the_trials_arrive_none_of_the_best_quarter_at_the_first_rung_is_stopped(seed):
    rng = random.Random(seed)
    total = rng.choice([4, 8, 9, 16, 20])
    at_rung = {n: round(rng.random(), 1) for n in range(total)}  # ties included
    best = sorted(at_rung.values(), reverse=True)[total // 4 - 1]
    order = rng.sample(range(total), total)
    # The trials reach step 10 in `order`, in groups that run at once (each group reaching it together).
    cuts = sorted(rng.sample(range(1, total), rng.randint(0, total - 1)))
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    trials: dict[int, RungTrial] = {}
    stopped = set()
    for group in groups:
        for n in group:
            trials[n] = RungTrial(n, {10: at_rung[n]}, running=True)
        verdicts = judge(list(trials.values()), 10, maximize=True, total=total)
        assert {v.number for v in verdicts} == set(group)
        stopped |= {v.number for v in verdicts if not v.goes_on}
        for v in verdicts:  # judged, and no longer running once stopped
            trials[v.number] = RungTrial(v.number, {10: v.value}, judged=[v.value], running=v.goes_on,
                                         counts=v.goes_on)
    assert not {n for n in stopped if at_rung[n] >= best}
    if len(groups) == 1:  # all at once: exactly the values at or above the quota's bar go on
        assert stopped == {n for n in range(total) if at_rung[n] < best}


def test_the_sweep_stops_the_trials_outside_the_rungs_best_quarter_and_records_the_values_it_judged(
        sample_sets, tmp_path):
    base = load_config(None, tiny_overrides(sample_sets))
    spec = sweeps.SweepSpec(params=[sweeps.SweepParam("actor_rollout_ref.actor.optim.lr", values=[1e-4, 1e-5])],
                            metric="val/accuracy", early_stopping="halving", min_steps=10, parallel=0)
    folder = sweeps.create_sweep(base, spec, name="halving", runs_root=tmp_path)
    study = sweeps._study(folder, spec)
    # Two running trials whose runs are processes of this machine, each at step 11 of its curve.
    procs, runs = [], []
    for i, value in enumerate((0.3, 0.6)):
        trial = study.ask()
        trial.suggest_categorical(spec.params[0].key, spec.params[0].values)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        run = tmp_path / f"20260101-00000{i}-halving-{i:03d}"
        run.mkdir()
        (run / "status.json").write_text(json.dumps({"state": "running", "pid": proc.pid, "pgid": proc.pid,
                                                     "host": socket.gethostname()}))
        trial.set_user_attr("run", str(run))
        trial.report(value, 10)
        trial.report(value + 0.01, 11)
        procs.append(proc)
        runs.append(run)

    sweeps._halve(study, spec)
    slow, best = study.get_trials()
    assert (slow.state, best.state) == (TrialState.PRUNED, TrialState.RUNNING)
    assert slow.user_attrs["reason"] == ("stopped early at step 11: val/accuracy 0.3 at step 10 is not among the "
                                         "best 1 of the 2 values logged there (successive halving keeps 1 of the "
                                         "2 trials at that step)")
    assert (slow.user_attrs["rungs"], best.user_attrs["rungs"]) == ([0.3], [0.6])
    assert launcher.read_run(runs[0])["status"]["state"] == "stopped" and procs[0].wait(timeout=10) is not None
    assert launcher.read_run(runs[1])["status"]["state"] == "running" and procs[1].poll() is None
    # Judged once: the next pass finds nothing new at step 10, and the trial that goes on waits for step 40.
    sweeps._halve(study, spec)
    assert study.get_trials()[1].state == TrialState.RUNNING
    assert sweeps.read_sweep(folder)["trials"][0].reason.startswith("stopped early at step 11")
    procs[1].kill()
    procs[1].wait()
