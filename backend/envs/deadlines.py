"""Calls bounded by a deadline on a few reused daemon threads: how an episode batch runs its environment
steps. A thread started per call (as `tool_calls.call_with_timeout` does for one tool call) costs about what
a light environment's whole step does, and a batch steps hundreds of environments at each turn's end."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Outcome:
    """How a call ended: its value, or the exception it raised, or timed_out; seconds from its start."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclass
class _Job:
    fn: Callable[[], Any]
    then: Callable[[Outcome], Any]
    future: concurrent.futures.Future
    started: float = 0.0

    def finish(self, outcome: Outcome) -> None:
        try:
            self.future.set_result(self.then(outcome))
        except BaseException as e:  # our own continuation failed: the waiter sees it through the future
            self.future.set_exception(e)


class DeadlinePool:
    """Runs `fn()` on one of `workers` daemon threads and hands its `Outcome` to `then` exactly once: when fn
    returns or raises, or, if it has not within timeout_s of starting, as timed out. The thread of a call
    that timed out is given up (left to finish or hang; a daemon never keeps the process alive) and a new
    one takes its place, so a hanging environment costs a thread, not the batch."""

    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._running: dict[threading.Thread, _Job] = {}
        self._workers = 0
        self._closed = False
        for _ in range(workers):
            self._add_worker()
        threading.Thread(target=self._watch, name="deadlines", daemon=True).start()

    def submit(self, fn: Callable[[], Any], then: Callable[[Outcome], T]) -> concurrent.futures.Future[T]:
        """A future of `then(outcome of fn())`."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put(_Job(fn, then, future))
        return future

    def close(self) -> None:
        """Let the threads end once the queued calls are done; does not wait for them."""
        with self._lock:
            self._closed = True
            workers = self._workers
            self._lock.notify()
        for _ in range(workers):
            self._jobs.put(None)

    def __enter__(self) -> DeadlinePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_worker(self) -> None:
        self._workers += 1
        threading.Thread(target=self._work, name="environment", daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        while (job := self._jobs.get()) is not None:
            with self._lock:
                job.started = time.monotonic()
                if not self._running:
                    self._lock.notify()  # the watchdog sleeps without a deadline while nothing runs
                self._running[me] = job
            try:
                outcome = Outcome(value=job.fn())
            except BaseException as e:  # handed on as data: an environment must never end the run
                outcome = Outcome(error=e)
            with self._lock:
                if self._running.pop(me, None) is None:
                    return  # answered as timed out meanwhile, and replaced
            outcome.seconds = time.monotonic() - job.started
            job.finish(outcome)

    def _watch(self) -> None:
        # Calls start in queue order with the same time limit, so the earliest deadline is the longest-running
        # call's: one wait per deadline, not per call.
        with self._lock:
            while not self._closed:
                if not self._running:
                    self._lock.wait()
                    continue
                thread, job = min(self._running.items(), key=lambda item: item[1].started)
                left = job.started + self.timeout_s - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                del self._running[thread]
                self._workers -= 1
                if not self._closed:
                    self._add_worker()
                self._lock.release()
                try:
                    job.finish(Outcome(timed_out=True, seconds=time.monotonic() - job.started))
                finally:
                    self._lock.acquire()
