"""Successive halving in sweeps: a rung is ranked once every running trial has reached it, so trials that run at
once are judged together whatever order they arrive in; trials run one after another get exactly the verdicts
of Optuna's own SuccessiveHalvingPruner; and the sweep stops the losers' runs and records why."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys

import optuna
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
    assert judge(early, 10, maximize=True) == []

    arrived = [RungTrial(t.number, {**t.curve, 10: AT_10[NAMES[t.number]]}, running=True) for t in early]
    verdicts = judge(arrived, 10, maximize=True)
    # 8 values at the rung: the best 8 // 4 = 2 go on, judged on their step-10 value, not the later 0.9.
    assert {NAMES[v.number] for v in verdicts if v.goes_on} == {"1e-4 n8", "3e-5 n8"}
    assert {(v.rung, v.rung_step, v.kept, v.of) for v in verdicts} == {(0, 10, 2, 8)}
    assert [v.value for v in verdicts] == list(AT_10.values())


def test_a_rung_above_waits_for_a_trial_still_below_the_first_and_then_counts_every_earlier_value():
    # Four trials at once: #0 passed step 10 and logged step 40; #1 and #2 were stopped at step 10; #3 has
    # just started in #1's place. Then #3 reaches step 10 (0.5) and 40 (0.7).
    done = [RungTrial(1, {10: 0.2}, judged=[0.2], counts=False), RungTrial(2, {10: 0.3}, judged=[0.3], counts=False)]
    first = RungTrial(0, {10: 0.4, 40: 0.6}, judged=[0.4], running=True)
    assert judge([first, *done, RungTrial(3, {}, running=True)], 10, maximize=True) == []

    verdicts = judge([first, *done, RungTrial(3, {10: 0.5, 40: 0.7}, running=True)], 10, maximize=True)
    assert verdicts == [
        Verdict(3, 0, 10, 0.5, goes_on=True, kept=1, of=4),   # the best of 0.4, 0.2, 0.3 and 0.5
        Verdict(0, 1, 40, 0.6, goes_on=False, kept=1, of=2),
        Verdict(3, 1, 40, 0.7, goes_on=True, kept=1, of=2),
    ]


def test_what_counts_at_a_rung_finished_trials_yes_stopped_and_failed_ones_only_for_rungs_they_were_judged_at():
    trials = [
        RungTrial(0, {4: 0.9, 16: 0.9}),                                     # completed without a verdict: counts
        RungTrial(1, {4: 0.8, 16: 0.95}, judged=[0.8], counts=False),        # stopped at rung 0, logged on after
        RungTrial(2, {4: 0.99, 16: 0.99}, counts=False),                     # failed: never counts
        RungTrial(3, {4: 0.1, 16: 0.85}, judged=[0.1], running=True),
    ]
    assert judge(trials, 4, maximize=True) == [Verdict(3, 1, 16, 0.85, goes_on=False, kept=1, of=2)]
    # Lower is better, and a trial cloned at step 30 is judged at rung 1 on its first value, at step 30.
    clone = RungTrial(4, {30: 0.05}, judged=[0.1], running=True)
    assert judge([*trials[:3], clone], 4, maximize=False) == [Verdict(4, 1, 16, 0.05, goes_on=True, kept=1, of=2)]


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_trials_run_one_after_another_get_the_verdicts_of_optunas_successive_halving_pruner(direction):
    rng = random.Random(direction)
    optuna_study = optuna.create_study(direction=direction,
                                       pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=2))
    ours: list[RungTrial] = []
    optuna_stops, our_stops = [], []
    for number in range(40):
        trial = optuna_study.ask()
        curve: dict[int, float] = {}
        judged: list[float] = []
        for step in range(1, 40, rng.choice([1, 3])):
            curve[step] = round(rng.random(), 1)  # ties included
            trial.report(curve[step], step)
            pruned_by_optuna = trial.should_prune()
            mine = RungTrial(number, dict(curve), judged=list(judged), running=True)
            verdicts = judge([*ours, mine], 2, maximize=direction == "maximize")
            judged += [v.value for v in verdicts]
            if pruned_by_optuna or any(not v.goes_on for v in verdicts):
                break
        optuna_stops.append(step if pruned_by_optuna else None)
        our_stops.append(step if any(not v.goes_on for v in verdicts) else None)
        if pruned_by_optuna:
            optuna_study.tell(trial, state=TrialState.PRUNED)
        else:
            optuna_study.tell(trial, curve[step])
        ours.append(RungTrial(number, curve, judged=judged, counts=our_stops[-1] is None))
    assert our_stops == optuna_stops
    # Rungs at steps 2, 8 and 32: trials stopped at more than one of them, and some ran to the end.
    assert len({0 if s < 8 else 1 if s < 32 else 2 for s in our_stops if s is not None}) >= 2
    assert None in our_stops


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
                                         "best 1 of the 2 trials that reached it (successive halving)")
    assert (slow.user_attrs["rungs"], best.user_attrs["rungs"]) == ([0.3], [0.6])
    assert launcher.read_run(runs[0])["status"]["state"] == "stopped" and procs[0].wait(timeout=10) is not None
    assert launcher.read_run(runs[1])["status"]["state"] == "running" and procs[1].poll() is None
    # Judged once: the next pass finds nothing new at step 10, and the trial that goes on waits for step 40.
    sweeps._halve(study, spec)
    assert study.get_trials()[1].state == TrialState.RUNNING
    assert sweeps.read_sweep(folder)["trials"][0].reason.startswith("stopped early at step 11")
    procs[1].kill()
    procs[1].wait()
