"""No token or key from the environment ends up in what a run prints or writes.

Run directories get shared, zipped into bug reports and uploaded by trackers; a training process that
echoed its environment (a config dump, a tracker recording `os.environ`, an error message with the env in
it) would leak credentials the user only meant the process to hold. This launches a real tiny run with
secret-looking values in the usual credential variables and every local tracker on, then looks for those
values, byte for byte, in its output and in every file it left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from .conftest import REPO, tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

SECRET_VARS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_TOKEN")


def test_a_run_never_prints_or_writes_tokens_from_its_environment(tmp_path, sample_sets):
    # distinct per variable and per test run, so a hit names the variable and cannot be a coincidence
    secrets = {var: f"sk-test-{uuid.uuid4().hex}" for var in SECRET_VARS}
    run_dir = tmp_path / "run"
    args = tiny_overrides(sample_sets, **{"trainer.logger": "[console,jsonl,tensorboard]"})
    proc = subprocess.run([sys.executable, "-m", "backend", "train", "defaults", *args, "--run-dir", str(run_dir)],
                          cwd=REPO, env={**os.environ, **secrets, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    files = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    # an empty or missing run dir would pass the search below vacuously
    assert files, f"nothing written under {run_dir}"
    # the tracker that serializes the most is on, so its files are searched too
    assert any("tensorboard" in path.relative_to(run_dir).parts for path in files), sorted(files)
    # the search must be able to find what a run does write: the train file path is in its config
    assert any(str(sample_sets["train"]).encode() in data for data in files.values())

    for var, secret in secrets.items():
        assert secret not in proc.stdout, f"{var} printed to stdout"
        assert secret not in proc.stderr, f"{var} printed to stderr"
        leaked = [str(path.relative_to(run_dir)) for path, data in files.items() if secret.encode() in data]
        assert not leaked, f"{var} written to {leaked}"
