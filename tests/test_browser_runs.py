"""The Runs page in headless Chromium (tests/browser.py serves the real workbench): what the selected run
is doing and its controls come before its charts, Stop answers at once and ends a starting run as stopped,
Resume asks for a step beyond the last, and a fork gets a readable name and the latest checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from backend.core.runs import read_status
from backend.services.launcher import list_runs, stop

from .browser import (
    CHROMIUM,
    SCRIPT_STATE,
    chart_points,
    expect,
    go,
    key,
    launch_from_runs_page,
    select_option,
    settle,
    use_tiny_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not "
                                                     "installed (make test installs it with apt-get)")]


def open_run(page, name: str) -> None:
    go(page, "Runs")
    select_option(page, "runs_selected", name)


def top(locator) -> float:
    locator.first.wait_for()
    return locator.first.bounding_box()["y"]


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_a_failed_runs_state_error_and_controls_sit_above_its_charts(page, finished_run, workspace):
    # The finished run's metrics and config, as a run that then failed would leave them.
    broken = workspace / "runs" / "20260101-000001-broken"
    broken.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy(finished_run / name, broken / name)
    status = {**read_status(finished_run), "state": "failed", "stage": "failed", "pid": None,
              "error": "WorkerError: worker rank 0 (pid 1 on vm) died during generation: out of memory",
              "warnings": ["step 2: 1 of 1 optimizer step(s) met a non-finite loss or gradient norm: skipped"]}
    (broken / "status.json").write_text(json.dumps(status))
    open_run(page, broken.name)
    charts = page.locator(".js-plotly-plot")
    wait_until(lambda: chart_points(page) > 0, 30, "the charts")
    first_chart = top(charts)
    for what in (page.locator("strong", has_text="failed"), page.get_by_text("died during generation"),
                 page.get_by_text("met a non-finite loss"), page.locator(f"{key('run_stop')} button"),
                 page.locator(f"{key('run_resume')} button"), page.get_by_role("button", name="Fork")):
        assert top(what) < first_chart, what


def test_resume_offers_a_step_beyond_the_last_and_refuses_one_that_is_not(page, finished_run):
    open_run(page, finished_run.name)  # trained to step 3 of 3, checkpoints every step
    train_to = page.locator("[class*='st-key-resume_total_steps'] input")
    assert int(train_to.input_value()) > 3
    before = read_status(finished_run)
    train_to.fill("3")
    train_to.press("Enter")
    settle(page)
    page.locator(f"{key('run_resume')} button").click()
    settle(page)
    expect(page.get_by_text(re.compile("has trained to step 3.*would train nothing"))).to_be_visible()
    assert read_status(finished_run) == before  # nothing started


def test_a_fork_is_named_after_its_parent_and_starts_from_the_latest_checkpoint(page, finished_run, workspace):
    open_run(page, finished_run.name)
    page.get_by_role("button", name="Fork").click()
    fork_dialog = page.get_by_role("dialog", name="Fork")
    # checkpoints step_2 and step_3: the latest is offered
    expect(fork_dialog.get_by_role("combobox", name="Checkpoint")).to_have_value("step_3")
    name = fork_dialog.get_by_role("textbox", name="Name of the fork")
    assert name.input_value() == f"{finished_run.name}-fork-3"
    page.locator(f"{key('fork_button')} button").click()
    settle(page)
    expect(page.get_by_text(f"Forked into {finished_run.name}-fork-3")).to_be_visible()
    fork = workspace / "runs" / f"{finished_run.name}-fork-3"
    try:
        status = read_status(fork)
        assert status["forked_from"]["checkpoint"].endswith("step_3")
        assert status["forked_from"]["run"] == finished_run.name
    finally:
        stop(fork)


# Holds the run's first scoring, so that no step can finish before the page shows the stop it offers: on a
# loaded machine the page's script run after "starting" has come after a whole tiny run had ended.
FIRST_SCORE_HELD = """
import time

held = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not held:
        held.append(True)
        time.sleep(120)
    return 0.0
"""


def test_stop_while_a_run_starts_answers_at_once_and_ends_it_stopped(page, workspace):
    reward = workspace / "first_score_held.py"
    reward.write_text(FIRST_SCORE_HELD)
    use_tiny_config(page, steps=30, extra=f"custom_reward_function:\n  path: {reward}\n")
    go(page, "Runs")
    launch_from_runs_page(page, "stop-early")
    run = next(r.path for r in list_runs(workspace / "runs") if r.name.endswith("stop-early"))
    page.get_by_text(re.compile(r"starting (Ray|1 worker)")).first.wait_for(timeout=120_000)
    # The caption comes from the page's own script run, which on a loaded machine can end after the run has
    # started its first step; the stop is still one before any step has finished, with nothing to keep.
    expect(page.get_by_text("Stop loses only the step in progress: no step has finished yet")).to_be_visible()
    assert read_status(run)["step"] == 0
    ended = {}

    def watch_status() -> None:
        wait_until(lambda: read_status(run)["state"] not in ("queued", "running"), 30, "the run to end")
        ended["after"] = time.monotonic() - clicked

    watcher = threading.Thread(target=watch_status)
    page.locator(f"{key('run_stop')} button").click()
    clicked = time.monotonic()
    watcher.start()
    answer = page.get_by_text(re.compile("Stop requested|stopping…")).or_(page.locator("strong", has_text="stopped"))
    answer.first.wait_for(timeout=30_000)
    answered = time.monotonic() - clicked
    wait_until(lambda: page.evaluate(SCRIPT_STATE) == "notRunning", 30, "the click's script run to end")
    script_run = time.monotonic() - clicked
    watcher.join()
    status, ended = read_status(run), ended["after"]
    print(f"\nstop while starting: the page answered after {answered:.2f} s, its script run ended after "
          f"{script_run:.2f} s, status.json said {status['state']} after {ended:.2f} s")
    # Bounds a busy two-core machine keeps, well under the 12.5 s the page once waited for the process to end
    assert answered < 5 and script_run < 5
    assert status["state"] == "stopped" and ended < 10
    assert not status.get("error") and not status.get("traceback")
    expect(page.locator("strong", has_text="stopped")).to_be_visible()
    expect(page.get_by_text(re.compile("Traceback|SystemExit"))).to_have_count(0)
