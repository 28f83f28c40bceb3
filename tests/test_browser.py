"""The real workbench in headless Chromium (tests/browser.py starts it and drives it): each page used as a
user would. With GRPO_WB_SCREENSHOTS=docs/screenshots they refresh the docs' screenshots of each page."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from backend.core.runs import read_metrics
from backend.services.launcher import list_runs, read_run, stop

from .browser import (
    CHROMIUM,
    chart_points,
    expect,
    fresh_workspace,
    go,
    key,
    launch_from_runs_page,
    open_page,
    select_option,
    set_text,
    settle,
    shot,
    start_server,
    stop_runs_and_server,
    use_tiny_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not "
                                                     "installed (make test installs it with apt-get)")]


def test_config_page_shows_the_engines_validation_next_to_an_edited_field(page):
    field = page.locator(f"{key('cfg_actor_rollout_ref__actor__ppo_mini_batch_size')} input")
    field.fill("3")
    field.press("Enter")
    settle(page)
    page.get_by_text("is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=3").first.wait_for()
    page.locator("h1").first.scroll_into_view_if_needed()
    shot(page, "config")
    field.fill("4")
    field.press("Enter")
    settle(page)
    expect(page.get_by_text("is not divisible by")).to_have_count(0)


def test_data_page_previews_a_parquet_file_and_runs_a_query(page):
    go(page, "Data")
    page.get_by_text("2000").first.wait_for()
    set_text(page, "sql_input", "SELECT count(*) AS n FROM data WHERE data_source = 'arithmetic'")
    page.locator(f"{key('sql_run')} button").click()
    settle(page)
    page.get_by_text("2000").first.wait_for()
    set_text(page, "sql_input", "COPY data TO '/tmp/stolen.csv'")
    page.locator(f"{key('sql_run')} button").click()
    settle(page)
    assert not Path("/tmp/stolen.csv").exists()
    shot(page, "data")


def test_launch_watch_stop_and_fork_a_tiny_run(page, workspace):
    use_tiny_config(page, steps=300)
    go(page, "Runs")
    launch_from_runs_page(page, "browser")

    # the live chart gains points while the run goes on, without reloading the page
    deadline = time.time() + 180
    first = 0
    while time.time() < deadline and (first := chart_points(page)) < 2:
        page.wait_for_timeout(1000)
    assert first >= 2, "no chart points appeared"
    deadline = time.time() + 60
    while time.time() < deadline and chart_points(page) <= first:
        page.wait_for_timeout(1000)
    assert chart_points(page) > first
    shot(page, "runs")

    # A click that lands while a refresh redraws the page can be dropped, as for a person; click again, but
    # only while the button is live: a run that is stopping (its workers shutting down) disables it.
    for _ in range(3):
        stop_button = page.locator(f"{key('run_stop')} button")
        if stop_button.is_enabled():
            stop_button.click()
            settle(page)
        deadline = time.time() + 30
        while time.time() < deadline and (run := list_runs(workspace / "runs")[0]).state != "stopped":
            time.sleep(1)
        if run.state == "stopped":
            break
    assert run.state == "stopped" and run.checkpoints

    page.get_by_role("button", name="Fork").click()
    page.locator(f"{key('fork_button')} button").click()
    settle(page)
    page.get_by_text("Forked into").first.wait_for()
    deadline = time.time() + 120
    while time.time() < deadline:
        forks = [r for r in list_runs(workspace / "runs") if r.name != run.name]
        if forks and forks[0].step > run.step:
            break
        time.sleep(1)
    assert forks and forks[0].step > int(run.checkpoints[-1].split("_")[1])
    stop(Path(forks[0].path), grace_s=5)


def test_rollouts_of_a_finished_run_filter_and_token_view(page, finished_run):
    go(page, "Rollouts")
    select_option(page, "rollouts_run", finished_run.name)
    page.get_by_text("Step").first.wait_for()
    groups_before = page.locator("[data-testid='stExpander']").count()
    assert groups_before > 0
    set_text(page, "rollouts_search", "no-such-text-anywhere")
    # the filtered page can land a moment after the run that settle() waited for: wait for the count itself
    expect(page.locator("[data-testid='stExpander']")).not_to_have_count(groups_before)
    assert page.locator("[data-testid='stExpander']").count() < groups_before
    set_text(page, "rollouts_search", "")
    expect(page.locator("[data-testid='stExpander']")).to_have_count(groups_before)
    page.locator(f"{key('rollouts_quantity')} label", has_text="KL").first.click()
    settle(page)
    page.locator("span[title]").first.wait_for()
    shot(page, "rollouts")


def test_ab_compare_of_two_tiny_models_and_export_of_a_checkpoint(page, finished_run, workspace):
    from transformers import AutoModelForCausalLM

    go(page, "Compare")
    set_text(page, "compare_path_a", str((finished_run / "export").relative_to(workspace)))
    page.get_by_role("tab", name="Data file").click()
    set_text(page, "compare_limit", "4")
    page.locator(f"{key('compare_batch_go')} button").click()
    settle(page)
    page.get_by_text("pass@").first.wait_for()
    shot(page, "compare")

    page.get_by_role("tab", name="Evaluate and export a run").click()
    select_option(page, "evalx_run", finished_run.name)
    set_text(page, "evalx_export_name", "tiny-step2")
    page.locator(f"{key('evalx_export')} button").click()
    settle(page)
    exported = next((workspace / "exports").glob("tiny-step2*"))
    assert AutoModelForCausalLM.from_pretrained(exported) is not None


def test_a_run_outlives_a_restart_of_the_workbench_and_the_new_one_shows_it(browser, tmp_path):
    home = fresh_workspace(tmp_path / "home")
    server, url = start_server(home)
    try:
        page = open_page(browser, url)
        use_tiny_config(page, steps=30)
        go(page, "Runs")
        launch_from_runs_page(page, "survivor")
        page.context.close()
        [run] = list_runs(home / "runs")
        deadline = time.time() + 180
        while time.time() < deadline and not read_metrics(run.path):
            time.sleep(1)
        assert read_metrics(run.path), "the run wrote no metrics"
    finally:
        server.terminate()
        server.wait(timeout=20)
    # The workbench is down: the run is its own process and goes on.
    seen = len(read_metrics(run.path))
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(run.path)) <= seen:
        time.sleep(1)
    assert len(read_metrics(run.path)) > seen
    server, url = start_server(home)
    try:
        page = open_page(browser, url)
        go(page, "Runs")
        # the new server finds the run on disk and shows its live state line
        page.get_by_text(re.compile(r"step \d+/30")).first.wait_for(timeout=60_000)
        deadline = time.time() + 60
        while time.time() < deadline and chart_points(page) < 2:
            page.wait_for_timeout(1000)
        assert chart_points(page) >= 2  # the new server reads the run directory and draws it
        deadline = time.time() + 240
        while time.time() < deadline and read_run(run.path)["status"].get("state") != "succeeded":
            time.sleep(1)
        assert read_run(run.path)["status"]["state"] == "succeeded"
        assert [m["step"] for m in read_metrics(run.path)] == list(range(1, 31))
        page.context.close()
    finally:
        stop_runs_and_server(home, server)


def test_runs_launched_back_to_back_all_finish_while_two_tabs_watch_them(browser, tmp_path):
    """Two tiny runs launched from the UI one after the other, the dashboard reloaded on them in two tabs
    meanwhile: every run finishes with every metrics line, and every page load draws the dashboard.
    bench/ui_load.py measures the page times under more runs and tabs."""
    home = fresh_workspace(tmp_path / "home")
    steps = 2
    server, url = start_server(home)
    try:
        page = open_page(browser, url)
        use_tiny_config(page, steps=steps)
        go(page, "Runs")
        for i in range(2):
            launch_from_runs_page(page, f"load-{i}")
        runs = list_runs(home / "runs")
        assert len(runs) == 2
        # The launching tab is one of the two: a third, left on its live dashboard, would only add load.
        tabs = [page, open_page(browser, url, timeout_s=300)]

        def all_ended() -> bool:
            return all(r.state in ("succeeded", "failed", "stopped") for r in list_runs(home / "runs"))

        # Each tab reloads its run's dashboard about once a second, as someone watching might; reloading without
        # a pause spent the cores on the browser that the two runs needed (bench/ui_load.py loads it harder).
        deadline = time.time() + 600
        while time.time() < deadline and not all_ended():
            for tab, run in zip(tabs, runs, strict=False):
                tab.goto(f"{url}/runs")
                tab.wait_for_selector("[data-testid='stSidebarNav']")
                select_option(tab, "runs_selected", run.name)
                tab.wait_for_timeout(1000)
        for tab in tabs:
            tab.context.close()
    finally:
        stop_runs_and_server(home, server)
    finished = list_runs(home / "runs")
    assert sorted(r.state for r in finished) == ["succeeded"] * 2, [(r.name, r.state, r.error) for r in finished]
    for run in finished:
        assert [m["step"] for m in read_metrics(run.path)] == list(range(1, steps + 1)), run.name
