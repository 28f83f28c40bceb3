"""The workbench under load: N tiny runs launched from the Runs page back to back while M tabs keep
reloading the dashboard on them, in headless Chromium against the real app. Reports how long each page
load took while the runs trained, and whether every run finished with all its metrics.

    python bench/ui_load.py            # 8 runs, 4 tabs; prints a table, writes bench/results/<date>-cpu-ui-load.json
    python bench/ui_load.py --runs 4 --tabs 2

A page load is from navigating to the Runs page until the selected run's dashboard is drawn and Streamlit
reports the script run finished. On a 2-core machine the runs, their Rays and the browser share the cores,
so these figures say what a user sees on such a machine, not what the page costs alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from backend.core.runs import read_metrics  # noqa: E402
from backend.services.launcher import list_runs  # noqa: E402
from tests.browser import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    fresh_workspace,
    go,
    launch_from_runs_page,
    open_page,
    select_option,
    start_server,
    stop_runs_and_server,
    use_tiny_config,
)

ENDED = ("succeeded", "failed", "stopped")


def measure(n_runs: int, n_tabs: int, steps: int, deadline_s: float) -> dict:
    from playwright.sync_api import sync_playwright

    home = fresh_workspace(Path(tempfile.mkdtemp(prefix="ui-load-")))
    server, url = start_server(home)
    loads: list[float] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = open_page(browser, url)
            use_tiny_config(page, steps=steps)
            go(page, "Runs")
            for i in range(n_runs):
                launch_from_runs_page(page, f"load-{i}")
            runs = list_runs(home / "runs")
            tabs = [open_page(browser, url, timeout_s=300) for _ in range(n_tabs)]
            until = time.time() + deadline_s
            while time.time() < until:
                for tab, run in zip(tabs, runs[::max(1, n_runs // n_tabs)], strict=False):
                    start = time.perf_counter()
                    tab.goto(f"{url}/runs")
                    tab.wait_for_selector("[data-testid='stSidebarNav']")
                    select_option(tab, "runs_selected", run.name)
                    loads.append(time.perf_counter() - start)
                if all(r.state in ENDED for r in list_runs(home / "runs")):
                    break
            browser.close()
    finally:
        stop_runs_and_server(home, server)
    finished = list_runs(home / "runs")
    complete = [r.state == "succeeded" and [m["step"] for m in read_metrics(r.path)] == list(range(1, steps + 1))
                for r in finished]
    return {"runs": n_runs, "tabs": n_tabs, "steps": steps, "runs_complete": sum(complete), "page_loads": len(loads),
            "median_load_s": round(statistics.median(loads), 2) if loads else None,
            "slowest_load_s": round(max(loads), 2) if loads else None,
            "loads_over_2s": sum(t > 2 for t in loads), "states": [r.state for r in finished]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--tabs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds to wait for every run to end")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / f"{date.today()}-cpu-ui-load.json")
    args = parser.parse_args()
    result = measure(args.runs, args.tabs, args.steps, args.deadline)
    print(f"{'runs':>5} {'tabs':>5} {'complete':>9} {'loads':>6} {'median s':>9} {'slowest s':>10} {'over 2 s':>9}")
    print(f"{result['runs']:>5} {result['tabs']:>5} {result['runs_complete']:>9} {result['page_loads']:>6} "
          f"{result['median_load_s']!s:>9} {result['slowest_load_s']!s:>10} {result['loads_over_2s']:>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
