"""Time the data page's backend calls (backend.services.preview) on a verl-shaped parquet of a million rows.
Prints a table and writes the numbers to bench/results/<date>-cpu-preview.json.

    python bench/preview_1m.py                 # 1,000,000 rows
    python bench/preview_1m.py --rows 200000 --tokenizer tiny-qwen3

The file is built column by column with pyarrow (no Python dict per row) in a temporary folder, with
row groups of 122,880 rows (DuckDB's own size; pyarrow's default would put all rows in one group and
leave DuckDB a single thread). Every call is timed on a freshly opened Preview except where noted;
the median of --repeat runs is reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backend.services import preview  # noqa: E402

SOURCES = ["arithmetic", "openai/gsm8k", "lighteval/MATH"]


def _array(values) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def make_table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    a = pa.array(rng.integers(1, 100, n)).cast(pa.string())
    b = pa.array(rng.integers(1, 100, n)).cast(pa.string())
    ops = pa.array(np.where(rng.random(n) < 0.5, " + ", " - "))
    # Prompts of varied length, as a real set has: a sentence repeated 1-4 times.
    question = pc.binary_join_element_wise("What is ", a, ops, b, "?", "")
    repeats = rng.integers(1, 5, n)
    pads = np.array(["", " Think it through.", " Think it through." * 2, " Think it through." * 3])
    padding = pa.array(pads[repeats - 1])
    content = _array(pc.binary_join_element_wise(question, padding, " Answer with the final number after '####'.", ""))
    truth = pa.array(rng.integers(-99, 200, n)).cast(pa.string())
    # every 100th row without ground truth, so presence counting has something to find
    truth = _array(pc.if_else(pa.array(np.arange(n) % 100 == 99), pa.scalar(None, pa.string()), truth))

    messages = pa.StructArray.from_arrays([pa.array(np.full(n, "user")), content], names=["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), messages)
    source_idx = pa.array(rng.choice(len(SOURCES), n, p=[0.6, 0.3, 0.1]), pa.int32())
    return pa.table({
        "data_source": pa.DictionaryArray.from_arrays(source_idx, pa.array(SOURCES)).cast(pa.string()),
        "prompt": prompt,
        "ability": pa.array(np.full(n, "math")),
        "reward_model": pa.StructArray.from_arrays([pa.array(np.full(n, "rule")), truth],
                                                   names=["style", "ground_truth"]),
        "extra_info": pa.StructArray.from_arrays([pa.array(np.full(n, "train")), pa.array(np.arange(n))],
                                                 names=["split", "index"]),
    })


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokenizer", default="", help="also time token lengths of the 2000-prompt sample "
                                                   "(a shipped model name, e.g. tiny-qwen3)")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/<date>-cpu-preview.json)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "verl_1m.parquet"
        t0 = time.perf_counter()
        table = make_table(args.rows)
        pq.write_table(table, path, row_group_size=122_880)
        build_s = time.perf_counter() - t0
        del table
        size_mb = path.stat().st_size / 1e6

        results: dict[str, float] = {}
        samples: dict[str, object] = {}

        def on_fresh(call):
            def run():
                with preview.open_parquet(path) as pv:
                    return call(pv)
            return run

        calls = {
            "open_parquet": lambda: preview.open_parquet(path).close(),
            "open + schema": on_fresh(lambda pv: pv.schema()),
            "open + row_count": on_fresh(lambda pv: pv.row_count()),
            "open + head(20)": on_fresh(lambda pv: pv.head(20)),
            "open + data_source_counts": on_fresh(lambda pv: pv.data_source_counts()),
            "open + ground_truth_presence": on_fresh(lambda pv: pv.ground_truth_presence()),
            "open + prompt_texts(2000)": on_fresh(lambda pv: len(pv.prompt_texts(2000))),
            "open + query(default SQL)": on_fresh(
                lambda pv: pv.query("SELECT data_source, count(*) FROM data GROUP BY 1")[1]),
            "open + query(avg prompt chars)": on_fresh(
                lambda pv: pv.query("SELECT avg(length(prompt[1].content)) FROM data")[1]),
            "open + score_reference_answers(head 50)": on_fresh(
                lambda pv: preview.score_reference_answers(pv.head(50))["full_marks"]),
        }
        calls["page summary (open, schema, count, head, counts, presence)"] = on_fresh(lambda pv: (
            pv.schema(), pv.row_count(), pv.head(20), pv.data_source_counts(), pv.ground_truth_presence()))
        for name, call in calls.items():
            results[name], samples[name] = timed(call, args.repeat)

        if args.tokenizer:
            from backend.core.models import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
            with preview.open_parquet(path) as pv:
                texts = pv.prompt_texts(2000)
            name = f"token_length_histogram(2000 prompts, {args.tokenizer})"
            results[name], hist = timed(lambda: preview.token_length_histogram(texts, tokenizer, 256), args.repeat)
            samples[name] = {k: hist[k] for k in ("n", "max", "mean", "n_over")}

    width = max(len(k) for k in results)
    print(f"{args.rows:,} rows, {size_mb:.1f} MB parquet (built in {build_s:.1f} s), {os.cpu_count()} CPUs, "
          f"median of {args.repeat}")
    print(f"{'call'.ljust(width)}  seconds  result")
    for name, seconds in results.items():
        shown = repr(samples[name])
        print(f"{name.ljust(width)}  {seconds:7.3f}  {shown[:60]}")

    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{dt.date.today():%Y-%m-%d}-cpu-preview.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "rows": args.rows,
        "file_mb": round(size_mb, 1),
        "row_groups_of": 122_880,
        "build_s": round(build_s, 2),
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "python": platform.python_version(),
        "duckdb": preview.duckdb.__version__,
        "pyarrow": pa.__version__,
        "median_s": {k: round(v, 4) for k, v in results.items()},
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
