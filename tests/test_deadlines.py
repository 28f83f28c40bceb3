"""The pool environment steps run on: each call answered once, a hung call given up at its deadline without
holding up the others or the process."""

import subprocess
import sys
import threading
import time

import pytest

from backend.envs.deadlines import DeadlinePool, Outcome


def test_values_and_exceptions_come_back_as_outcomes_with_their_time():
    with DeadlinePool(2, timeout_s=5) as pool:
        fine = pool.submit(lambda: time.sleep(0.05) or 7, lambda o: o)
        broken = pool.submit(lambda: 1 / 0, lambda o: o)
        fine, broken = fine.result(5), broken.result(5)
    assert (fine.value, fine.error, fine.timed_out) == (7, None, False) and fine.seconds >= 0.05
    assert isinstance(broken.error, ZeroDivisionError) and not broken.timed_out


def test_a_hung_call_is_answered_as_timed_out_once_and_its_thread_replaced():
    release = threading.Event()
    answers: list[Outcome] = []
    with DeadlinePool(1, timeout_s=0.3) as pool:
        hung = pool.submit(lambda: release.wait(10) and "late", lambda o: answers.append(o) or o)
        # One worker: the next call can only run on the thread that replaces the hung one.
        after = pool.submit(lambda: "next", lambda o: o.value)
        start = time.monotonic()
        outcome = hung.result(5)
        assert outcome.timed_out and outcome.value is None and 0.3 <= outcome.seconds < 2
        assert after.result(5) == "next" and time.monotonic() - start < 2
        release.set()  # the given-up call now returns: its late value must not be answered again
        time.sleep(0.2)
    assert len(answers) == 1


def test_a_failing_continuation_reaches_the_waiter():
    with DeadlinePool(1, timeout_s=5) as pool:
        future = pool.submit(lambda: 1, lambda o: {}["missing"])
        with pytest.raises(KeyError):
            future.result(5)


def test_a_call_that_never_returns_does_not_keep_the_process_alive():
    code = ("import time\nfrom backend.envs.deadlines import DeadlinePool\n"
            "with DeadlinePool(2, timeout_s=0.2) as pool:\n"
            "    print(pool.submit(lambda: time.sleep(600), lambda o: o.timed_out).result(5))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
