"""Prompt data: parquet rows in verl's shape, preprocessors, a tokenized dataset and a resumable sampler.

The native row is verl's::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

`load_rows` also accepts a plain string `prompt` column and a top-level `ground_truth` or `answer`
column, and returns every row in the shape above. Anything that does not fit raises `DataError` with
the file, the column or row, and what is allowed; never a pyarrow stack trace.

Row numbers in messages are 0-based (as the data page and DuckDB's `row_number() - 1` show them);
JSONL line numbers are 1-based (as an editor shows them).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "DataError",
    "GSM8K_DATA_SOURCE",
    "GSM8K_INSTRUCTION",
    "ARITHMETIC_DATA_SOURCE",
    "ARITHMETIC_INSTRUCTION",
    "make_arithmetic_rows",
    "write_sample_sets",
    "gsm8k_rows_from_jsonl",
    "convert_gsm8k",
    "write_rows",
    "load_rows",
    "load_many",
    "PromptDataset",
    "PromptSampler",
]

GSM8K_DATA_SOURCE = "openai/gsm8k"
# verl's GSM8K preprocessing instruction, so rewards and numbers compare with verl runs.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ARITHMETIC_DATA_SOURCE = "arithmetic"
# No example number in the instruction: with "for example: #### 7" SmolLM2-135M-Instruct wrote "#### 7" after
# most of its (often right) working, 12.5% greedy accuracy on 64 val problems against 23% without it.
ARITHMETIC_INSTRUCTION = "Give the final number after '####'."

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
TRUNCATION_MODES = ("error", "left", "right")
EXPECTED_SHAPE = (
    "expected verl rows with data_source, prompt, reward_model.ground_truth, or a string prompt column"
)


class DataError(ValueError):
    """A data file or data setting that does not fit; the message says where and what is allowed."""


# ---- row normalisation ----


def _type_name(value: Any) -> str:
    return type(value).__name__


def _ground_truth_to_str(value: Any, where: str, column: str) -> str:
    # bool is an int subclass; a True ground truth is almost surely a broken column, not the answer 1.
    if isinstance(value, bool):
        raise DataError(f"{where}: {column} must be a string or a number, got bool")
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: {column} must be a finite number, got {value}")
        # parquet written from pandas often turns an integer column into floats: 42.0 means "42".
        return str(int(value)) if value.is_integer() else repr(value)
    raise DataError(f"{where}: {column} must be a string or a number, got {_type_name(value)}")


def _final_answer(text: str) -> str | None:
    """The text after the last '####' with thousands separators removed, or None without a marker."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def _normalise_messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if prompt is None:
        raise DataError(f"{where}: prompt is null")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: prompt is an empty string")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list | tuple):
        raise DataError(
            f"{where}: prompt must be a list of {{role, content}} messages or a string, "
            f"got {_type_name(prompt)}"
        )
    if not prompt:
        raise DataError(f"{where}: prompt is an empty message list; it needs at least one message")
    messages = []
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: prompt message {j} must be a {{role, content}} mapping, got {_type_name(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ALLOWED_ROLES:
            raise DataError(
                f"{where}: prompt message {j} has role {role!r}; allowed roles: {', '.join(ALLOWED_ROLES)}"
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: prompt message {j} content must be a string, got {_type_name(content)}"
            )
        messages.append({"role": role, "content": content})
    return messages


def _normalise_extra_info(extra_info: Any, where: str) -> dict[str, Any]:
    if extra_info is None:
        return {}
    if isinstance(extra_info, dict):
        return dict(extra_info)
    # A parquet map column comes back from pyarrow as a list of (key, value) pairs.
    if isinstance(extra_info, list) and all(isinstance(p, tuple) and len(p) == 2 for p in extra_info):
        return dict(extra_info)
    raise DataError(f"{where}: extra_info must be a mapping or null, got {_type_name(extra_info)}")


def _normalise_row(
    row: dict[str, Any], where: str, index: int, default_data_source: str | None = None
) -> dict[str, Any]:
    """One row in verl's shape; `where` prefixes every error ("data/x.parquet row 17")."""
    data_source = row.get("data_source")
    if data_source is None:
        data_source = default_data_source
    if not isinstance(data_source, str) or not data_source:
        raise DataError(
            f"{where}: data_source must be a non-empty string, got {data_source!r}; "
            "fill it in, or pass a default data source"
        )

    messages = _normalise_messages(row.get("prompt"), where)

    if "reward_model" in row and row["reward_model"] is not None:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict):
            raise DataError(
                f"{where}: reward_model must be a mapping with ground_truth, got {_type_name(reward_model)}"
            )
        if reward_model.get("ground_truth") is None:
            raise DataError(f"{where}: reward_model.ground_truth is null")
        ground_truth = _ground_truth_to_str(reward_model["ground_truth"], where, "reward_model.ground_truth")
        style = reward_model.get("style") or "rule"
    elif row.get("ground_truth") is not None:
        ground_truth = _ground_truth_to_str(row["ground_truth"], where, "ground_truth")
        style = "rule"
    elif row.get("answer") is not None:
        answer = row["answer"]
        final = _final_answer(answer) if isinstance(answer, str) else None
        ground_truth = final if final is not None else _ground_truth_to_str(answer, where, "answer")
        style = "rule"
    else:
        raise DataError(
            f"{where}: no ground truth (reward_model.ground_truth, ground_truth and answer are all "
            "null or absent)"
        )

    extra_info = _normalise_extra_info(row.get("extra_info"), where)
    if extra_info.get("index") is None:
        extra_info["index"] = index
    ability = row.get("ability")
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability if isinstance(ability, str) and ability else "unknown",
        "reward_model": {"style": str(style), "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def row_item(row: dict[str, Any], where: str = "row", index: int = 0) -> dict[str, Any]:
    """A raw row as a run's episodes receive it (PromptDataset items without the tokens): messages,
    data_source, ground_truth, extra_info, index. DataError names what is wrong with it."""
    normalised = _normalise_row(row, where, index)
    return {"messages": normalised["prompt"], "data_source": normalised["data_source"],
            "ground_truth": normalised["reward_model"]["ground_truth"], "extra_info": normalised["extra_info"],
            "index": index}


# ---- synthetic arithmetic ----

_NAMES = (
    ("Tom", "He"), ("Anna", "She"), ("Sam", "He"), ("Mia", "She"),
    ("Ben", "He"), ("Lily", "She"), ("Max", "He"), ("Zoe", "She"),
)  # fmt: skip
_OBJECTS = (
    ("apple", "apples"), ("book", "books"), ("coin", "coins"), ("pencil", "pencils"),
    ("sticker", "stickers"), ("marble", "marbles"), ("cookie", "cookies"), ("card", "cards"),
)  # fmt: skip
_ADD_VERBS = ("gets", "buys", "finds")
_SUB_VERBS = ("gives away", "loses", "sells")
# Mostly the easiest level: a 135M instruct model must get some answers right on the first step,
# otherwise every group reward is equal and GRPO has no signal at all.
_LEVEL_WEIGHTS = (0.5, 0.3, 0.2)


def _count(n: int, obj: tuple[str, str]) -> str:
    return f"{n} {obj[0] if n == 1 else obj[1]}"


def _arithmetic_question(rng: np.random.Generator, a: int, b: int, op: str) -> str:
    name, pronoun = _NAMES[rng.integers(len(_NAMES))]
    obj = _OBJECTS[rng.integers(len(_OBJECTS))]
    template = int(rng.integers(3))
    if op == "+":
        verb = _ADD_VERBS[rng.integers(len(_ADD_VERBS))]
        if template == 0:
            return (
                f"{name} has {_count(a, obj)}. {pronoun} {verb} {b} more. "
                f"How many {obj[1]} does {name} have now?"
            )
        if template == 1:
            return f"A box has {_count(a, obj)}. {name} puts in {b} more. How many {obj[1]} are in the box?"
        return f"What is {a} + {b}?"
    verb = _SUB_VERBS[rng.integers(len(_SUB_VERBS))]
    if template == 0:
        return f"{name} has {_count(a, obj)}. {pronoun} {verb} {b}. How many {obj[1]} does {name} have left?"
    if template == 1:
        return f"A box has {_count(a, obj)}. {name} takes out {b}. How many {obj[1]} are in the box now?"
    return f"What is {a} - {b}?"


def _arithmetic_operands(rng: np.random.Generator, level: int) -> tuple[int, int, str]:
    if level == 1:
        return int(rng.integers(1, 10)), int(rng.integers(1, 10)), "+"
    if level == 2:
        if rng.random() < 0.5:
            a, b = sorted((int(rng.integers(1, 10)), int(rng.integers(1, 10))), reverse=True)
            return a, b, "-"
        a, b = int(rng.integers(10, 100)), int(rng.integers(1, 10))
        return (a, b, "+") if rng.random() < 0.5 else (b, a, "+")
    a, b = int(rng.integers(10, 100)), int(rng.integers(10, 100))
    if rng.random() < 0.5:
        return a, b, "+"
    a, b = max(a, b), min(a, b)
    return a, b, "-"


def make_arithmetic_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`n` synthetic arithmetic word problems in verl's row shape, the same rows for the same arguments.

    Levels (stored in extra_info["level"]): 1 = a + b with one-digit operands; 2 = a - b with one-digit
    operands (never negative) or a two-digit plus a one-digit number; 3 = two-digit add or subtract.
    The split is mixed into the seed, so "train" and "val" with one seed are different streams.
    extra_info also holds the question without the instruction and the expression ("7 - 3").
    """
    if n < 0:
        raise DataError(f"make_arithmetic_rows: n must be >= 0, got {n}")
    # crc32, not hash(): Python salts str hashes per process, and the rows must not change between runs.
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    rows = []
    for index in range(n):
        level = int(rng.choice(3, p=_LEVEL_WEIGHTS)) + 1
        a, b, op = _arithmetic_operands(rng, level)
        question = _arithmetic_question(rng, a, b, op)
        answer = a + b if op == "+" else a - b
        rows.append(
            {
                "data_source": ARITHMETIC_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {ARITHMETIC_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "level": level,
                    "question": question,
                    "expression": f"{a} {op} {b}",
                },
            }
        )
    return rows


CALCULATOR_INSTRUCTION = "Use the calculator, then give the final number after '####'."


def make_calculator_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`n` multi-digit problems a 135M model cannot do in its head but can with a calculator: a three-digit
    times a two-digit number, or a sum of two four-digit numbers (half each), in verl's row shape with the
    arithmetic scorer. extra_info holds the expression ("347 * 86"). The split is mixed into the seed."""
    rng = np.random.default_rng([seed, zlib.crc32(f"calculator-{split}".encode())])
    rows = []
    for index in range(n):
        if rng.random() < 0.5:
            a, b, op = int(rng.integers(100, 1000)), int(rng.integers(10, 100)), "*"
        else:
            a, b, op = int(rng.integers(1000, 10000)), int(rng.integers(1000, 10000)), "+"
        answer = a * b if op == "*" else a + b
        rows.append({"data_source": ARITHMETIC_DATA_SOURCE,
                     "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? {CALCULATOR_INSTRUCTION}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(answer)},
                     "extra_info": {"split": split, "index": index, "expression": f"{a} {op} {b}"}})
    return rows


def calculator_demonstration(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation a calculator row should have: the question, one calculator call, its result and the
    answer after '####' (a supervised warm-start teaches the call format with these)."""
    expression, answer = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [*row["prompt"], {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "name": "calculator", "content": answer},
            {"role": "assistant", "content": f"{expression} = {answer}. #### {answer}"}]


def write_calculator_sets(out_dir: str | Path, seed: int = 0, n_train: int = 2000, n_val: int = 200,
                          n_demos: int = 512) -> dict[str, Path]:
    """calculator_train.parquet and calculator_val.parquet (no val expression in train) for the RL run, and
    calculator_demos.parquet (a `messages` column: demonstrations built from other problems) for the
    supervised warm-start. Returns {"train", "val", "demos"} paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = make_calculator_rows(n_train, seed, "train")
    seen = {r["extra_info"]["expression"] for r in train}
    val = [r for r in make_calculator_rows(2 * n_val, seed, "val") if r["extra_info"]["expression"] not in seen][:n_val]
    seen |= {r["extra_info"]["expression"] for r in val}
    demos = [r for r in make_calculator_rows(2 * n_demos, seed, "demos") if r["extra_info"]["expression"] not in seen]
    paths = {"train": out_dir / "calculator_train.parquet", "val": out_dir / "calculator_val.parquet",
             "demos": out_dir / "calculator_demos.parquet"}
    write_rows(train, paths["train"])
    write_rows(val, paths["val"])
    write_messages([calculator_demonstration(r) for r in demos[:n_demos]], paths["demos"])
    return paths


def write_messages(conversations: Sequence[list[dict[str, str]]], path: str | Path) -> None:
    """Conversations (role, content and an optional tool name per message) as a parquet `messages` column,
    the shape `python -m backend sft` trains on."""
    path = Path(path)
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    table = pa.table({"messages": pa.array([[{"role": m["role"], "content": m["content"], "name": m.get("name")}
                                             for m in c] for c in conversations], pa.list_(message))})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def load_messages(path: str | Path) -> list[list[dict[str, str]]]:
    """The conversations of a `messages` parquet file (DataError naming the file and the row when one is not a
    list of messages with a role and a string content)."""
    table = _read_table(path)
    if "messages" not in table.column_names:
        raise DataError(f"{path}: no 'messages' column (found: {', '.join(table.column_names)}); a supervised "
                        "data file holds one conversation per row, a list of {role, content} messages")
    out = []
    for i, conversation in enumerate(table.column("messages").to_pylist()):
        if not isinstance(conversation, list) or not conversation:
            raise DataError(f"{path} row {i}: messages must be a non-empty list of {{role, content}}")
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{path} row {i}: every message needs a role and a string content, got {m!r}")
        out.append([{k: v for k, v in m.items() if v is not None} for m in conversation])
    return out


def write_sample_sets(
    out_dir: str | Path, seed: int = 0, n_train: int = 2000, n_val: int = 200
) -> dict[str, Path]:
    """Write arithmetic_train.parquet and arithmetic_val.parquet; no val question also appears in train.

    Returns {"train": path, "val": path}.
    """
    out_dir = Path(out_dir)
    train = make_arithmetic_rows(n_train, seed, "train")
    train_questions = {row["extra_info"]["question"] for row in train}
    # The generator is sequential, so asking for more rows only appends: the kept val rows stay the
    # same whatever the oversampling factor.
    want = 2 * n_val + 16
    while True:
        val = [
            r
            for r in make_arithmetic_rows(want, seed, "val")
            if r["extra_info"]["question"] not in train_questions
        ]
        if len(val) >= n_val or want > 64 * (n_val + 16):
            break
        want *= 4
    if len(val) < n_val:
        raise DataError(
            f"write_sample_sets: only {len(val)} validation questions differ from the {n_train} train "
            f"questions; ask for fewer (n_val={n_val})"
        )
    val = val[:n_val]
    for index, row in enumerate(val):
        row["extra_info"]["index"] = index
    paths = {"train": out_dir / "arithmetic_train.parquet", "val": out_dir / "arithmetic_val.parquet"}
    write_rows(train, paths["train"])
    write_rows(val, paths["val"])
    return paths


# ---- GSM8K ----


def gsm8k_rows_from_jsonl(
    path: str | Path, split: str = "train", limit: int | None = None
) -> list[dict[str, Any]]:
    """Rows in verl's shape from GSM8K's official JSONL (one {"question", "answer"} object a line).

    Ground truth is the number after the last "####" in `answer`, commas removed. `limit` stops after
    that many rows. Blank lines are skipped.
    """
    rows: list[dict[str, Any]] = []
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror or e})") from None
    with handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                    'object with "question" and "answer"'
                ) from None
            if not isinstance(obj, dict):
                raise DataError(
                    f'{where}: expected a JSON object with "question" and "answer", got {_type_name(obj)}'
                )
            question, answer = obj.get("question"), obj.get("answer")
            for key, value in (("question", question), ("answer", answer)):
                if not isinstance(value, str):
                    raise DataError(f'{where}: "{key}" must be a string, got {_type_name(value)}')
            ground_truth = _final_answer(answer)
            if not ground_truth:
                raise DataError(f'{where}: answer has no final "#### <number>" line')
            rows.append(
                {
                    "data_source": GSM8K_DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": ground_truth},
                    "extra_info": {
                        "split": split,
                        "index": len(rows),
                        "answer": answer,
                        "question": question,
                    },
                }
            )
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty)")
    return rows


def convert_gsm8k(
    input_path: str | Path, output_path: str | Path, split: str = "train", limit: int | None = None
) -> int:
    """Convert GSM8K JSONL to verl-shaped parquet; returns the number of rows written."""
    rows = gsm8k_rows_from_jsonl(input_path, split=split, limit=limit)
    write_rows(rows, output_path)
    return len(rows)


# ---- parquet I/O ----

_MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
_REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])


def write_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write verl-shaped rows to parquet (prompt as list<struct<role, content>>, nested structs kept).

    The file appears whole or not at all: it is written next to `path` and renamed into place.
    """
    path = Path(path)
    if not rows:
        raise DataError(f"{path}: no rows to write")
    normalised = [_normalise_row(row, f"row {i}", i) for i, row in enumerate(rows)]
    columns = {
        "data_source": pa.array([r["data_source"] for r in normalised], pa.string()),
        "prompt": pa.array([r["prompt"] for r in normalised], pa.list_(_MESSAGE_TYPE)),
        "ability": pa.array([r["ability"] for r in normalised], pa.string()),
        "reward_model": pa.array([r["reward_model"] for r in normalised], _REWARD_MODEL_TYPE),
    }
    try:
        # Inferred: extra_info keys differ between datasets; pyarrow takes the union of the keys.
        columns["extra_info"] = pa.array([r["extra_info"] for r in normalised])
    except pa.ArrowException as e:
        raise DataError(
            f"{path}: extra_info values do not fit one parquet type across rows (pyarrow: {e}); "
            "give each extra_info key the same type in every row"
        ) from None
    table = pa.table(columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_table(path: str | Path) -> pa.Table:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: file not found")
    if p.is_dir():
        raise DataError(f"{path} is a directory; give one parquet file (or a list of files)")
    hint = ""
    if p.suffix.lower() in (".jsonl", ".json", ".csv", ".txt"):
        hint = "; for GSM8K's JSONL run the converter first (backend.core.data.convert_gsm8k)"
    try:
        return pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a parquet file; only parquet is read{hint} (pyarrow: {e})") from None


def load_rows(path: str | Path, *, default_data_source: str | None = None) -> list[dict[str, Any]]:
    """Read one parquet file and return its rows in verl's shape.

    Accepts verl rows, a plain string `prompt` column (one user message), and a top-level
    `ground_truth` or `answer` column instead of `reward_model` ("... #### 42" in `answer` gives "42").
    A missing `data_source` column is an error unless `default_data_source` is given.
    Each row: data_source, prompt (list of {role, content}), ability, reward_model {style,
    ground_truth: str}, extra_info (a dict with at least "index").
    """
    table = _read_table(path)
    if table.num_rows == 0:
        raise DataError(f"{path}: file is empty (0 rows)")
    names = table.column_names
    found = ", ".join(names) or "no columns"
    if "prompt" not in names:
        raise DataError(f"{path}: missing column 'prompt' (found: {found}); {EXPECTED_SHAPE}")
    if "reward_model" in names:
        reward_type = table.schema.field("reward_model").type
        if not (pa.types.is_struct(reward_type) and reward_type.get_field_index("ground_truth") >= 0):
            raise DataError(
                f"{path}: column 'reward_model' has no ground_truth field (type: {reward_type}); "
                f"{EXPECTED_SHAPE}"
            )
    elif "ground_truth" not in names and "answer" not in names:
        raise DataError(
            f"{path}: missing column 'reward_model' (found: {found}); need reward_model.ground_truth "
            "(verl), or a top-level ground_truth or answer column"
        )
    if "data_source" not in names and default_data_source is None:
        raise DataError(
            f"{path}: missing column 'data_source' (found: {found}); add the column, or give a default "
            "data source (it picks the reward function)"
        )
    # Only the columns we read: a wide file with a large unrelated column should not cost memory.
    wanted = [c for c in ("data_source", "prompt", "ability", "reward_model", "ground_truth", "answer",
                          "extra_info") if c in names]  # fmt: skip
    raw = table.select(wanted).to_pylist()
    return [_normalise_row(row, f"{path} row {i}", i, default_data_source) for i, row in enumerate(raw)]


def load_many(
    paths: str | Path | Iterable[str | Path], *, default_data_source: str | None = None
) -> list[dict[str, Any]]:
    """Rows of several parquet files, in the order given (verl's data.train_files may be one or a list)."""
    if isinstance(paths, str | Path):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise DataError("no data files given; set data.train_files / data.val_files to parquet paths")
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(load_rows(path, default_data_source=default_data_source))
    return rows


# ---- tokenized prompts ----


class PromptDataset:
    """Rows plus their chat-templated prompt token ids, checked against max_prompt_length.

    The prompt text is `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=False)`, tokenized with add_special_tokens=False (the template already holds them); a
    tokenizer without a chat template gets the message contents joined by newlines.

    Over-long prompts: filter_overlong_prompts=True drops them (counted in `n_filtered`); otherwise
    truncation "error" raises DataError, "left" keeps the last max_prompt_length tokens, "right" the first.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        source: str = "",
    ) -> None:
        label = source or "dataset"
        if truncation not in TRUNCATION_MODES:
            raise DataError(
                f"data.truncation={truncation!r} is not allowed; use one of: {', '.join(TRUNCATION_MODES)}"
            )
        if max_prompt_length < 1:
            raise DataError(f"data.max_prompt_length={max_prompt_length} must be at least 1")
        if not rows:
            raise DataError(f"{label}: no rows")
        self.source = source
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        normalised = [_normalise_row(row, f"{label} row {i}", i) for i, row in enumerate(rows)]
        texts = [self._render(row["prompt"], tokenizer) for row in normalised]
        all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]

        self.rows: list[dict[str, Any]] = []
        self.n_filtered = 0
        self._ids: list[list[int]] = []
        self._texts: list[str] = []
        self._indices: list[int] = []
        for i, (row, text, ids) in enumerate(zip(normalised, texts, all_ids, strict=True)):
            ids = list(ids)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.n_filtered += 1
                    continue
                if truncation == "error":
                    raise DataError(
                        f"{label} row {i}: prompt is {len(ids)} tokens, over data.max_prompt_length="
                        f"{max_prompt_length}; raise data.max_prompt_length, or set "
                        "data.filter_overlong_prompts=true to drop such rows, or data.truncation=left|right "
                        "to cut them"
                    )
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                text = tokenizer.decode(ids, skip_special_tokens=False)
            self.rows.append(row)
            self._ids.append(ids)
            self._texts.append(text)
            self._indices.append(i)
        if not self.rows:
            raise DataError(
                f"{label}: all {len(normalised)} prompts are longer than data.max_prompt_length="
                f"{max_prompt_length} and were filtered; raise data.max_prompt_length"
            )

    @staticmethod
    def _render(messages: list[dict[str, str]], tokenizer: Any) -> str:
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Keys: prompt_ids, prompt_text, data_source, ground_truth, extra_info, messages, index.

        `index` is the row's position in the rows the dataset was built from (stable under filtering).
        """
        row = self.rows[i]
        return {
            "prompt_ids": self._ids[i],
            "prompt_text": self._texts[i],
            "data_source": row["data_source"],
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": row["extra_info"],
            "messages": row["prompt"],
            "index": self._indices[i],
        }

    def prompt_lengths(self) -> list[int]:
        """Token length of each kept prompt, after truncation."""
        return [len(ids) for ids in self._ids]


# ---- batch sampling ----


class PromptSampler:
    """Deterministic, resumable batches of row indices for RL, epoch after epoch without end.

    Epoch e visits the rows in the order `numpy.random.default_rng([seed, e]).permutation(num_rows)`
    (or 0..n-1 without shuffle). A batch never straddles two epochs: with drop_last the rows left over
    at an epoch's end are skipped, without it the last batch of an epoch is shorter.
    """

    def __init__(
        self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if num_rows < 1:
            raise DataError("the training data has no rows")
        if batch_size < 1:
            raise DataError(f"data.train_batch_size={batch_size} must be at least 1")
        if batch_size > num_rows:
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the {num_rows} rows of the training "
                f"data; set data.train_batch_size to at most {num_rows} or add rows"
            )
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.step_in_epoch = 0  # batches already taken from `epoch`
        self._order: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Batches in one epoch."""
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
            else:
                self._order = np.arange(self.num_rows)
        return self._order

    def next_batch(self) -> list[int]:
        """The next batch of row indices, starting the next epoch when this one runs out."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
            self._order = None
        start = self.step_in_epoch * self.batch_size
        batch = self._epoch_order()[start : start + self.batch_size]
        self.step_in_epoch += 1
        return [int(i) for i in batch]

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable position; `load_state_dict` of it continues with the same batches."""
        return {
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the seed and order settings come from the state, as the run began."""
        for key, setting in (
            ("num_rows", "the training data's row count"),
            ("batch_size", "data.train_batch_size"),
        ):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data position: {setting} was {state[key]} when it was saved and is "
                    f"{getattr(self, key)} now; resume with the same data and batch size, or start fresh"
                )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.drop_last = bool(state["drop_last"])
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self._order = None
