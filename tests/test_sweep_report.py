"""The sweep benchmark's report: parts of the full grid add up to one grid, while each halving sweep given to it
is a call of its own, compared with that whole grid, and the shares are the median over the calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sweep_gpu  # noqa: E402


def _trial(number: int, lr: float, state: str, step: int, value: float) -> dict:
    return {"number": number, "values": {"lr": lr}, "state": state, "step": step, "value": value, "reason": None}


def _sweep(tmp_path: Path, name: str, mode: str, wall: float, busy: float, trial_s: float, trials: list[dict]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"mode": mode, "state": "finished", "sweep_wall_s": wall,
                                "first_launch_to_last_end_s": busy, "trial_s_total": trial_s, "trials": trials}))
    return str(path)


def test_each_halving_call_is_compared_with_the_whole_grid_and_the_shares_are_their_median(tmp_path):
    # The full grid in two parts (run one after the other): 100 + 300 s of wall, 90 + 270 s busy.
    low = _sweep(tmp_path, "packed-low", "packed", 100.0, 90.0, 200.0,
                 [_trial(0, 1e-6, "complete", 10, 0.2), _trial(1, 1e-5, "complete", 10, 0.7)])
    high = _sweep(tmp_path, "packed-high", "packed", 300.0, 270.0, 600.0,
                  [_trial(2, 1e-4, "complete", 10, 0.5)])
    first = _sweep(tmp_path, "halving", "halving", 200.0, 180.0, 300.0,
                   [_trial(0, 1e-6, "pruned", 2, 0.1), _trial(1, 1e-5, "complete", 10, 0.7),
                    _trial(2, 1e-4, "pruned", 2, 0.1)])
    second = _sweep(tmp_path, "halving2", "halving", 240.0, 216.0, 400.0,
                    [_trial(0, 1e-6, "complete", 10, 0.2), _trial(1, 1e-5, "complete", 10, 0.7),
                     _trial(2, 1e-4, "pruned", 4, 0.3)])
    third = _sweep(tmp_path, "halving3", "halving", 160.0, 144.0, 240.0,
                   [_trial(0, 1e-6, "complete", 10, 0.2), _trial(1, 1e-5, "pruned", 2, 0.1),
                    _trial(2, 1e-4, "pruned", 2, 0.1)])

    out = sweep_gpu.report([low, high, first, second, third], by="lr")

    assert (out["packed_parts"], out["packed_wall_s"], out["packed_busy_s"]) == (2, 400.0, 360.0)
    assert out["packed_best"] == {"values": {"lr": 1e-5}, "value": 0.7}
    assert [c["wall_share"] for c in out["halving"]] == [0.5, 0.6, 0.4]
    assert [c["busy_share"] for c in out["halving"]] == [0.5, 0.6, 0.4]
    assert [c["trial_s_share"] for c in out["halving"]] == [0.375, 0.5, 0.3]
    assert [c["pruned"] for c in out["halving"]] == [{0: 2, 2: 2}, {2: 4}, {1: 2, 2: 2}]
    assert [c["same_best"] for c in out["halving"]] == [True, True, False]
    assert out["halving_busy_share"] == {"median": 0.5, "min": 0.4, "max": 0.6, "calls": 3}
    assert out["halving_trial_s_share"]["median"] == 0.375
    assert out["same_best"] is False
