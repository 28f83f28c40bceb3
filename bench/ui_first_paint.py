"""Time to first paint of each workbench page, and of a 1,000,000-row parquet preview, in headless
Chromium against the real app (`streamlit run app/main.py` on a free localhost port).

    python bench/ui_first_paint.py            # prints a table, writes bench/results/<date>-cpu-ui.json

"First paint" here is what a user waits for: from the click (or the path typed) until the page's
content is drawn and Streamlit reports the script run finished. Each figure is the median of 3.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from preview_1m import make_table  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
DONE = "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')"


def start_app(workspace: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(REPO / "app/main.py"), "--server.port", str(port),
         "--server.headless", "true"], cwd=workspace, env={**os.environ, "GRPO_WB_HOME": str(workspace)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return server, url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("streamlit did not start")


def main() -> None:
    from playwright.sync_api import sync_playwright

    workspace = Path(tempfile.mkdtemp(prefix="ui-bench-"))
    for folder in ("sample_data", "configs", ".streamlit"):
        shutil.copytree(REPO / folder, workspace / folder, ignore=shutil.ignore_patterns("saved"))
    (workspace / "data").mkdir()
    pq.write_table(make_table(1_000_000), workspace / "data/big.parquet", row_group_size=122_880)
    server, url = start_app(workspace)
    timings: dict[str, list[float]] = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            for _ in range(3):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(120_000)
                start = time.perf_counter()
                page.goto(url)
                page.get_by_role("heading", name="Config").first.wait_for()
                page.wait_for_function(DONE)
                timings.setdefault("Config (first load of the app)", []).append(time.perf_counter() - start)
                for title in ("Data", "Runs", "Config"):
                    start = time.perf_counter()
                    page.locator("[data-testid='stSidebarNav'] a", has_text=title).first.click()
                    page.get_by_role("heading", name=title).first.wait_for()
                    page.wait_for_timeout(100)
                    page.wait_for_function(DONE)
                    timings.setdefault(title, []).append(time.perf_counter() - start)
                page.locator("[data-testid='stSidebarNav'] a", has_text="Data").first.click()
                page.wait_for_function(DONE)
                box = page.locator(".st-key-data_path_input input")
                box.fill("data/big.parquet")
                start = time.perf_counter()
                box.press("Enter")
                page.get_by_text("1,000,000").first.wait_for()
                page.wait_for_function(DONE)
                timings.setdefault("Data: 1M-row parquet preview", []).append(time.perf_counter() - start)
                page.close()
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=20)
    rows = {name: round(statistics.median(values), 2) for name, values in timings.items()}
    print(f"| {'page':<34} | {'median s':>8} |")
    print(f"|{'-' * 36}|{'-' * 10}|")
    for name, value in rows.items():
        print(f"| {name:<34} | {value:>8} |")
    out = REPO / "bench/results" / f"{time.strftime('%Y-%m-%d')}-cpu-ui.json"
    out.write_text(json.dumps({"median_s": rows, "all_s": timings, "repeats": 3}, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
