"""The Sweeps page in headless Chromium (tests/browser.py serves the real workbench): a sweep of the tiny config
over two learning rates starts from the page, its trials run as ordinary runs and fill the table, and the best
trial's config goes to the Config page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend.services import sweeps
from backend.services.launcher import list_runs

from .browser import CHROMIUM, expect, go, key, set_text, settle, use_tiny_config
from .conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not "
                                                     "installed (make test installs it with apt-get)")]


def test_a_sweep_started_from_the_page_runs_its_trials_and_promotes_the_best(page, workspace):
    use_tiny_config(page, steps=2)
    go(page, "Sweeps")
    set_text(page, "sweep_keys", "actor_rollout_ref.actor.optim.lr=1e-6,1e-3")
    set_text(page, "sweep_metric", "actor/lr")
    set_text(page, "sweep_name", "browser-lr")
    page.locator(f"{key('sweep_start')} button").click()
    settle(page)
    expect(page.get_by_text("Started browser-lr: 2 trials")).to_be_visible()

    folder = workspace / "runs" / "sweeps" / "browser-lr"
    try:
        wait_for(lambda: sweeps.read_sweep(folder)["state"].get("state") == "finished", timeout=300)
    finally:  # a sweep still going when the test fails stops its trials and starts no more
        sweeps.request_stop(folder)
    trials = sweeps.read_sweep(folder)["trials"]
    assert [t.state for t in trials] == ["complete", "complete"]
    assert {s.path for s in list_runs(workspace / "runs")} >= {Path(t.run) for t in trials}
    # The page refreshes itself: the table and the summary show the finished sweep without a click.
    expect(page.get_by_text(re.compile(r"finished, 2 of 2 trials ended.*best so far #1"))).to_be_visible()

    page.locator(f"{key('sweep_promote')} button").click()
    settle(page)
    expect(page.get_by_text("The Config page now holds trial #1's config")).to_be_visible()
    go(page, "Config")
    lr = page.locator(f"{key('cfg_actor_rollout_ref__actor__optim__lr')} input")
    expect(lr).to_have_value(re.compile(r"^0\.001(0*)$|^1e-03$|^1\.0*e-3$"))
