"""A newcomer's first ten minutes in the real workbench (headless Chromium, tests/browser.py): the app always
shows that it is working, the Data page follows the config, a first run draws its first point, the plan is for
this machine, and Compare explains blank answers. Each test prints the time it measured (docs/performance.md
reports them); none asserts a time, which would fail on a busy machine and prove nothing about the code."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from backend.core.models import resolve_model
from backend.services import planner
from backend.services.launcher import list_runs, stop

from .browser import (
    CHROMIUM,
    TINY_YAML,
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
    silences,
    start_server,
    stop_runs_and_server,
    watch_for_silence,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not "
                                                     "installed (make test installs it with apt-get)")]

# About 2 s of DuckDB work on this 2-core machine: 2,000 x 2,000 x 20 rows.
SLOW_SQL = "SELECT sum(length(a.data_source || b.data_source)) FROM data a, data b, (SELECT 1 FROM data LIMIT 20) c"
# A laptop's screen: a sign of work counts only where the user can see it (the fixture's page is 2,200 px tall).
SCREEN = {"width": 1400, "height": 900}


def apply_yaml(page, text: str) -> None:
    set_text(page, "config_yaml", text)
    page.locator(f"{key('config_apply_yaml')} button").click()
    settle(page)


def test_a_first_data_visit_with_an_empty_model_cache_draws_the_page_first_and_says_what_it_loads(browser, tmp_path):
    home = fresh_workspace(tmp_path / "home")
    server, url = start_server(home, GRPO_WB_CACHE=str(tmp_path / "cache"))
    try:
        page = open_page(browser, url)
        page.set_viewport_size(SCREEN)
        watch_for_silence(page)
        start = time.perf_counter()
        page.locator("[data-testid='stSidebarNav'] a", has_text="Data").first.click()
        # While the tokenizer is built, the rest of the page is already there and the section says what it waits for.
        page.wait_for_function("""() => ['Loading the tokenizer of tiny-qwen3', 'SQL (read-only)', 'Reward playground']
                                  .every(text => document.body.innerText.includes(text))""", timeout=30_000)
        settle(page)
        silent, busy = silences(page)
        print(f"\nfirst Data visit, empty model cache: complete after {busy:.1f} s "
              f"({time.perf_counter() - start:.1f} s to settle), longest silence {silent:.1f} s")
        assert silent <= 1.0
        expect(page.get_by_text(re.compile("over data.max_prompt_length=128"))).to_be_visible()
        page.context.close()
    finally:
        stop_runs_and_server(home, server)


def test_the_data_page_completes_with_the_configs_model_and_prompt_length(page):
    apply_yaml(page, TINY_YAML.format(steps=2).replace("tiny-qwen3", "tiny-llama")
               .replace("max_prompt_length: 128", "max_prompt_length: 96"))
    page.set_viewport_size(SCREEN)
    watch_for_silence(page)
    go(page, "Data")
    silent, busy = silences(page)
    print(f"\nData page, warm model cache: complete after {busy:.1f} s, longest silence {silent:.1f} s")
    expect(page.locator(f"{key('data_model_name')} input")).to_have_value("tiny-llama")
    expect(page.locator(f"{key('data_max_prompt_length')} input")).to_have_value("96")
    expect(page.get_by_text(re.compile("over data.max_prompt_length=96"))).to_be_visible()


def test_a_slow_query_shows_that_it_runs(page):
    go(page, "Data")
    set_text(page, "sql_input", SLOW_SQL)
    page.set_viewport_size(SCREEN)
    watch_for_silence(page)
    page.locator(f"{key('sql_run')} button").click()
    settle(page)
    silent, busy = silences(page)
    print(f"\nslow query: {busy:.1f} s, longest silence {silent:.1f} s")
    assert busy > 1.0, "the query was too quick to prove anything"
    assert silent <= 1.0
    expect(page.get_by_text("1 row", exact=True)).to_be_visible()


# The estimate's unit follows this machine's measured speed: a faster CPU puts the SmolLM2 preset under 90 s.
ESTIMATE = r"about (\d+ (s|min)|\d+\.\d h) here"


def test_the_landing_page_names_the_quick_try_and_how_long_the_smollm2_presets_take_here(browser, workspace):
    resolve_model("smollm2-135m-instruct")  # the estimate waits for the model to be made, whichever test ran first
    server, url = start_server(workspace)  # its own: a server of this module may hold the estimate from before
    try:
        page = open_page(browser, url)
        expect(page.get_by_text("New here?")).to_be_visible()
        settle(page)  # the estimates come last
        expect(page.get_by_text(re.compile(r"Quick try \(tiny random model\), loaded below: .* tiny-qwen3, 30 steps: "
                                           + ESTIMATE))).to_be_visible()
        expect(page.get_by_text(re.compile(r"GRPO on the arithmetic sample: SmolLM2-135M-Instruct, .* "
                                           r"smollm2-135m-instruct, 20 steps: " + ESTIMATE))).to_be_visible()
        page.context.close()
    finally:
        stop_runs_and_server(workspace, server)


def test_a_first_run_from_the_landing_page_draws_its_first_chart_point(page, workspace):
    go(page, "Runs")
    start = time.perf_counter()
    launch_from_runs_page(page, "first")
    deadline = start + 120
    while time.perf_counter() < deadline and chart_points(page) < 1:
        page.wait_for_timeout(250)
    first_point, drawn = time.perf_counter() - start, chart_points(page)
    print(f"\nfirst run from the landing page: first chart point {first_point:.1f} s after Launch")
    for run in list_runs(workspace / "runs"):
        if run.state in ("queued", "running"):
            stop(Path(run.path), grace_s=5)
    assert drawn >= 1, f"no chart point {first_point:.0f} s after Launch"


def test_the_plan_panel_plans_for_this_machine(page):
    page.get_by_text("Will it fit? Memory and time plan").click()
    settle(page)
    verdict = page.locator("[data-testid='stExpander'] [data-testid='stAlert']").first
    gpu = planner.visible_gpu()
    if gpu is None:  # its CPU and memory, not a GPU it does not have
        expect(verdict).to_contain_text(re.compile(r"GiB on this machine$"))
        expect(verdict).not_to_contain_text(re.compile("h200", re.I))
    else:
        expect(verdict).to_contain_text(gpu.name)


def test_compare_explains_blank_answers_and_defaults_to_the_base_model_and_the_opened_runs_export(
        page, finished_run, workspace):
    # A newer run with an export of its own (a copy of the finished one): the newest export, not the one opened.
    other = workspace / "runs" / "20260102-000000-other"
    if not other.exists():
        shutil.copytree(finished_run, other)
        status = json.loads((other / "status.json").read_text())
        status["started"] = status.get("started", time.time()) + 3600
        (other / "status.json").write_text(json.dumps(status))
    go(page, "Runs")
    select_option(page, "runs_selected", finished_run.name)
    go(page, "Compare")
    expect(page.get_by_role("combobox", name="Model").first).to_have_value("tiny-qwen3 (shipped)")
    expect(page.get_by_role("combobox", name="Model").nth(1)).to_have_value(f"run {finished_run.name} · export")
    page.locator(f"{key('compare_go')} button").click()
    settle(page)
    expect(page.get_by_text(re.compile(r"The answer is \d+ newlines, nothing else")).first).to_be_visible()
