"""trainer.logger: TensorBoard, W&B (offline) and MLflow receive each step's metrics, read back with each
library's own reader; a bad name or a missing library fails at validation with what to do."""

from __future__ import annotations

import json
import struct
import sys
import warnings
from pathlib import Path

import pytest

from backend.core import trackers
from backend.core.config import ConfigError, load_config
from backend.core.runs import read_metrics
from backend.engine.trainer import Trainer

from .conftest import tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

ALL = "[console,jsonl,tensorboard,wandb,mlflow]"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, sample_sets) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_MODE", "offline")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path_factory.mktemp("runs") / "tracked"
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.logger": ALL, "trainer.export_at_end": False}))
    try:
        Trainer(cfg, run_dir, show_progress=False).train()
    finally:
        mp.undo()
    return run_dir


def test_metrics_jsonl_is_written_alongside_the_trackers(tracked_run):
    assert [m["step"] for m in read_metrics(tracked_run)] == [1, 2]


def test_tensorboard_event_files_hold_one_scalar_per_step(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked_run / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("critic/score/mean")
    assert [e.step for e in events] == [1, 2]
    scores = [m["critic/score/mean"] for m in read_metrics(tracked_run)]
    assert [e.value for e in events] == pytest.approx(scores)


def wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows of a .wandb file: a LevelDB-style log (7-byte file header, 32 KiB blocks, each
    chunk headed by crc32 / length / type) of wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos = path.read_bytes(), 32768, 7
    records, pending = [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_wandb_writes_an_offline_run_whose_history_has_one_row_per_step(tracked_run):
    (run,) = (tracked_run / "wandb").glob("offline-run-*")
    (log,) = run.glob("run-*.wandb")
    history = wandb_history(log)
    assert [row["_step"] for row in history] == [1, 2]
    scores = [m["critic/score/mean"] for m in read_metrics(tracked_run)]
    assert [row["critic/score/mean"] for row in history] == pytest.approx(scores)


def test_mlflow_local_store_holds_params_and_a_metric_history_per_step(tracked_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=trackers.local_mlflow_uri(tracked_run))
    experiment = client.get_experiment_by_name("grpo-workbench")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["data.train_batch_size"] == "2"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted(m.step for m in history) == [1, 2]


def test_only_finite_numbers_reach_a_tracker_and_a_failing_tracker_is_switched_off():
    seen = []

    class Good:
        def log(self, metrics, step):
            seen.append((metrics, step))

        def close(self):
            pass

    class Broken(Good):
        def log(self, metrics, step):
            raise RuntimeError("disk full")

    tracking = trackers.Tracking({"broken": Broken(), "good": Good()})
    with pytest.warns(UserWarning, match="tracker broken failed"):
        tracking.log({"step": 1, "a": 1, "b": float("nan"), "c": "text", "d": None, "e": True}, step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the broken tracker is gone
        tracking.log({"a": 2.0}, step=2)
    assert seen == [({"a": 1.0}, 1), ({"a": 2.0}, 2)]
    assert list(tracking.trackers) == ["good"]


def test_mlflow_metric_names_keep_slashes_and_lose_invalid_characters():
    assert trackers.mlflow_name("val/arithmetic/accuracy") == "val/arithmetic/accuracy"
    assert trackers.mlflow_name("reward/first(error)@k") == "reward/first_error__k"


def test_an_unknown_logger_fails_validation_naming_the_allowed_ones(sample_sets):
    with pytest.raises(ConfigError) as e:
        load_config(None, tiny_overrides(sample_sets, **{"trainer.logger": "[console,neptune]"}))
    message = str(e.value)
    assert "'neptune'" in message
    for name in ("console", "jsonl", "tensorboard", "wandb", "mlflow"):
        assert name in message


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_tracker_library_fails_validation_with_the_install_command(sample_sets, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ConfigError) as e:
        load_config(None, tiny_overrides(sample_sets, **{"trainer.logger": f"[console,{name}]"}))
    assert "pip install 'grpo-workbench[trackers]'" in str(e.value)
    assert f"pip install {name}" in str(e.value)
