"""Ray workers and FSDP2 sharding on CPU: two gloo ranks train exactly as one, a two-rank sharded
checkpoint resumes and merges, a killed worker fails the run cleanly, a debugger can attach."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.core import checkpoint
from backend.core.config import ConfigError, load_config
from backend.core.models import resolve_model
from backend.core.runs import list_checkpoints, read_metrics, read_status
from backend.engine import distributed
from backend.engine.trainer import Trainer
from backend.engine.worker_group import WorkerError

from .conftest import REPO, tiny_overrides, wait_for

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
            "actor/pg_clipfrac", "response_length/mean")
# Two optimizer steps a step (old log-probs in use), shuffled mini-batches, two micro-batches per rank.
SHAPE = {"data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1, "actor_rollout_ref.actor.shuffle": "true",
         "data.val_files": "[]", "trainer.save_freq": 1, "trainer.max_checkpoints_to_keep": 0,
         "custom_reward_function.path": str(REPO / "tests" / "signal_reward.py")}


def overrides(sample_sets, workers: int, **extra) -> list[str]:
    return tiny_overrides(sample_sets, **{**SHAPE, "trainer.n_gpus_per_node": workers, **extra})


def train(run_dir: Path, sample_sets, workers: int, **extra) -> Path:
    with Trainer(load_config(None, overrides(sample_sets, workers, **extra)), run_dir, show_progress=False) as t:
        t.train()
    return run_dir


def assert_same_training(a: Path, b: Path, steps: list[int]) -> None:
    ma = {m["step"]: m for m in read_metrics(a)}
    mb = {m["step"]: m for m in read_metrics(b)}
    assert sorted(mb) == steps
    for step in steps:
        for key in COMPARED:
            assert ma[step][key] == pytest.approx(mb[step][key], rel=1e-4, abs=1e-6), (step, key)
    wa, wb = load_file(a / "export/model.safetensors"), load_file(b / "export/model.safetensors")
    # Adam divides by sqrt(v): where a token's embedding row gets only float-rounding-sized gradients, a
    # different summation order on 2 ranks can move it by ~1% of lr (1e-3); a wrong gradient would move
    # it by the whole lr.
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=3e-5)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, sample_sets) -> Path:
    # The whole mini-batch in one micro-batch, where each of the two ranks runs two: the losses divide by
    # the step's global token count, so responses of different lengths weigh the same either way.
    return train(tmp_path_factory.mktemp("dist") / "one", sample_sets, 1,
                 **{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, sample_sets) -> Path:
    return train(tmp_path_factory.mktemp("dist") / "two", sample_sets, 2)


def test_two_gloo_workers_with_two_micro_batches_each_train_exactly_as_one_with_one(one_rank, two_ranks):
    assert len(read_status(two_ranks)["workers"]) == 2
    assert len({w["pid"] for w in read_status(two_ranks)["workers"]}) == 2
    assert_same_training(one_rank, two_ranks, [1, 2])
    assert read_metrics(one_rank)[0]["actor/grad_norm"] > 0


def test_two_ranks_with_micro_batches_by_tokens_train_exactly_as_one_and_run_as_many_micro_batches(
        tmp_path, sample_sets, one_rank):
    """A token budget of two short rows or one long one: a rank's micro-batches depend on its rows'
    lengths, yet every pass gathers layer by layer, so both ranks must run as many of them (or one waits
    for the other forever)."""
    by_tokens = train(tmp_path / "tokens", sample_sets, 2, **{"actor_rollout_ref.actor.use_dynamic_bsz": "true",
                                                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 150})
    assert_same_training(one_rank, by_tokens, [1, 2])


def test_each_rank_writes_its_own_shard_of_a_checkpoint(two_ranks):
    step = two_ranks / "checkpoints/step_2"
    assert sorted(p.name for p in (step / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in step.glob("extra_state_rank_*.pt")) == ["extra_state_rank_0.pt",
                                                                         "extra_state_rank_1.pt"]
    assert json.loads((step / "trainer_state.json").read_text())["world_size"] == 2


def test_a_two_rank_checkpoint_resumes_to_the_uninterrupted_result(tmp_path, sample_sets, two_ranks):
    start = two_ranks / "checkpoints/step_1"
    resumed = train(tmp_path / "resumed", sample_sets, 2,
                    **{"trainer.resume_mode": "resume_path", "trainer.resume_from_path": start})
    assert [m["step"] for m in read_metrics(resumed)] == [2]
    ma = {m["step"]: m for m in read_metrics(two_ranks)}
    for key in COMPARED:
        assert ma[2][key] == pytest.approx(read_metrics(resumed)[0][key], rel=1e-5, abs=1e-7), key
    wa, wb = load_file(two_ranks / "export/model.safetensors"), load_file(resumed / "export/model.safetensors")
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-7)


def test_resuming_with_another_number_of_workers_is_refused_before_starting(tmp_path, sample_sets, two_ranks):
    cfg = load_config(None, overrides(sample_sets, 1, **{"trainer.resume_mode": "resume_path",
                                                         "trainer.resume_from_path": two_ranks / "checkpoints/step_1"}))
    with pytest.raises(ConfigError, match="written by 2 worker"):
        Trainer(cfg, tmp_path / "other", show_progress=False)


def test_merge_turns_a_sharded_checkpoint_into_a_plain_hugging_face_folder(tmp_path, two_ranks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "backend", "merge", str(two_ranks / "checkpoints/step_2"),
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    exported = load_file(two_ranks / "export/model.safetensors")
    merged = model.state_dict()
    for key, value in exported.items():
        torch.testing.assert_close(merged[key], value)
    assert checkpoint.is_sharded(two_ranks / "checkpoints/step_2") and not checkpoint.is_sharded(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_run(run_dir: Path, args: list[str]) -> subprocess.Popen:
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "backend", "train", "defaults", *args, "--run-dir", str(run_dir)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_killed_worker_fails_the_run_clearly_and_leaves_its_last_checkpoint_whole(tmp_path, sample_sets):
    """A two-rank checkpoint resuming to the uninterrupted result is test_a_two_rank_checkpoint_resumes_...:
    here the checkpoint a killed worker leaves is the last step's, whole and readable."""
    run_dir = tmp_path / "killed"
    proc = start_run(run_dir, overrides(sample_sets, 2, **{"trainer.total_training_steps": 200}))
    try:
        wait_for(lambda: len(read_metrics(run_dir)) >= 2)
        victim = read_status(run_dir)["workers"][1]["pid"]
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=120)  # the controller does not hang on the survivor
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    status = read_status(run_dir)
    assert proc.returncode != 0
    assert status["state"] == "failed"
    assert f"worker rank 1 (pid {victim}" in status["error"] and "died" in status["error"]
    last = list_checkpoints(run_dir)[-1]
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and int(last.name.split("_")[1]) == steps[-1]
    model = checkpoint.load_merged_model(last)  # whole and readable
    assert sum(p.numel() for p in model.parameters()) > 0



def test_the_store_the_ranks_meet_at_holds_its_port_from_the_moment_it_is_made():
    """Eight runs starting at once on one machine: a port found free and bound only later by rank 0 was
    taken in between by another run (EADDRINUSE). The store is bound as it is made, so it cannot be."""
    store = distributed.meeting_store("127.0.0.1")
    with socket.socket() as s, pytest.raises(OSError, match="in use"):
        s.bind(("127.0.0.1", store.port))
    client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("rank0", "here")
    assert store.get("rank0") == b"here"


def test_a_worker_that_cannot_load_its_model_fails_the_run_naming_what_it_raised(tmp_path, sample_sets):
    broken = tmp_path / "broken-model"
    shutil.copytree(resolve_model("tiny-qwen3"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WorkerError) as failed:
        train(tmp_path / "run", sample_sets, 1, **{"actor_rollout_ref.model.path": broken})
    message = str(failed.value)
    assert message.startswith("worker rank 0 (not started) failed during start-up: "), message
    assert "SafetensorError" in message and "header" in message, message


class DapClient:
    """A minimal Debug Adapter Protocol client: the requests an IDE sends to attach and let the program run."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port), timeout=60)
        self.buffer = b""
        self.seq = 0

    def request(self, command: str, arguments: dict) -> None:
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    def wait_for(self, kind: str, name: str) -> dict:
        """Read messages until a response to `name` (kind "response") or an event `name` arrives."""
        while True:
            while b"\r\n\r\n" in self.buffer:
                head, rest = self.buffer.split(b"\r\n\r\n", 1)
                size = int(head.split(b":")[1])
                if len(rest) < size:
                    break
                message, self.buffer = json.loads(rest[:size]), rest[size:]
                if message.get("type") == kind and name in (message.get("command"), message.get("event")):
                    return message
            chunk = self.sock.recv(65536)
            assert chunk, f"the debug adapter closed the connection before {kind} {name}"
            self.buffer += chunk


def attach_debugger(host: str, port: int) -> None:
    client = DapClient(host, port)
    client.request("initialize", {"adapterID": "grpo-workbench-test"})
    client.wait_for("response", "initialize")
    client.request("attach", {"justMyCode": False})
    client.wait_for("event", "initialized")
    client.request("configurationDone", {})
    assert client.wait_for("response", "configurationDone")["success"]
    client.request("disconnect", {})  # detach; the worker runs on
    client.sock.close()


def test_a_worker_waits_for_a_debugger_and_the_run_goes_on_once_one_attaches(tmp_path, sample_sets):
    run_dir = tmp_path / "debugged"
    proc = start_run(run_dir, overrides(sample_sets, 2, **{"trainer.debug.attach_rank": 1,
                                                           "trainer.debug.attach_step": 2,
                                                           "trainer.debug.port": free_port()}))
    try:
        wait_for(lambda: (read_status(run_dir) or {}).get("debugger"))
        status = read_status(run_dir)
        assert "worker rank 1 is waiting for a debugger at " + status["debugger"] in status["stage"]
        assert [m["step"] for m in read_metrics(run_dir)] == [1]  # held at the start of step 2
        host, port = status["debugger"].rsplit(":", 1)
        attach_debugger(host, int(port))
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert read_status(run_dir)["state"] == "succeeded"
    assert "waiting for a debugger" in (run_dir.parent / "debugged.log").read_text()


def test_a_run_joins_an_existing_ray_cluster_by_address(tmp_path, sample_sets):
    port = free_port()
    ray_cli = Path(sys.executable).parent / "ray"
    # Without draining: on SIGTERM a `ray start` node first asks the GCS to drain it, and as the GCS gets the
    # same signal here, that waited out its whole 30 s before the node shut down.
    head = subprocess.Popen([str(ray_cli), "start", "--head", f"--port={port}", "--num-cpus=2", "--block",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True, env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        wait_for(lambda: "Ray runtime started" in (tmp_path / "head.log").read_text(), timeout=120)
        run_dir = tmp_path / "on-cluster"
        done = subprocess.run([sys.executable, "-m", "backend", "train", "defaults",
                               *overrides(sample_sets, 2, **{"trainer.total_training_steps": 1,
                                                             "trainer.ray_address": f"127.0.0.1:{port}"}),
                               "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "RAY_AUTH_MODE": "token"})  # as `ray start` set up the head
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert re.search(rf"Connecting to existing Ray cluster at address: [\d.]+:{port}\b", done.stderr)  # joined
        assert read_status(run_dir)["state"] == "succeeded"
        assert len(read_status(run_dir)["workers"]) == 2
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


RAY_START_RETRY = '''
import subprocess
import ray, psutil
from backend.engine import worker_group
from backend.core.config import load_config

real_init, calls = ray.init, []

def init_that_times_out_once(**kwargs):
    calls.append(kwargs)
    if len(calls) == 1:  # what a late start leaves: processes it began, then Ray's exception
        subprocess.Popen(["sleep", "300"])
        raise Exception("The current node timed out during startup. This could happen because ...")
    return real_init(**kwargs)

ray.init = init_that_times_out_once
worker_group.start_ray(load_config(None, ["trainer.device=cpu"]))
names = [p.name() for p in psutil.Process().children(recursive=True)]
print(len(calls), ray.is_initialized(), ray.cluster_resources().get("CPU", 0) > 0, names.count("sleep"),
      names.count("gcs_server"))
ray.shutdown()
'''


def test_a_private_ray_that_misses_its_start_up_deadline_is_started_again():
    """Ray gives a new node a fixed 30 s to register; a run starting while the machine is busy with others
    tries again, after ending the processes of the late start (in its own process: it kills its children)."""
    out = subprocess.run([sys.executable, "-c", RAY_START_RETRY], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "2 True True 0 1"  # the late start's process is gone
