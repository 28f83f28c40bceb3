"""Looking at a parquet file before training on it: schema, counts, first rows, read-only SQL, prompt
token lengths, a reward playground, and the problems the engine would reject the file for.

A `Preview` holds an in-memory DuckDB connection with one view, `data`, over `read_parquet(path)`; the
file is scanned by DuckDB, never loaded whole into Python, so a million-row file answers in about a
second. The connection is sealed once the view exists: external access off for everything but that
one file, extension loading off, configuration locked. User SQL goes through `Preview.query`, which
also refuses anything but one SELECT over `data` before DuckDB runs it.

Every failure is a `PreviewError` whose message names the file and what is wrong; the data page shows
it as is. The page calls these functions and draws the results; nothing here imports Streamlit.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from backend.core import data, workspace
from backend.rewards.registry import RewardError, get_scorer, load_custom_reward
from backend.rewards.rules import (
    GSM8K_DATA_SOURCES,
    MATH_DATA_SOURCES,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
)
from backend.rewards.scoring import score_batch

__all__ = [
    "PreviewError",
    "Preview",
    "open_parquet",
    "check_sql",
    "render_prompt",
    "display_columns",
    "token_length_histogram",
    "reference_answer",
    "score_response",
    "score_reference_answers",
    "file_problems",
]

# Table functions a query may call: they make rows from values, never from files.
ALLOWED_TABLE_FUNCTIONS = frozenset({"unnest", "range", "generate_series"})
# Functions that read files (or other databases); refused wherever they appear, with a clear message.
# The sealed connection would refuse the file access anyway; this check only explains it first.
_FILE_FUNCTIONS = re.compile(
    r"^(read_\w+|\w+_scan|glob|sniff_csv|parquet_\w+|iceberg_\w+|delta_\w+|sqlite_\w+|postgres_\w+|"
    r"mysql_\w+|load_\w+|copy_\w+|export_\w+)$",
    re.IGNORECASE,
)
_FIRST_KEYWORDS = ("select", "with", "from", "values")
_QUERY_TIMEOUT_S = 30.0
_SCORE_TIMEOUT_S = 5.0


class PreviewError(ValueError):
    """A file or query the preview cannot answer; the message names the file and what is wrong."""


# ---- opening a file ----


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def open_parquet(path: str | Path) -> Preview:
    """A `Preview` of one parquet file; `PreviewError` naming the file when it is missing or not parquet."""
    p = Path(path)
    if not p.exists():
        raise PreviewError(f"{path}: file not found")
    if p.is_dir():
        raise PreviewError(f"{path} is a directory; pick one parquet file")
    try:
        metadata = pq.read_metadata(p)
        num_rows = metadata.num_rows
        arrow_schema = metadata.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise PreviewError(f"{path} is not a readable parquet file ({e})") from None
    resolved = str(p.resolve())
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET python_enable_replacements = false")  # no scanning of Python variables by name
        con.execute("SET allowed_paths = ?", [[resolved]])
        con.execute(f"CREATE VIEW data AS SELECT * FROM read_parquet({_sql_string(resolved)})")
        # Sealed from here on: the view re-reads its one allowed file, and nothing else can be reached
        # (no other file, no COPY target, no ATTACH, no extension) nor re-enabled.
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        columns = [(str(r[0]), str(r[1])) for r in con.execute("DESCRIBE data").fetchall()]
    except duckdb.Error as e:
        con.close()
        raise PreviewError(f"{path}: DuckDB cannot read it ({_first_line(e)})") from None
    return Preview(p, con, num_rows, columns, arrow_schema)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.split("\n\n", 1)[0].strip() or type(e).__name__


# Row groups a prompt sample is drawn from, at most.
_SAMPLE_GROUPS = 8


class Preview:
    """A sealed DuckDB view `data` over one parquet file. Use as a context manager, or call `close()`."""

    def __init__(self, path: Path, con: duckdb.DuckDBPyConnection, num_rows: int,
                 columns: list[tuple[str, str]], arrow_schema: pa.Schema) -> None:
        self.path = path
        self._con = con
        self._num_rows = int(num_rows)
        self._columns = columns
        self._arrow_schema = arrow_schema
        self._lock = threading.Lock()  # one DuckDB connection: one statement at a time

    def __enter__(self) -> Preview:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._con.close()

    # ---- what the file holds ----

    def schema(self) -> list[tuple[str, str]]:
        """(column name, DuckDB type) for each top-level column, in file order."""
        return list(self._columns)

    def has_column(self, name: str) -> bool:
        return any(c == name for c, _ in self._columns)

    def row_count(self) -> int:
        """Rows in the file, from the parquet footer (no scan)."""
        return self._num_rows

    def head(self, n: int = 20) -> list[dict[str, Any]]:
        """The first `n` rows as Python dicts (nested structs become dicts, lists stay lists)."""
        columns, rows = self._run(f"SELECT * FROM data LIMIT {max(0, int(n))}")
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def data_source_counts(self, limit: int = 100) -> list[tuple[str | None, int]]:
        """(data_source, rows) for the `limit` most common data sources; [] without that column."""
        if not self.has_column("data_source"):
            return []
        _, rows = self._run(
            "SELECT CAST(data_source AS VARCHAR) AS ds, count(*) AS n FROM data "
            f"GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT {max(1, int(limit))}"
        )
        return [(r[0], int(r[1])) for r in rows]

    def ground_truth_presence(self) -> dict[str, Any]:
        """How many rows carry a non-empty ground truth, overall and per column the engine reads.

        Keys: rows, with_ground_truth, without_ground_truth, by_column ({"reward_model.ground_truth": k,
        "ground_truth": k, "answer": k} for the columns that exist).
        """
        exprs: dict[str, str] = {}
        if "reward_model" in self._arrow_schema.names:
            rm_type = self._arrow_schema.field("reward_model").type
            if pa.types.is_struct(rm_type) and rm_type.get_field_index("ground_truth") >= 0:
                exprs["reward_model.ground_truth"] = "reward_model.ground_truth"
        for column in ("ground_truth", "answer"):
            if column in self._arrow_schema.names:
                exprs[column] = _quote_ident(column)
        if not exprs:
            return {"rows": self._num_rows, "with_ground_truth": 0, "without_ground_truth": self._num_rows,
                    "by_column": {}}
        present = {k: f"NULLIF(TRIM(CAST({e} AS VARCHAR)), '')" for k, e in exprs.items()}
        selects = [f"count({p})" for p in present.values()]
        selects.append(f"count(coalesce({', '.join(present.values())}))")
        _, rows = self._run(f"SELECT {', '.join(selects)} FROM data")
        counts = [int(v) for v in rows[0]]
        total = counts[-1]
        return {"rows": self._num_rows, "with_ground_truth": total, "without_ground_truth": self._num_rows - total,
                "by_column": dict(zip(present, counts[:-1], strict=True))}

    def prompt_texts(self, limit: int = 2000) -> list[Any]:
        """Up to `limit` prompts (message lists or strings) for length statistics; [] without a prompt column.

        All of them when the file has no more rows; otherwise a fixed-seed sample (the same file gives the
        same sample) from a few row groups spread over the file (enough to hold twice the sample, at most
        `_SAMPLE_GROUPS`), so a file of gigabytes of prompts is not read whole to draw a histogram of 2,000.
        """
        if not self.has_column("prompt") or limit < 1:
            return []
        if self._num_rows <= limit:
            _, rows = self._run("SELECT prompt FROM data")
            return [r[0] for r in rows]
        parquet = pq.ParquetFile(self.path)
        n_groups = parquet.num_row_groups
        # As few groups as hold twice the sample, spread evenly; one group is the middle one.
        k = min(_SAMPLE_GROUPS, n_groups, math.ceil(2 * limit * n_groups / self._num_rows))
        groups = [n_groups // 2] if k == 1 else sorted({round(i * (n_groups - 1) / (k - 1)) for i in range(k)})
        prompts = parquet.read_row_groups(groups, columns=["prompt"]).column("prompt")
        picked = sorted(random.Random(0).sample(range(len(prompts)), min(limit, len(prompts))))
        return prompts.take(picked).to_pylist()

    # ---- user SQL ----

    def query(self, sql: str, limit: int = 1000, timeout_s: float = _QUERY_TIMEOUT_S) -> tuple[list[str], list[tuple]]:
        """Run one read-only SELECT over `data`; at most `limit` rows come back: (column names, rows).

        The query is checked first (`check_sql`), then run as SELECT * FROM (<sql>) LIMIT limit, and
        interrupted after `timeout_s` seconds. A refusal or DuckDB's error is a `PreviewError`.
        """
        statement = check_sql(sql, self._con, self._lock)
        wrapped = f"SELECT * FROM (\n{statement}\n) LIMIT {max(0, int(limit))}"
        return self._run(wrapped, timeout_s=timeout_s)

    def _run(self, sql: str, timeout_s: float | None = None) -> tuple[list[str], list[tuple]]:
        with self._lock:
            timer = None
            if timeout_s is not None and math.isfinite(timeout_s):
                timer = threading.Timer(timeout_s, self._con.interrupt)
                timer.daemon = True
                timer.start()
            try:
                cursor = self._con.execute(sql)
                columns = [d[0] for d in cursor.description or []]
                return columns, cursor.fetchall()
            except duckdb.InterruptException:
                raise PreviewError(
                    f"the query ran longer than {timeout_s:g} s and was stopped; narrow it with WHERE or LIMIT"
                ) from None
            except duckdb.Error as e:
                raise PreviewError(_first_line(e)) from None
            finally:
                if timer is not None:
                    timer.cancel()


# ---- checking user SQL ----

def _code_end(sql: str) -> tuple[int, int]:
    """(start of the first token, end of the code before a ';' terminator), skipping comments and quotes."""
    i, n = 0, len(sql)
    start = None
    while i < n:
        c = sql[i]
        if sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if start is None and not c.isspace():
            start = i
        if c in "'\"":
            j = sql.find(c, i + 1)
            # '' inside a string is an escaped quote: find() lands on it and the next pass reopens it
            i = n if j < 0 else j + 1
            continue
        if c == "$":
            m = re.match(r"\$([A-Za-z_]\w*)?\$", sql[i:])
            if m:
                j = sql.find(m.group(0), i + len(m.group(0)))
                i = n if j < 0 else j + len(m.group(0))
                continue
        if c == ";":
            return (start if start is not None else i), i
        i += 1
    return (start if start is not None else n), n


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def check_sql(sql: str, con: duckdb.DuckDBPyConnection | None = None, lock: threading.Lock | None = None) -> str:
    """The statement to run if `sql` is one read-only SELECT over the view `data`, else `PreviewError`.

    Refused: more than one statement; anything that is not a SELECT (INSERT, UPDATE, DELETE, CREATE,
    COPY, ATTACH, PRAGMA, SET, INSTALL, LOAD, EXPORT, CALL, ...); tables other than `data` and the
    query's own WITH names (a quoted file path used as a table, 'x.parquet', included); table
    functions other than unnest, range and generate_series; functions that read files (read_csv,
    read_parquet, read_json, read_text, read_blob, glob, parquet_metadata, ...).
    """
    text = (sql or "").strip()
    if not text:
        raise PreviewError("the query is empty; write one SELECT over the view data")
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as e:
        raise PreviewError(_first_line(e)) from None
    if not statements:
        raise PreviewError("the query is empty (only comments); write one SELECT over the view data")
    if len(statements) > 1:
        raise PreviewError(f"only one statement may run at a time; found {len(statements)} "
                           "(remove the ';' between them)")
    kind = statements[0].type.name
    if kind != "SELECT":
        article = "an" if kind[0] in "AEIOU" else "a"
        raise PreviewError(f"only read-only SELECT queries over the view data are allowed; this is {article} "
                           f"{kind} statement")
    statement = statements[0].query
    start, end = _code_end(statement)
    first = re.match(r"[A-Za-z_]+|\(", statement[start:end])
    if first is None or (first.group(0) != "(" and first.group(0).lower() not in _FIRST_KEYWORDS):
        word = first.group(0).upper() if first else statement[start:start + 10]
        raise PreviewError(f"only SELECT (or WITH ... SELECT) queries are allowed here, not {word}")
    statement = statement[:end].rstrip()

    own = con is None
    con = con or duckdb.connect(":memory:")
    try:
        with lock or threading.Lock():
            ast_text = con.execute("SELECT json_serialize_sql(?)", [statement]).fetchone()[0]
    except duckdb.Error as e:
        raise PreviewError(_first_line(e)) from None
    finally:
        if own:
            con.close()
    ast = json.loads(ast_text)
    if ast.get("error"):
        raise PreviewError(str(ast.get("error_message") or "the query could not be parsed"))

    nodes = list(_walk(ast.get("statements", [])))
    cte_names = {item.get("key", "").lower() for node in nodes if isinstance(node.get("cte_map"), dict)
                 for item in node["cte_map"].get("map", []) if isinstance(item, dict)}
    allowed_tables = {"data"} | cte_names
    for node in nodes:
        kind = node.get("type")
        if kind == "BASE_TABLE" and "class" not in node:
            name = str(node.get("table_name", ""))
            qualified = node.get("schema_name") or node.get("catalog_name")
            if qualified or name.lower() not in allowed_tables:
                shown = ".".join(p for p in (node.get("catalog_name"), node.get("schema_name"), name) if p)
                if any(ch in name for ch in "./\\:") and not qualified:
                    raise PreviewError(f"'{name}' looks like a file: this box reads only the open file, as the "
                                       "view data")
                raise PreviewError(f"table '{shown}' is not allowed: query the view data (and names you define "
                                   "with WITH)")
        elif kind == "TABLE_FUNCTION" and "class" not in node:
            name = str((node.get("function") or {}).get("function_name", "")).lower()
            if name not in ALLOWED_TABLE_FUNCTIONS:
                what = "reads files" if _FILE_FUNCTIONS.match(name) else "is not allowed here"
                raise PreviewError(f"table function {name}() {what}: query the view data (allowed table "
                                   f"functions: {', '.join(sorted(ALLOWED_TABLE_FUNCTIONS))})")
        elif node.get("class") == "FUNCTION":
            name = str(node.get("function_name", "")).lower()
            if _FILE_FUNCTIONS.match(name):
                raise PreviewError(f"function {name}() is not allowed here: query the view data")
        elif kind == "SHOW_REF" and "class" not in node:
            raise PreviewError("DESCRIBE / SUMMARIZE / SHOW are not allowed here; use SELECT over the view data")
    return statement


# ---- showing rows ----


def render_prompt(prompt: Any) -> str:
    """A chat message list as "role: content" blocks separated by blank lines; a string as it is."""
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple):
        blocks = []
        for message in prompt:
            if isinstance(message, dict):
                blocks.append(f"{message.get('role', '?')}: {message.get('content', '')}")
            else:
                blocks.append(str(message))
        return "\n\n".join(blocks)
    return str(prompt)


def _display_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def display_columns(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, list[Any]]:
    """Rows as {column: values} with nested values as JSON text, so any table widget can show them.

    A column name that repeats (SELECT a, a) gets a suffix ("a (2)") rather than losing a column.
    """
    names: list[str] = []
    seen: Counter[str] = Counter()
    for c in columns:
        seen[c] += 1
        names.append(c if seen[c] == 1 else f"{c} ({seen[c]})")
    return {name: [_display_value(row[i]) for row in rows] for i, name in enumerate(names)}


# ---- prompt lengths ----


def token_length_histogram(texts: Sequence[Any], tokenizer: Any, max_prompt_length: int) -> dict[str, Any]:
    """Prompt token lengths as the engine counts them (chat template with the generation prompt, as
    `data.PromptDataset` builds it), with how many are over `max_prompt_length`.

    `texts`: prompts as message lists or strings (`Preview.prompt_texts()`). Prompts the engine would
    reject (empty, bad roles) are left out and counted in n_invalid.
    Returns {lengths, n, n_over, max, mean, max_prompt_length, n_invalid}.
    """
    rows = [{"data_source": "preview", "prompt": t, "ground_truth": "0"} for t in texts]
    big = 1 << 40  # no prompt is over this: every length is measured, none filtered or truncated
    lengths: list[int] = []
    n_invalid = 0
    if rows:
        try:
            lengths = data.PromptDataset(rows, tokenizer, big).prompt_lengths()
        except data.DataError:
            for row in rows:  # one bad prompt: measure the rest one by one
                try:
                    lengths.extend(data.PromptDataset([row], tokenizer, big).prompt_lengths())
                except data.DataError:
                    n_invalid += 1
    return {
        "lengths": lengths,
        "n": len(lengths),
        "n_over": sum(length > max_prompt_length for length in lengths),
        "max": max(lengths, default=0),
        "mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "max_prompt_length": int(max_prompt_length),
        "n_invalid": n_invalid,
    }


# ---- reward playground ----


def _custom_scorer(custom_path: str, custom_name: str):
    path = custom_path.strip()
    if not path:
        return None
    target = path.rsplit(":", 1)[0] if not custom_name and ":" in path else path
    if target.endswith(".py") or "/" in target or "\\" in target:
        resolved = workspace.safe_path(target, suffixes=(".py",))
        path = str(resolved) + path[len(target):]
    return load_custom_reward(path, custom_name)


def score_response(data_source: str, response: str, ground_truth: str, custom_path: str = "",
                   custom_name: str = "", gsm8k_scorer: str = "verl") -> dict[str, Any]:
    """Score one response as the engine would, and show what each extractor reads from it.

    The scorer is the data source's registered one (for GSM8K the rule `gsm8k_scorer` names, as
    reward.gsm8k_scorer: "verl" or "lenient"), or the custom function (`custom_path` a .py file inside the
    workspace or a module, `custom_name` the function). Returns {score, parts, pred, strict
    (extract_hash_answer), flexible (extract_last_number), boxed (extract_boxed), error}. A scorer that
    raises, returns a non-number or hangs scores 0.0 with `error` saying why, as in a run; when no
    scorer can be found `score` is None.
    """
    response = "" if response is None else str(response)
    result: dict[str, Any] = {
        "score": None, "parts": {}, "pred": None,
        "strict": extract_hash_answer(response),
        "flexible": extract_last_number(response),
        "boxed": extract_boxed(response),
        "error": None,
    }
    try:
        custom_fn = _custom_scorer(custom_path, custom_name)
        scored = score_batch([data_source], [response], [str(ground_truth)], custom_fn=custom_fn,
                             gsm8k_scorer=gsm8k_scorer, timeout_s=_SCORE_TIMEOUT_S)
    except (RewardError, workspace.PathError) as e:
        result["error"] = str(e)
        return result
    result.update(score=scored.scores[0], parts=scored.parts[0], pred=scored.preds[0], error=scored.first_error)
    return result


def _ground_truth(row: dict[str, Any]) -> str | None:
    reward_model = row.get("reward_model")
    candidates = []
    if isinstance(reward_model, dict):
        candidates.append(reward_model.get("ground_truth"))
    candidates += [row.get("ground_truth"), row.get("answer")]
    for value in candidates:
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value).strip()
    return None


def reference_answer(row: dict[str, Any]) -> tuple[str, str] | None:
    """(a response that should get full marks, the ground truth) for one row, or None without ground truth.

    GSM8K rows carry the worked solution in extra_info.answer ("... #### 72"); math sets get
    "\\boxed{<ground truth>}"; every other set "#### <ground truth>".
    """
    truth = _ground_truth(row)
    if truth is None:
        return None
    source = str(row.get("data_source") or "")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    answer = extra.get("answer")
    if source in GSM8K_DATA_SOURCES and isinstance(answer, str) and "####" in answer:
        return answer, truth
    if isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return row["answer"], truth
    if source in MATH_DATA_SOURCES:
        return (truth if "\\boxed" in truth else f"\\boxed{{{truth}}}"), truth
    return f"#### {truth}", truth


def score_reference_answers(rows: Sequence[dict[str, Any]], n: int = 50, custom_path: str = "",
                            custom_name: str = "", gsm8k_scorer: str = "verl") -> dict[str, Any]:
    """Score the first `n` rows' own reference answers (`reference_answer`) with their data set's scorer
    (GSM8K's by the rule `gsm8k_scorer` names).

    A correct answer that does not get full marks (score >= 1) points at a broken scorer or a ground
    truth in a form the scorer does not read. Returns {n, full_marks, failures: [{row, data_source,
    response, ground_truth, score, error}], skipped (rows without ground truth)}.
    """
    picked = list(rows)[: max(0, int(n))]
    failures: list[dict[str, Any]] = []
    items: list[tuple[int, dict[str, Any], str, str]] = []
    skipped = 0
    for i, row in enumerate(picked):
        ref = reference_answer(row)
        if ref is None:
            skipped += 1
            continue
        items.append((i, row, ref[0], ref[1]))

    try:
        custom_fn = _custom_scorer(custom_path, custom_name)
    except (RewardError, workspace.PathError) as e:
        return {"n": len(items), "full_marks": 0, "skipped": skipped, "error": str(e),
                "failures": [_failure(i, row, resp, truth, None, str(e)) for i, row, resp, truth in items]}

    by_source: dict[str, list[tuple[int, dict[str, Any], str, str]]] = {}
    for item in items:
        by_source.setdefault(str(item[1].get("data_source") or ""), []).append(item)
    full = 0
    for source, group in by_source.items():
        try:
            scored = score_batch(
                [source] * len(group), [g[2] for g in group], [g[3] for g in group],
                [g[1].get("extra_info") if isinstance(g[1].get("extra_info"), dict) else None for g in group],
                custom_fn=custom_fn, gsm8k_scorer=gsm8k_scorer, timeout_s=_SCORE_TIMEOUT_S)
        except RewardError as e:
            failures += [_failure(i, row, resp, truth, None, str(e)) for i, row, resp, truth in group]
            continue
        for (i, row, resp, truth), score in zip(group, scored.scores, strict=True):
            if score >= 1.0 - 1e-9:
                full += 1
            else:
                failures.append(_failure(i, row, resp, truth, score, None))
        if scored.first_error:
            for f in failures:
                if f["data_source"] == source and f["error"] is None:
                    f["error"] = scored.first_error
                    break
    failures.sort(key=lambda f: f["row"])
    return {"n": len(items), "full_marks": full, "skipped": skipped, "error": None, "failures": failures}


def _failure(i: int, row: dict[str, Any], response: str, truth: str, score: float | None,
             error: str | None) -> dict[str, Any]:
    return {"row": i, "data_source": row.get("data_source"), "response": response, "ground_truth": truth,
            "score": score, "error": error}


# ---- what the engine would reject ----


def file_problems(path: str | Path, max_prompt_length: int | None = None, tokenizer: Any = None) -> list[str]:
    """The engine's own messages for what would stop a run on this file, or [] when it would load.

    Reads every row as the trainer does (`data.load_rows`); checks that each data_source has a
    registered scorer (unless a custom reward function is configured, which this does not know); with
    a tokenizer and `max_prompt_length`, builds the tokenized dataset with data.truncation=error.
    """
    try:
        rows = data.load_rows(path)
    except data.DataError as e:
        return [str(e)]
    problems: list[str] = []
    for source in sorted({r["data_source"] for r in rows}):
        try:
            get_scorer(source)
        except RewardError as e:
            problems.append(str(e))
    if tokenizer is not None and max_prompt_length is not None:
        try:
            data.PromptDataset(rows, tokenizer, int(max_prompt_length), source=str(path))
        except data.DataError as e:
            problems.append(str(e))
    return problems
