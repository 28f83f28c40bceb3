"""CPU the workbench itself uses while a tab sits on the Runs page, which refreshes its live parts every 3 s:
the Streamlit server's and the browser's CPU seconds over a window, with Streamlit's garbage collection after
every script run on (its default) and off (our .streamlit/config.toml). Four finished runs from docs/runs/
are on the page (one selected, its charts drawn).

    python bench/ui_idle_cpu.py [--seconds 30]     # prints a table, writes bench/results/<date>-cpu-ui-idle.json

On a 2-core machine every CPU second the UI spends here is taken from training runs, and makes its own
pages answer later when runs train.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from ui_first_paint import CHROMIUM_ARGS, DONE, start_app  # noqa: E402

RUNS = ("arithmetic-grpo", "arithmetic-rloo", "arithmetic-dapo", "arithmetic-ppo")


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(workspace: Path, post_script_gc: bool, seconds: float) -> dict:
    from playwright.sync_api import sync_playwright

    config = workspace / ".streamlit/config.toml"
    text = (REPO / ".streamlit/config.toml").read_text()
    config.write_text(re.sub(r"(?m)^postScriptGC = .*$", f"postScriptGC = {str(post_script_gc).lower()}", text))
    server, url = start_app(workspace)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{url}/runs")
            page.get_by_role("heading", name="Runs").first.wait_for()
            page.wait_for_function(DONE)
            page.wait_for_timeout(5000)
            me = psutil.Process()
            browser_procs = [c for c in me.children(recursive=True) if c.pid != server.pid]
            srv = [psutil.Process(server.pid)]
            s0, b0 = cpu_seconds(srv), cpu_seconds(browser_procs)
            time.sleep(seconds)
            s1, b1 = cpu_seconds(srv), cpu_seconds(browser_procs)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"post_script_gc": post_script_gc, "seconds": seconds, "server_cpu_s": round(s1 - s0, 2),
            "browser_cpu_s": round(b1 - b0, 2), "cores_used": round((s1 - s0 + b1 - b0) / seconds, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    workspace = Path(tempfile.mkdtemp(prefix="ui-idle-"))
    for folder in ("sample_data", "configs", ".streamlit"):
        shutil.copytree(REPO / folder, workspace / folder, ignore=shutil.ignore_patterns("saved"))
    for run in RUNS:
        shutil.copytree(REPO / "docs/runs" / run, workspace / "runs" / run)
    rows = [measure(workspace, gc, args.seconds) for gc in (True, False)]
    print(f"\nover {args.seconds:.0f} s on the Runs page")
    print(f"{'runner.postScriptGC':>20} {'server CPU s':>13} {'browser CPU s':>14} {'cores':>6}")
    for r in rows:
        print(f"{str(r['post_script_gc']).lower():>20} {r['server_cpu_s']:>13} {r['browser_cpu_s']:>14} "
              f"{r['cores_used']:>6}")
    out = Path(args.out) if args.out else REPO / "bench/results" / f"{time.strftime('%Y-%m-%d')}-cpu-ui-idle.json"
    out.write_text(json.dumps({"command": "python bench/ui_idle_cpu.py", "runs_on_page": list(RUNS),
                               "rows": rows}, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
