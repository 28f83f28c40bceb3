"""The controller's side of the workers: a Ray placement group of N `ActorRolloutRefWorker` ranks
that the trainer calls as one object. Each call splits its batch across the ranks, runs them
together and gathers the results back in order; a rank that dies or raises fails the call at once
(the others are stopped), so the controller never waits on a collective that cannot finish.

    trainer ── WorkerGroup.update_actor(batch) ──► rank 0: rows of every mini-batch, part 0 ┐ FSDP
                                                   rank 1: rows of every mini-batch, part 1 ┘ all-gather,
                                                                                              reduce-scatter
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import dataclasses
import functools
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from backend.core.config import Config, to_dict, uses_critic
from backend.engine import distributed
from backend.engine.rank import (
    MarkedRows,
    concat_marked,
    out_of_memory,
    python_stacks,
    step_counts,
    use_deterministic_algorithms,
)
from backend.rollout.base import RolloutBatch, SamplingParams, StaleWeightsError, left_pad, right_pad
from backend.rollout.episodes import Episode

Batch = dict[str, torch.Tensor]

# Passed to workers on a cluster (a local Ray inherits this process's environment): the model cache, the
# variables that keep NVLink multicast off on shared multi-GPU hosts, and the CUDA allocator's settings.
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_PASSED_ENV = ("GRPO_WB_CACHE", "HF_HOME", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
               "NVSHMEM_DISABLE_NVLS", "NCCL_DEBUG", *_ALLOC_CONF_VARS)
# glibc's allocator in a rank that computes on the CPU, read as its process starts: one arena for all threads,
# every allocation from it, nothing returned to the system. By default the blocks of 16 MiB and more that a
# thread allocates (a chunk of logits, a layer's gradients) are mapped afresh for each use and every page of
# them faulted in again: the default config's update took 7.5 s that way on the 2-core CPU, 4.4 s with these.
# The rank keeps the memory of its largest phase instead.
CPU_MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
# PyTorch's caching allocator in a rank that computes on a GPU. By default it keeps a block of each size it has
# cut, and micro-batches by tokens change shape every step: the arithmetic recipe reserved 14.7 GiB by step 80
# for 11.0 allocated, outgrowing what the planner packs trials by. Expandable segments map pages into one
# growing segment instead: 11.9 GiB reserved by step 80, with every metric and the time a step unchanged
# (docs/sweeps.md). vLLM's sleep mode refuses them, and a variable the user set is theirs.
GPU_ALLOC_CONF = "expandable_segments:True"
_POLL_S = 0.5
# How long a failed call waits for Ray to report a rank's death before blaming the rank that raised: when one
# rank dies, the others fail at once in their collectives with a connection error, often before Ray notices.
_DEATH_NOTICE_S = 5.0
CRITIC = "critic"  # the critic's shards inside a checkpoint folder
_PLACEMENT_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A worker raised, or its process died; the message names the rank, its process and the call."""


class WorkerOutOfMemory(WorkerError):
    """A rank ran out of memory: which rank, in which call, and (`memory`, from rank.held_at_failure) in which
    of its phases and what its device held then."""

    def __init__(self, who: str, what: str, cause: BaseException):
        self.who, self.what, self.memory = who, what, dict(getattr(cause, "memory", {}))
        m = self.memory
        held = ""
        if "peak_reserved_gib" in m:
            held = (f", {m['peak_reserved_gib']:.2f} GiB reserved at the phase's peak ({m['peak_allocated_gib']:.2f} "
                    f"allocated) of the {m['device_gib']:.2f} GiB of its {m['gpu']}")
        phase = f" (phase {m['phase']}{held})" if m else ""
        super().__init__(f"{who} ran out of memory during {what}{phase}: {type(cause).__name__}: {cause}")


class WorkerStaleWeights(WorkerError):
    """A rank's rollout engine kept weights other than the actor's after a sync: which rank, in which call,
    which engine and which of the actor's tensors."""

    def __init__(self, who: str, what: str, cause: StaleWeightsError):
        self.who, self.what, self.engine, self.tensors = who, what, cause.engine, cause.tensors
        super().__init__(f"{who} failed during {what}: StaleWeightsError: {cause}")


# How long the stacks of a rank may take to come back: a rank that does not answer is stopped, or stuck in
# native code that holds the interpreter's lock.
_STACKS_WAIT_S = 10.0
# A call is suspect once it runs this many times its recent median (and over a minute), or trainer.stall_warning_s.
_STALL_FACTOR, _STALL_FLOOR_S = 5.0, 60.0


@dataclass
class Stall:
    """A call to the ranks that has run far longer than it should: where each process is."""

    what: str  # the call, as the group names it ("the actor update")
    seconds: float
    ranks: list[str]  # a line per rank: where it is, or that it has returned or did not answer
    stacks: str  # every process's Python stacks, the controller's first
    final: bool = False  # trainer.hang_timeout_s has passed: the run fails with this diagnosis
    done: bool = False  # the call has returned after all, `seconds` after it began

    def summary(self) -> str:
        return f"{self.what} has run {self.seconds:.0f} s: " + "; ".join(self.ranks)


class HeadWatch:
    """Watches the Ray head (its GCS port) from a daemon thread.

    Ray ends a driver whose GCS has been unreachable for 60 s, abruptly and without a word, while the
    workers may go on answering until then. Noticing first (`misses` failed connections `interval_s`
    apart) lets the trainer record the failure and stop cleanly: `on_lost(message)` is called once.
    """

    def __init__(self, gcs_address: str, on_lost: Callable[[str], None], interval_s: float = 2.0, misses: int = 5):
        host, port = gcs_address.rsplit(":", 1)
        self.address = (host, int(port))
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(on_lost, interval_s, misses), daemon=True,
                                        name="ray-head-watch")
        self._thread.start()

    def _watch(self, on_lost: Callable[[str], None], interval_s: float, misses: int) -> None:
        missed = 0
        while not self._stop.wait(interval_s):
            try:
                socket.create_connection(self.address, timeout=interval_s).close()
                missed = 0
            except OSError as e:
                missed += 1
                if missed >= misses:
                    self.lost = (f"the Ray head at {self.address[0]}:{self.address[1]} is gone (no answer for "
                                 f"{missed * interval_s:.0f} s: {e}); its workers go with it")
                    on_lost(self.lost)
                    return

    def stop(self) -> None:
        self._stop.set()


RAY_START_ATTEMPTS = 3
_private_ray = False  # whether start_ray started a private Ray in this process


@contextlib.contextmanager
def _own_stop_signal() -> Iterator[None]:
    """Keep this process's SIGTERM handler while Ray starts. ray.init installs two of its own, one that
    raises SystemExit(15) and the head node's, which stops Ray's processes gracefully and raises
    SystemExit(1); a stop during start-up then ended the run `failed`, seconds later. The trainer decides
    how its process ends (the run's final status, then its Ray killed with it), so Ray's are not installed.
    A process without a handler of its own ends at SIGTERM as any program does; Ray's processes share its fate."""
    utils = ray._private.utils
    install = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = install


def gpu_rank_env(cfg: Config) -> dict[str, str]:
    """The environment a GPU rank starts with beyond Ray's: expandable segments for the caching allocator,
    unless the rollout is vLLM's or this process's environment chose the allocator's settings itself."""
    if cfg.actor_rollout_ref.rollout.name == "vllm" or any(v in os.environ for v in _ALLOC_CONF_VARS):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": GPU_ALLOC_CONF}


def start_ray(cfg: Config) -> None:
    """Join `trainer.ray_address`, or start a private Ray in this process (once per process)."""
    if ray.is_initialized():
        return
    with _own_stop_signal():
        _start_ray(cfg)


def _start_ray(cfg: Config) -> None:
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    if cfg.trainer.ray_address:
        import backend

        # The cluster's nodes need our dependencies installed; our own package travels with the job (as its
        # folder: inside a Ray job, Ray copies the runtime env, and a module object cannot be copied).
        package = str(Path(backend.__file__).parent)
        try:
            ray.init(address=cfg.trainer.ray_address, runtime_env={"env_vars": env, "py_modules": [package]},
                     log_to_driver=True)
        except ConnectionError as e:
            raise WorkerError(f"cannot join the Ray cluster at trainer.ray_address={cfg.trainer.ray_address}: {e}. "
                              "Check that `ray start --head` runs there; a cluster started by `ray start` uses token "
                              "authentication, so export RAY_AUTH_MODE=token here with the head's token in "
                              "~/.ray/auth_token (or RAY_AUTH_TOKEN)") from None
        return
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if cfg.trainer.rollout_mode == "async":
        world += cfg.actor_rollout_ref.rollout.n_gpus_per_node
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    # address="local": always a new private instance, even where `ray start` left a cluster address behind.
    # Ray's start-up notices are noise in a run's log; its errors still show. Not prestarting a worker process
    # per core for the first driver: a run's ranks are actors, each started as a new process, so those idle
    # workers ran at most one small task and competed with the ranks' start for the cores, which delays the
    # first step on a small machine.
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world), include_dashboard=False,
                     log_to_driver=True, object_store_memory=512 * 2**20, runtime_env={"env_vars": env},
                     logging_level=logging.ERROR, _system_config={"prestart_worker_first_driver": False})
            global _private_ray
            _private_ray = True
            return
        except Exception as e:
            # Ray waits a fixed 30 s for its new node to register; on a small machine busy starting several
            # runs at once that can run out. The processes of the failed start are ours to end.
            if "timed out during startup" not in str(e) or attempt == RAY_START_ATTEMPTS:
                raise
            end_children()
            ray.shutdown()


def runs_private_ray() -> bool:
    """Whether this process started a private Ray (its processes are this one's children) that still runs."""
    return _private_ray and ray.is_initialized()


def end_children() -> None:
    """Kill every process this one started (a half-started Ray, or a stopped run's) and wait for them.

    Only this process's own children are waited for: a killed grandchild (a Ray worker) stays a zombie
    until whoever adopts it reaps it, seconds later, while SIGKILL has already ended it."""
    import psutil

    me = psutil.Process()
    own, children = me.children(), me.children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(own, timeout=10)


def worker_device(cfg: Config) -> str:
    """cuda when asked, or when `auto` and the Ray cluster has GPUs; else cpu."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


@functools.cache
def _rank_class(cls: type, built_by_start: bool, deterministic: bool = False) -> type:
    """`cls` as a Ray actor with a `start()` that the group calls first, returning `where()`; with
    `deterministic` (trainer.deterministic) its process uses deterministic algorithms from before it is built.

    built_by_start (CPU ranks): the constructor only keeps its arguments and `start()` builds the rank. Ray
    runs an actor's constructor on the process's main thread and, with concurrency groups, its calls on
    another; torch work on both makes two OpenMP thread teams, which on a small machine throttle each
    other's waits (a decode step's small matrix product took twice as long on the 2-core CPU, the default
    config's step 12 s instead of 8). Built by a call, the rank computes on one thread. GPU ranks are built
    by the constructor as before: their work is on the device, and what is built there (vLLM's engine) has
    only run that way."""
    class Rank(cls):
        def __init__(self, *args):
            if deterministic:
                use_deterministic_algorithms()
            if built_by_start:
                self._args = args
            else:
                cls.__init__(self, *args)

        def start(self) -> dict:
            if built_by_start:
                cls.__init__(self, *self._args)
                del self._args
            return self.where()

    Rank.__name__ = Rank.__qualname__ = cls.__name__
    return Rank


@dataclasses.dataclass
class PendingGeneration:
    """A generation started on the rollout workers (trainer.rollout_mode=async) and not yet collected."""

    refs: list
    prompts: list[list[int]]
    params: SamplingParams


class WorkerGroup:
    """`trainer.nnodes x trainer.n_gpus_per_node` ranks, placed together, one torch.distributed group; with
    trainer.rollout_mode=async, `actor_rollout_ref.rollout.n_gpus_per_node` rollout workers beside them, which
    generate while the actor's ranks train and get the weights by broadcast from the actor's rank 0."""

    def __init__(self, cfg: Config, total_steps: int, pad_id: int,
                 on_head_lost: Callable[[str], None] | None = None, on_stall: Callable[[Stall], None] | None = None):
        """on_head_lost(message) runs on the watch thread the moment the Ray head is found gone, before
        the main thread is interrupted: a main thread blocked inside a Ray call may never see the
        interrupt before Ray ends the process, so what must be recorded is recorded there.
        on_stall(stall) runs when a call has run past trainer.stall_warning_s (or five times its recent
        median, once that is over a minute), and again, final, before trainer.hang_timeout_s fails it."""
        from backend.engine.rollout_worker import RolloutWorker
        from backend.engine.workers import ActorRolloutRefWorker

        start_ray(cfg)
        self.cfg = cfg
        self.on_stall = on_stall
        self._durations: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=20))
        self.pad_id = pad_id  # the controller's tokenizer's, for re-padding what the ranks return
        self.world_size = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        self.rollout_world = cfg.actor_rollout_ref.rollout.n_gpus_per_node if cfg.trainer.rollout_mode == "async" else 0
        self.device = worker_device(cfg)
        local = not cfg.trainer.ray_address
        bundles = self.world_size + self.rollout_world
        if self.device == "cuda":
            bundle = {"GPU": cfg.trainer.gpu_share, "CPU": 1}
        else:
            # A private Ray on this machine: the ranks share its cores (each sets its torch threads to its share).
            bundle = {"CPU": max(1, (os.cpu_count() or 1) // bundles) if local else 1}
        self._check_resources(bundle, bundles)
        self.placement = placement_group([bundle] * bundles, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement)
            raise WorkerError(f"Ray could not place {bundles} workers of {bundle} within "
                              f"{_PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {_resources()}") from None
        self._stores: list = []
        master_addr, master_port = self._meeting_point()
        # With a critic or a reward model, each bundle (a GPU, or a share of the cores) holds one rank of
        # each role, colocated as in verl, sharing the bundle's resources equally.
        share = 1.0 / (1 + uses_critic(cfg) + cfg.reward_model.enable)
        transfer = None
        self.rollouts = []
        if self.rollout_world:
            transfer_addr, transfer_port = self._meeting_point()
            transfer = (transfer_addr, transfer_port, self.rollout_world)
            self.rollouts = self._spawn(
                RolloutWorker, bundle, 1.0, transfer_addr, transfer_port,
                lambda r, addr, port: (to_dict(cfg), r, self.rollout_world, addr, port, self.device),
                count=self.rollout_world, first_bundle=self.world_size)
        self.workers = self._spawn(ActorRolloutRefWorker, bundle, share, master_addr, master_port,
                                   lambda r, addr, port: (to_dict(cfg), r, self.world_size, addr, port, self.device,
                                                          total_steps, transfer))
        self.critics = []
        if uses_critic(cfg):
            from backend.engine.critic import CriticWorker

            critic_addr, critic_port = self._meeting_point()
            self.critics = self._spawn(CriticWorker, bundle, share, critic_addr, critic_port,
                                       lambda r, addr, port: (critic_settings(cfg), r, self.world_size, addr, port,
                                                              self.device, total_steps))
        self.reward_models = []
        if cfg.reward_model.enable:
            from backend.engine.reward_model import RewardModelWorker

            rm = cfg.reward_model
            self.reward_models = self._spawn(RewardModelWorker, bundle, share, "", 0, lambda r, addr, port: (
                rm.model.path, rm.micro_batch_size_per_gpu, cfg.actor_rollout_ref.actor.fsdp_config.param_dtype,
                self.device, cfg.data.max_prompt_length + cfg.data.max_response_length))
        # Dropping the group (or the Trainer holding it) stops the ranks and frees their placement.
        self._stop = weakref.finalize(self, _stop, [*self.workers, *self.rollouts, *self.critics,
                                                    *self.reward_models], self.placement)
        # The trainer's main thread learns of a lost head as an interrupt, the way it learns of Ctrl-C.
        def lost(message: str) -> None:
            if on_head_lost is not None:
                on_head_lost(message)
            _thread.interrupt_main()

        self.head = HeadWatch(ray.get_runtime_context().gcs_address, lost)
        self.where: list[dict] = [{"rank": r} for r in range(self.world_size)]
        self.rollout_where: list[dict] = [{"rank": r} for r in range(self.rollout_world)]
        # One call for both: the actor's rank 0 and the rollout workers meet in their group as they start.
        started = self._run([w.start.remote() for w in [*self.workers, *self.rollouts]], "start-up",
                            names=self._names())
        self.where, self.rollout_where = started[:self.world_size], started[self.world_size:]
        self._run([c.start.remote() for c in self.critics], "critic start-up")
        self._run([m.start.remote() for m in self.reward_models], "reward model start-up")

    def _meeting_point(self) -> tuple[str, int]:
        """Where a process group of the ranks meets: a store this controller serves, held as long as the
        group (every node of a Ray cluster reaches the node its driver runs on)."""
        host = ray.util.get_node_ip_address()
        store = distributed.meeting_store(host)
        self._stores.append(store)
        return host, store.port

    def _spawn(self, cls: type, bundle: dict, share: float, addr: str, port: int, args: Callable,
               count: int | None = None, first_bundle: int = 0) -> list:
        """One Ray actor of `cls` per rank (`count`, or the group's world size), rank r in bundle first_bundle + r
        of the placement with `share` of its resources."""
        on_gpu = bool(bundle.get("GPU"))
        remote_cls = ray.remote(concurrency_groups={"monitor": 1})(_rank_class(
            cls, built_by_start=not on_gpu, deterministic=self.cfg.trainer.deterministic))
        return [remote_cls.options(
                    num_cpus=bundle["CPU"] * share, num_gpus=bundle.get("GPU", 0) * share, max_restarts=0,
                    runtime_env={"env_vars": gpu_rank_env(self.cfg) if on_gpu else
                                 {"GLIBC_TUNABLES": CPU_MALLOC_TUNABLES}},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=first_bundle + r),
                ).remote(*args(r, addr, port))
                for r in range(self.world_size if count is None else count)]

    def _check_resources(self, bundle: dict, count: int) -> None:
        have = _resources()
        for name, amount in bundle.items():
            if have.get(name, 0) < amount * count:
                hint = ("lower trainer.n_gpus_per_node x trainer.nnodes, or join a larger cluster with "
                        "trainer.ray_address") if name == "GPU" else "lower trainer.n_gpus_per_node"
                if self.rollout_world:
                    hint = ("train with trainer.rollout_mode=colocated (the rollout engine in the actor's workers), "
                            "lower trainer.n_gpus_per_node or actor_rollout_ref.rollout.n_gpus_per_node, or join a "
                            "larger cluster with trainer.ray_address")
                what = (f"{self.world_size} actor worker(s) and {self.rollout_world} rollout worker(s)"
                        if self.rollout_world else f"{count} worker(s)")
                raise WorkerError(f"this run needs {what} with {amount:g} {name} each, but the Ray cluster has "
                                  f"{have.get(name, 0):g} {name}: {hint}")

    # ---- calling the ranks ----

    def _run(self, refs: list, what: str, progress: Callable | None = None, names: list[str] | None = None,
             reporter=None) -> list:
        """Results of one call on every rank, in rank order. Polls `reporter`'s progress meanwhile (the actor's
        rank 0 unless given); the first rank to fail fails the call, and every rank is stopped (a survivor may
        be blocked in a collective waiting for the dead one). `names`: who each call went to, when not the
        actor's ranks in order."""
        index = {ref: r for r, ref in enumerate(refs)}
        who = (lambda i: names[i]) if names is not None else self._who
        pending = list(refs)
        last = None
        began, stalled = time.monotonic(), None
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            elapsed = time.monotonic() - began
            if pending and stalled is None and elapsed > self._stall_after(what):
                stalled = self._report_stall(what, elapsed)
            timeout = self.cfg.trainer.hang_timeout_s
            if pending and timeout and elapsed > timeout:
                stall = self._report_stall(what, elapsed, final=True)
                self.shutdown()
                raise WorkerError(f"{what} hung: still running after trainer.hang_timeout_s={timeout:g} s. "
                                  f"{'; '.join(stall.ranks)}. Every process's Python stacks are in the run's "
                                  "diagnosis/ folder")
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self.shutdown()
                    if getattr(e, "actor_init_failed", False):
                        raise WorkerError(f"{who(index[ref])} failed during {what}: {_raised(e)}") from None
                    raise WorkerError(f"{who(index[ref])} died during {what}: {_death_reason(e)}") from None
                except ray.exceptions.RayTaskError as e:
                    died = self._death_among([r for r in refs if r is not ref], index)
                    self.shutdown()
                    if died is not None:
                        rank, error = died
                        raise WorkerError(f"{who(rank)} died during {what}: {_death_reason(error)}") from None
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    if out_of_memory(cause):
                        raise WorkerOutOfMemory(who(index[ref]), what, cause) from e
                    if isinstance(cause, StaleWeightsError):
                        raise WorkerStaleWeights(who(index[ref]), what, cause) from e
                    raise WorkerError(f"{who(index[ref])} failed during {what}: "
                                      f"{type(cause).__name__}: {cause}") from e
            if progress is not None and pending:
                state = self._progress(reporter or self.workers[0])
                # rank 0 reports (kind, numbers...); a report left from an earlier call has another kind
                if state and state[0] == what and state != last:
                    progress(*state[1:])
                    last = state
        self._durations[what].append(time.monotonic() - began)
        if stalled is not None and self.on_stall is not None:
            self.on_stall(dataclasses.replace(stalled, seconds=time.monotonic() - began, done=True))
        return ray.get(refs)

    def _stall_after(self, what: str) -> float:
        """Seconds after which a call is suspect: trainer.stall_warning_s, or sooner, five times its recent
        median where that is over a minute (a step's phase that takes 20 s is suspect after 100)."""
        limit = self.cfg.trainer.stall_warning_s
        seen = sorted(self._durations[what])
        if seen:
            limit = min(limit, max(_STALL_FLOOR_S, _STALL_FACTOR * seen[len(seen) // 2]))
        return limit

    def _report_stall(self, what: str, elapsed: float, final: bool = False) -> Stall:
        """Collect where every rank is and pass it to on_stall; the controller's own stack first. A rank whose
        threads run none of our code is idle: it has returned from the call, and the others are awaited."""
        text, _ = python_stacks(skip_current=False)
        stacks = [f"=== controller (pid {os.getpid()} on {socket.gethostname()})\n{text}"]
        ranks = []
        named = [(self._who(r).removeprefix("worker "), w) for r, w in enumerate(self.workers)]
        named += [(f"rollout rank {r}", w) for r, w in enumerate(self.rollouts)]
        named += [(f"critic rank {r}", c) for r, c in enumerate(self.critics)]
        refs = [w.stacks.remote() for _, w in named]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_STACKS_WAIT_S)
        for (name, _), ref in zip(named, refs, strict=True):
            if ref not in ready:
                ranks.append(f"{name}: no answer within {_STACKS_WAIT_S:.0f} s (its process is stopped, or stuck "
                             "in native code holding Python's lock)")
                continue
            try:
                got = ray.get(ref)
            except ray.exceptions.RayError as e:
                ranks.append(f"{name}: gone ({type(e).__name__})")
                continue
            # rank 0 reports (call, numbers...); a report left from an earlier call names another
            progress = f", progress {tuple(got['progress'][1:])}" if got["progress"][:1] == [what] else ""
            ranks.append(f"{name}: " + (f"at {got['at']}{progress}" if got["at"] else "idle (returned)"))
            stacks.append(f"=== {name}\n{got['stacks']}")
        stall = Stall(what, elapsed, ranks, "\n".join(stacks), final)
        if self.on_stall is not None:
            self.on_stall(stall)
        return stall

    @staticmethod
    def _death_among(refs: list, index: dict) -> tuple[int, Exception] | None:
        """The rank, and Ray's error, of one of these calls whose worker died, given up to _DEATH_NOTICE_S
        for Ray to notice; None if none did (a rank failed on its own)."""
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=_DEATH_NOTICE_S) if refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return index[ref], e
            except ray.exceptions.RayTaskError:
                continue
        return None

    def _progress(self, worker) -> tuple:
        try:
            return ray.get(worker.progress.remote(), timeout=5)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            return ()

    def _who(self, rank: int) -> str:
        """'worker rank r (pid p on host)', or '(not started)' before its start-up call has returned."""
        return _named("worker rank", rank, self.where[rank])

    def _names(self) -> list[str]:
        """Who each of the actor's ranks and then each rollout worker is, for a call to all of them."""
        return [*(self._who(r) for r in range(self.world_size)), *self._rollout_names()]

    def _rollout_names(self) -> list[str]:
        return [_named("rollout rank", r, w) for r, w in enumerate(self.rollout_where)]

    def _each(self, method: str, args_per_rank: list[tuple], what: str, progress: Callable | None = None) -> list:
        return self._run([getattr(w, method).remote(*args) for w, args in zip(self.workers, args_per_rank,
                                                                               strict=True)], what, progress)

    def _all(self, method: str, *args, what: str = "") -> list:
        return self._each(method, [args] * self.world_size, what or method)

    # ---- what the trainer calls ----

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> RolloutBatch:
        """n responses per prompt, each rank answering a contiguous share of the prompts (the rollout
        engine interface, so validation and evaluation use the group as they use a local engine): the actor's
        ranks, or with trainer.rollout_mode=async the rollout workers, on the weights they hold."""
        if self.rollouts:
            return self.collect(self.launch(prompts, params), progress)
        args = _generation_shares(prompts, params, self.world_size)
        return self._joined(prompts, params, self._each("generate", args, "generation", _rows_report(
            progress, prompts, params)))

    def launch(self, prompts: list[list[int]], params: SamplingParams) -> PendingGeneration:
        """Start generating on the rollout workers and return at once (trainer.rollout_mode=async)."""
        args = _generation_shares(prompts, params, self.rollout_world)
        return PendingGeneration([w.generate.remote(*a) for w, a in zip(self.rollouts, args, strict=True)],
                                 prompts, params)

    def collect(self, pending: PendingGeneration, progress=None) -> RolloutBatch:
        """The batch a `launch` started, once every rollout worker has answered; its `weights_version` is the
        number of updates in the weights that sampled it."""
        parts = self._run(pending.refs, "generation", _rows_report(progress, pending.prompts, pending.params),
                          names=self._rollout_names(), reporter=self.rollouts[0])
        versions = {p["version"] for p in parts if p}
        if len(versions) != 1:
            raise WorkerError(f"the rollout workers generated one batch from different weights: versions {versions}")
        return dataclasses.replace(self._joined(pending.prompts, pending.params, parts), weights_version=versions.pop())

    def push_weights(self, version: int) -> None:
        """The actor's weights (after `version` updates) to every rollout worker by broadcast from the actor's
        rank 0; each tensor's checksum on every rollout worker is compared with the actor's, so a broadcast that
        left a tensor behind fails here, naming it, before anything samples from it."""
        refs = [w.send_weights.remote() for w in self.workers] + \
               [w.receive_weights.remote(version) for w in self.rollouts]
        results = self._run(refs, "weight broadcast", names=self._names())
        sent = results[0]
        for who, received in zip(self._rollout_names(), results[self.world_size:], strict=True):
            if stale := [name for name in sent if received.get(name) != sent[name]]:
                raise WorkerStaleWeights(who, "weight broadcast", StaleWeightsError("the rollout worker", stale))

    def _joined(self, prompts: list[list[int]], params: SamplingParams, parts: list[dict]) -> RolloutBatch:
        """One batch from the ranks' shares, re-padded with the controller's pad id."""
        parts = [p for p in parts if p]
        pad = self.pad_id
        width = max(p["responses"].shape[1] for p in parts)
        responses = torch.cat([right_pad(list(p["responses"]), width, pad) for p in parts])
        response_mask = torch.cat([right_pad(list(p["response_mask"]), width, 0) for p in parts])
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(params.n)], pad)
        rollout_log_probs = None
        if all("rollout_log_probs" in p for p in parts):  # (B, R) fp32, 0 at padding
            rollout_log_probs = torch.cat([right_pad(list(p["rollout_log_probs"]), width, 0.0) for p in parts])
        return RolloutBatch(
            input_ids=torch.cat([prompt_ids, responses], 1), attention_mask=torch.cat([prompt_mask, response_mask], 1),
            responses=responses, response_mask=response_mask,
            prompt_index=torch.arange(len(prompts)).repeat_interleave(params.n),
            finish_reasons=[f for p in parts for f in p["finish_reasons"]], rollout_log_probs=rollout_log_probs)

    def episodes(self, rows: list[dict], params: SamplingParams, progress=None) -> tuple[list[Episode], float]:
        """One episode per row, each rank playing a contiguous share (the environments run on the ranks);
        and the longest any rank's generation waited on environments, in seconds."""
        args = [(rows[s:s + c], params, s) for s, c in _contiguous(len(rows), self.world_size)]
        parts = self._each("episodes", args, "episodes", progress)
        return [e for episodes, _ in parts for e in episodes], max(waited for _, waited in parts)

    def compute_log_prob(self, batch: Batch, progress=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, R) log-probs under the current policy and the entropy, rows split evenly over the ranks."""
        shards, n = _split_even(batch, self.world_size)
        out = self._each("compute_log_prob", [(s,) for s in shards], "old log-probs")
        return torch.cat([o[0] for o in out])[:n], torch.cat([o[1] for o in out])[:n]

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        shards, n = _split_even(batch, self.world_size)
        return torch.cat(self._each("compute_ref_log_prob", [(s,) for s in shards], "reference log-probs"))[:n]

    def update_actor(self, batch: Batch, mini_rows: int, epochs: int, shuffle: bool,
                     progress=None) -> tuple[dict[str, float], MarkedRows | None]:
        """The PPO update over `epochs` passes of mini-batches of `mini_rows` responses (reshuffled each
        pass when `shuffle`, from the torch RNG the trainer seeds per step). Every mini-batch is split
        evenly across the ranks, so the optimizer steps are the same for any number of ranks. Returns the
        metrics and, for rows marked with `token_row`, what the update computed of them (every rank's, in
        mark order)."""
        args = update_shards(batch, mini_rows, epochs, shuffle, self.world_size)
        results = self._each("update_actor", args, "the actor update", progress)
        return _merge([metrics for metrics, _ in results]), concat_marked([marked for _, marked in results])

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """(B, R) critic values of the state before each response token, rows split evenly over the ranks."""
        shards, n = _split_even(batch, self.world_size)
        refs = [c.compute_values.remote(s) for c, s in zip(self.critics, shards, strict=True)]
        return torch.cat(self._run(refs, "critic values"))[:n]

    def score_with_reward_model(self, messages: list[list[dict]], responses: list[str]) -> list[float]:
        """The reward model's score of each response, each rank scoring a contiguous share."""
        refs = [m.score.remote(messages[s:s + c], responses[s:s + c])
                for m, (s, c) in zip(self.reward_models, _contiguous(len(responses), len(self.reward_models)),
                                     strict=True) if c]
        return [x for part in self._run(refs, "reward model scoring") for x in part]

    def update_critic(self, batch: Batch, mini_rows: int, epochs: int, shuffle: bool) -> dict[str, float]:
        """The value-model update, in mini-batches of `mini_rows` responses split evenly across the ranks,
        as `update_actor` does."""
        args = update_shards(batch, mini_rows, epochs, shuffle, self.world_size)
        refs = [c.update_critic.remote(*a) for c, a in zip(self.critics, args, strict=True)]
        return _merge(self._run(refs, "the critic update"))

    def save_checkpoint(self, folder: Path) -> None:
        self._all("save_checkpoint", str(folder), what="checkpoint save")
        if self.critics:
            self._run([c.save_checkpoint.remote(str(folder / CRITIC)) for c in self.critics], "critic checkpoint save")

    def load_checkpoint(self, folder: Path) -> None:
        self._all("load_checkpoint", str(folder), what=f"loading checkpoint {folder}")
        if self.critics:
            self._run([c.load_checkpoint.remote(str(folder / CRITIC)) for c in self.critics],
                      f"loading the critic checkpoint {folder / CRITIC}")

    def export(self, folder: Path) -> None:
        self._all("export", str(folder), what="export")

    def attach_debugger(self, rank: int, port: int) -> tuple[str, int]:
        """Start debugpy in worker `rank`; returns (host, port) for the client. `wait_for_debugger` blocks."""
        return self._run([self.workers[rank].debug_listen.remote(port)], "debugger start")[0]

    def wait_for_debugger(self, rank: int, heartbeat: Callable[[], None]) -> None:
        """Block until a client attaches to worker `rank`, calling `heartbeat` meanwhile."""
        ref = self.workers[rank].debug_wait.remote()
        while not ray.wait([ref], timeout=_POLL_S)[0]:
            heartbeat()
        self._run([ref], "waiting for the debugger")

    def freeze_heap(self) -> list[int]:
        """workers.freeze_heap in every actor and critic rank, for a run whose first step has compiled and
        cached what it keeps; how many objects each froze."""
        return self._run([w.freeze_heap.remote() for w in [*self.workers, *self.critics]], "freezing the heap")

    def shutdown(self) -> None:
        """Stop every rank and release the placement group; safe to call twice. With the head gone
        there is nothing to ask (and asking would block): the ranks have gone with it."""
        self.head.stop()
        if self.head.lost:
            self._stop.detach()
            return
        self._stop()


def _named(role: str, rank: int, where: dict) -> str:
    place = f"pid {where['pid']} on {where['host']}" if "pid" in where else "not started"
    return f"{role} {rank} ({place})"


def _generation_shares(prompts: list[list[int]], params: SamplingParams, ranks: int) -> list[tuple]:
    """Each rank's (prompts, params, first row): a contiguous share, the first row its global row id."""
    return [(prompts[s:s + c], params, s * params.n) for s, c in _contiguous(len(prompts), ranks)]


def _rows_report(progress: Callable | None, prompts: list, params: SamplingParams) -> Callable | None:
    """Rank 0's progress (rows done of its share, tokens) as the whole batch's rows."""
    if progress is None:
        return None
    return lambda done, rows, tokens, most: progress(done, len(prompts) * params.n, tokens, most)


def _stop(workers: list, placement) -> None:
    if not ray.is_initialized():
        return
    for w in workers:
        ray.kill(w, no_restart=True)
    ray.util.remove_placement_group(placement)


def update_shards(batch: Batch, mini_rows: int, epochs: int, shuffle: bool, world_size: int
                  ) -> list[tuple[Batch, int, list[tuple[float, float]]]]:
    """Each rank's rows of an update, in optimizer-step order, its rows per mini-batch, and each mini-batch's
    valid tokens and non-empty responses over all ranks (what the losses divide by: rank.step_counts).

    `epochs` passes over the batch (a new permutation per pass when `shuffle`) in mini-batches of
    `mini_rows`; rank r gets part r of every mini-batch. A batch smaller than one mini-batch (DAPO's
    dynamic sampling may keep fewer groups after its last round) is one smaller optimizer step, not none.
    """
    total = batch["responses"].shape[0]
    mini_rows = min(mini_rows, max(total - total % world_size, world_size))
    local_rows = mini_rows // world_size
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    minis = []
    for _ in range(epochs):
        order = torch.randperm(total) if shuffle else torch.arange(total)
        for m in range(total // mini_rows):
            mini = order[m * mini_rows:(m + 1) * mini_rows]
            minis.append(mini)
            for r in range(world_size):
                per_rank[r].append(mini[r * local_rows:(r + 1) * local_rows])
    counts = step_counts(batch["response_mask"][torch.cat(minis)], mini_rows)
    return [({k: v[torch.cat(idx)] for k, v in batch.items()}, local_rows, counts) for idx in per_rank]


def _merge(results: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from every rank's: the largest memory peak and the largest of each `*_max`, the mean
    of everything else."""
    merged = {}
    for key in results[0]:
        values = [r[key] for r in results if key in r]
        merged[key] = max(values) if key.startswith("perf/") or key.endswith("_max") else sum(values) / len(values)
    return merged


def critic_settings(cfg: Config) -> dict:
    """The critic worker's settings (backend.engine.critic.REQUIRED_KEYS) from the run config."""
    c, actor = cfg.critic, cfg.actor_rollout_ref.actor
    return {"model_path": c.model.path or cfg.actor_rollout_ref.model.path,
            "enable_gradient_checkpointing": c.model.enable_gradient_checkpointing, "lr": c.optim.lr,
            "betas": list(c.optim.betas), "weight_decay": c.optim.weight_decay,
            "lr_warmup_steps": c.optim.lr_warmup_steps, "grad_clip": c.grad_clip, "cliprange_value": c.cliprange_value,
            "ppo_micro_batch_size_per_gpu": c.ppo_micro_batch_size_per_gpu, "use_dynamic_bsz": c.use_dynamic_bsz,
            "ppo_max_token_len_per_gpu": c.ppo_max_token_len_per_gpu, "loss_agg_mode": c.loss_agg_mode,
            "param_dtype": c.fsdp_config.param_dtype, "offload_policy": c.fsdp_config.offload_policy,
            "use_torch_compile": actor.use_torch_compile, "seed": cfg.trainer.seed,
            # null divides by the generation limit, a constant (verl pads every batch to that width)
            "loss_scale_factor": c.loss_scale_factor or cfg.data.max_response_length}


def _contiguous(n: int, parts: int) -> list[tuple[int, int]]:
    """(first, count) of each of `parts` contiguous shares of n items, as even as they come."""
    counts = [n // parts + (1 if r < n % parts else 0) for r in range(parts)]
    return [(sum(counts[:r]), c) for r, c in enumerate(counts)]


def _split_even(batch: Batch, parts: int) -> tuple[list[Batch], int]:
    """Equal row counts for every rank (the last row repeated to fill), since sharded forward passes
    are collective and every rank must run as many as the others; returns the shards and the real count."""
    n = next(iter(batch.values())).shape[0]
    per = math.ceil(n / parts)
    index = torch.arange(per * parts).clamp(max=n - 1)
    return [{k: v[index[r * per:(r + 1) * per]] for k, v in batch.items()} for r in range(parts)], n


def _resources() -> dict:
    return {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}


def _raised(error: Exception) -> str:
    """The exception a rank's constructor raised, from Ray's report of it: the traceback's last line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else type(error).__name__


def _death_reason(error: Exception) -> str:
    text = str(error).strip().splitlines()
    reason = next((line.strip() for line in text if "exit" in line.lower() or "killed" in line.lower()
                   or "memory" in line.lower()), text[0] if text else type(error).__name__)
    return f"the worker process ended ({reason[:300]})"
