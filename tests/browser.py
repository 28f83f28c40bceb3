"""What the browser tests share: the real workbench (`streamlit run app/main.py` on a free localhost port, in
a fresh workspace folder) driven by Playwright against Debian's /usr/bin/chromium, and the steps a user
takes on its pages. The fixtures reach every test through tests/conftest.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from backend.services.launcher import list_runs, stop

REPO = Path(__file__).resolve().parents[1]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]

TINY_YAML = """\
data:
  train_files: [sample_data/arithmetic_train.parquet]
  val_files: [sample_data/arithmetic_val.parquet]
  train_batch_size: 2
  val_max_samples: 4
  max_prompt_length: 128
  max_response_length: 8
actor_rollout_ref:
  model:
    path: tiny-qwen3
  actor:
    optim:
      lr: 0.001
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 4
  rollout:
    n: 4
trainer:
  total_training_steps: {steps}
  save_freq: 2
  test_freq: 0
  device: cpu
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_workspace(root: Path) -> Path:
    """A workbench home at `root` with the repository's sample data, presets and Streamlit settings."""
    for folder in ("sample_data", "configs", ".streamlit"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("saved"))
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return fresh_workspace(tmp_path_factory.mktemp("workspace"))


def start_server(workspace: Path, **env_vars: str) -> tuple[subprocess.Popen, str]:
    """`streamlit run app/main.py` on a free port with `workspace` as the workbench's home (and `env_vars` in its
    environment); waits until it answers."""
    port = free_port()
    env = {**os.environ, "GRPO_WB_HOME": str(workspace), **env_vars}
    with open(workspace / "streamlit.log", "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(REPO / "app/main.py"), "--server.port", str(port),
             "--server.headless", "true", "--server.address", "127.0.0.1"],
            cwd=workspace, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    pytest.fail("streamlit did not start:\n" + (workspace / "streamlit.log").read_text())


def stop_runs_and_server(workspace: Path, server: subprocess.Popen) -> None:
    for run in list_runs(workspace / "runs"):
        if run.state in ("queued", "running"):
            stop(Path(run.path), grace_s=5)
    server.terminate()
    server.wait(timeout=20)


@pytest.fixture(scope="module")
def app_url(workspace):
    server, url = start_server(workspace)
    yield url
    stop_runs_and_server(workspace, server)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import expect as playwright_expect
    from playwright.sync_api import sync_playwright

    # expect() waits up to 30 s rather than Playwright's 5 s: the suite runs two files at once on two cores, and a
    # page's first script run on a fresh server, or a redraw while a run trains beside it, can take longer than 5 s
    # there. A wait that holds returns at once, so only a failure waits the whole time.
    playwright_expect.set_options(timeout=30_000)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, url: str, timeout_s: float = 60):
    """A new browser context on the workbench, once its page navigation has drawn."""
    context = browser.new_context(viewport={"width": 1400, "height": 2200})
    pg = context.new_page()
    pg.set_default_timeout(timeout_s * 1000)
    pg.goto(url)
    pg.wait_for_selector("[data-testid='stSidebarNav']")
    return pg


@pytest.fixture
def page(browser, app_url):
    pg = open_page(browser, app_url)
    yield pg
    pg.context.close()


def expect(locator):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def key(name: str) -> str:
    """Streamlit gives every widget with key=K a container with class st-key-K."""
    return f".st-key-{name}"


SCRIPT_STATE = "() => document.querySelector('[data-testid=\"stApp\"]')?.dataset.testScriptState || ''"


def settle(page, timeout_s: float = 120) -> None:
    """Wait until Streamlit has finished the script run (or fragment run) the last action started. It reads the
    app's own run state (stApp's data-test-script-state), not the running indicator, which shows only after
    half a second of a run. Idle must be seen twice 200 ms apart: a click's run can start a moment after the
    first look."""
    page.wait_for_timeout(300)
    deadline = time.time() + timeout_s
    idle = 0
    while idle < 2:
        state = page.evaluate(SCRIPT_STATE)
        if time.time() > deadline:
            raise AssertionError(f"the page was still {state!r} after {timeout_s:.0f} s")
        idle = idle + 1 if state in ("notRunning", "compilationError") else 0
        page.wait_for_timeout(200)


# What tells a user the app is working: the running indicator (top right, shown once a run has taken half a
# second), a spinner, a progress bar, or an st.status that is still running.
SIGNS_OF_WORK = ", ".join(f"[data-testid='{t}']" for t in (
    "stStatusWidget", "stSpinner", "stProgress", "stExpanderIconSpinner"))
WATCH = """() => {
  clearInterval(window.__watch?.timer);
  const inView = el => { const r = el.getBoundingClientRect();
                         return r.width > 0 && r.height > 0 && r.bottom > 0 && r.top < window.innerHeight; };
  const log = [];
  const sample = () => {
    const state = document.querySelector('[data-testid="stApp"]')?.dataset.testScriptState || '';
    log.push([performance.now(), state === 'running' || state === 'rerunRequested',
              [...document.querySelectorAll(SIGNS)].some(inView)]);
  };
  window.__watch = {start: performance.now(), log, timer: setInterval(sample, 100)};
  sample();
}""".replace("SIGNS", repr(SIGNS_OF_WORK))


def watch_for_silence(page) -> None:
    """Sample every 100 ms, from now on, whether a script run is going and whether a sign of work is in view."""
    page.evaluate(WATCH)


def silences(page) -> tuple[float, float]:
    """Since watch_for_silence: (the longest stretch, in seconds, in which a run went on with no sign of work
    in view; seconds from the start of the watch to the end of the last run seen)."""
    log, start = page.evaluate("() => [window.__watch.log, window.__watch.start]")
    longest, quiet_since, last_busy = 0.0, None, start
    for t, running, sign in log:
        if running:
            last_busy = t
        if running and not sign:
            quiet_since = t if quiet_since is None else quiet_since
            longest = max(longest, t - quiet_since)
        else:
            quiet_since = None
    return longest / 1000, (last_busy - start) / 1000


def go(page, title: str) -> None:
    page.locator("[data-testid='stSidebarNav'] a", has_text=title).first.click()
    settle(page)


def set_text(page, widget_key: str, text: str) -> None:
    box = page.locator(f"{key(widget_key)} textarea, {key(widget_key)} input").first
    box.fill(text)
    # A text area commits on Ctrl+Enter, a text input on Enter.
    box.press("Control+Enter" if box.evaluate("e => e.tagName") == "TEXTAREA" else "Enter")
    settle(page)


def use_tiny_config(page, steps: int, extra: str = "") -> None:
    """Put the tiny model's config, `steps` steps long (and `extra`, more top-level YAML sections), into the
    Config page's editor and apply it, until the form's fields show it: a click that lands while a refresh
    redraws the page can be dropped, and a run launched then trains the default config (SmolLM2, seen once
    in a fresh clone's run)."""
    model = page.locator(f"{key('cfg_actor_rollout_ref__model__path')} input")
    total = page.locator(f"{key('cfg_trainer__total_training_steps')} input")
    for _ in range(3):
        set_text(page, "config_yaml", TINY_YAML.format(steps=steps) + extra)
        page.locator(f"{key('config_apply_yaml')} button").click()
        settle(page)
        if model.input_value() == "tiny-qwen3" and total.input_value() == str(steps):
            return
    raise AssertionError(f"the Config page did not take the tiny config: model {model.input_value()!r}, "
                         f"steps {total.input_value()!r}")


def launch_from_runs_page(page, name: str) -> None:
    set_text(page, "launch_name", name)
    page.locator(f"{key('launch_button')} button").click()
    settle(page)
    # twice expect's usual wait: the load test launches eight runs, and each redraw waits its turn for the CPU
    expect(page.get_by_text(re.compile(f"Launched .*{name}$")).first).to_be_visible(timeout=60_000)


def shot(page, name: str) -> None:
    """A full-page screenshot into the folder GRPO_WB_SCREENSHOTS names (docs/screenshots to refresh the docs'
    pictures); none without it, so a test run leaves the checkout as it found it."""
    folder = os.environ.get("GRPO_WB_SCREENSHOTS")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    page.locator("h1").first.scroll_into_view_if_needed()
    page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def chart_points(page) -> int:
    return page.locator(".js-plotly-plot").first.locator(".scatterlayer .points path").count()


@pytest.fixture(scope="module")
def finished_run(workspace, sample_sets) -> Path:
    """A finished 3-step tiny-model run inside the app's workspace, with token logs and checkpoints."""
    from backend.core.config import load_config
    from backend.engine.trainer import Trainer

    from .conftest import tiny_overrides

    run_dir = workspace / "runs" / "20260101-000000-tiny"
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.total_training_steps": 3,
                                                          "trainer.save_freq": 1}))
    Trainer(cfg, run_dir, show_progress=False).train()
    return run_dir


def select_option(page, widget_key: str, text: str, timeout_s: float = 120) -> None:
    """Pick the first option containing `text`. A rerun of the page (a run that finished, a new metrics
    line) redraws the select box and closes its open list, so the list is opened again until the pick
    lands."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.time() + timeout_s
    while True:
        settle(page)
        page.locator(f"{key(widget_key)} input[role='combobox']").click()
        try:
            page.get_by_role("option").filter(has_text=text).first.click(timeout=10_000)
            break
        except PlaywrightTimeout:
            if time.time() > deadline:
                raise
            page.keyboard.press("Escape")
    settle(page)


