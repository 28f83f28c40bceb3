"""Data: look at a parquet file before training on it.

Pick a file (sample_data/ and uploads/, a typed path, or an upload) and see its schema, first rows with
chat prompts readable, prompt token lengths against data.max_prompt_length, data sources, ground
truths, a read-only SQL box over the view `data`, a reward playground, an environment playground (step the
configured multi-turn environment by hand), and the problems the engine
would reject the file for. The page draws what `backend.services.preview` answers; every error is shown where
it happened and the rest of the page still renders.

The token lengths use the model and data.max_prompt_length of the config being edited (the Config page's).
What needs that model's tokenizer is drawn last, into slots that say what they wait for: a shipped model
may have to be made first (converting SmolLM2 takes most of a minute), and the rest of the page is there
meanwhile.

Runs inside the workbench (app/main.py, st.navigation), or on its own under AppTest.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import streamlit as st
from page_support import editing_config, guarded, imports_warmed_up, is_entry_point, markdown_literal, one_line

from backend.core import workspace
from backend.core.models import SHIPPED, load_tokenizer
from backend.rewards.registry import known_data_sources
from backend.services import playground, preview

# Read when the page runs (not bound as a default argument), so a test can lower it on the loaded module.
UPLOAD_LIMIT_MB = 200
DEFAULT_SQL = "SELECT data_source, count(*) FROM data GROUP BY 1"
HEAD_ROWS = 20
REFERENCE_ROWS = 50
PROMPT_SAMPLE = 2000
# Checking every row loads the whole file into Python, as the trainer does: automatic up to this size.
AUTO_CHECK_ROWS = 50_000
TYPE_YOUR_OWN = "(type your own)"
FROM_CONFIG = "_data_from_config"  # the (model, max_prompt_length) of the config the two fields were last set from


# ---- cached backend answers (keyed by path and file stamp, so an edited file is read again) ----


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


@st.cache_data(show_spinner=False, max_entries=16)
def _summary(path: str, stamp: tuple[int, int]) -> dict[str, Any]:
    with preview.open_parquet(path) as pv:
        return {
            "schema": pv.schema(),
            "rows": pv.row_count(),
            "head": pv.head(max(HEAD_ROWS, REFERENCE_ROWS)),
            "sources": pv.data_source_counts(),
            "has_data_source": pv.has_column("data_source"),
            "presence": pv.ground_truth_presence(),
            "prompts": pv.prompt_texts(PROMPT_SAMPLE),
        }


@st.cache_resource(show_spinner=False, max_entries=4)
def _tokenizer(model: str):
    imports_warmed_up()
    return load_tokenizer(model)


def _checked_model(model: str) -> str:
    """A shipped name or Hub id as is; anything that looks like a local path must be inside the workspace."""
    model = model.strip()
    if not model:
        raise workspace.PathError("no model name given")
    if model in SHIPPED:
        return model
    if model.startswith((".", "/", "~")) or Path(model).exists():
        return str(workspace.safe_path(model))
    return model


@st.cache_data(show_spinner=False, max_entries=16)
def _lengths(path: str, stamp: tuple[int, int], model: str, max_len: int) -> dict[str, Any]:
    prompts = _summary(path, stamp)["prompts"]
    return preview.token_length_histogram(prompts, _tokenizer(model), max_len)


@st.cache_data(show_spinner=False, max_entries=16)
def _problems(path: str, stamp: tuple[int, int], model: str | None, max_len: int) -> list[str]:
    tokenizer = _tokenizer(model) if model else None
    return preview.file_problems(path, max_len if tokenizer is not None else None, tokenizer)


# ---- picking a file ----


def _listed_files() -> list[str]:
    root = workspace.workspace_root()
    found = []
    for folder in (root / "sample_data", workspace.uploads_dir()):
        if folder.is_dir():
            found += sorted(str(p.relative_to(root)) for p in folder.glob("*.parquet") if p.is_file())
    return found


def _upload_name(name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name).stem).strip("._-") or "upload"
    return workspace.check_name(f"{stem[:56]}.parquet", "upload name")


def _upload_refusal(name: str, size: int, target: Path) -> str | None:
    """Why an upload of `size` bytes named `name` must not be kept at `target`, or None when it may be.
    Checked before anything is written, so a refused upload leaves the uploads folder as it was."""
    limit = UPLOAD_LIMIT_MB * 1024 * 1024  # MB as Streamlit's max_upload_size counts them
    if size > limit:
        # bytes as well as MB: a file just over the cap would otherwise read as the cap itself
        return (f"{name} is {size / (1024 * 1024):.1f} MB ({size:,} bytes); uploads are limited to "
                f"{UPLOAD_LIMIT_MB} MB ({limit:,} bytes). It was not saved: put larger files in the workspace "
                "and type their path.")
    if target.exists():
        return _name_taken(name, target)
    return None


def _name_taken(name: str, target: Path) -> str:
    # never replace: the old file may be what an earlier run trained on, and nothing else holds a copy
    return f"{name} was not saved: {target} already exists. Rename the file, or delete the old one first."


def _save_upload(upload) -> Path:
    saved = st.session_state.setdefault("_data_uploads", {})
    if upload.file_id in saved and Path(saved[upload.file_id]).is_file():
        return Path(saved[upload.file_id])
    target = workspace.uploads_dir() / _upload_name(upload.name)
    refusal = _upload_refusal(upload.name, upload.size, target)
    if refusal:
        raise workspace.PathError(refusal)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part{os.getpid()}")
    try:
        tmp.write_bytes(upload.getvalue())
        preview.open_parquet(tmp).close()  # refuse a file that is not parquet before it is kept
        try:
            # a hard link, unlike os.replace, fails instead of overwriting a file of that name that another
            # session saved since the check above
            os.link(tmp, target)
        except FileExistsError:
            raise workspace.PathError(_name_taken(upload.name, target)) from None
        except OSError:  # a filesystem without hard links: the check above is the only guard left
            os.replace(tmp, target)
    except preview.PreviewError:
        raise preview.PreviewError(f"{upload.name} is not a readable parquet file; it was not saved") from None
    finally:
        tmp.unlink(missing_ok=True)
    saved[upload.file_id] = str(target)
    return target


def _pick_file() -> Path | None:
    files = _listed_files()
    left, right = st.columns(2)
    choice = left.selectbox("File in sample_data/ or uploads/", files, index=0 if files else None,
                            key="data_file_select", placeholder="no parquet files in sample_data/ or uploads/")
    typed = right.text_input("...or a path to a parquet file", key="data_path_input",
                             placeholder="data/train.parquet",
                             help="Relative to the workspace folder, or absolute inside an allowed folder "
                                  "(GRPO_WB_ROOTS).")
    upload = st.file_uploader(f"...or upload a parquet file (at most {UPLOAD_LIMIT_MB} MB; kept in uploads/)",
                              type=["parquet"], key="data_upload", max_upload_size=UPLOAD_LIMIT_MB)
    st.caption("An upload wins over a typed path, and a typed path over the list.")
    try:
        if upload is not None:
            return _save_upload(upload)
        if typed and typed.strip():
            return workspace.safe_path(typed, suffixes=(".parquet",))
        if choice:
            return workspace.safe_path(choice, suffixes=(".parquet",))
    except (workspace.PathError, preview.PreviewError, OSError) as e:
        st.error(str(e))
        return None
    st.info("Pick a parquet file to look at.")
    return None


# ---- sections ----


def _overview(summary: dict[str, Any]) -> None:
    presence = summary["presence"]
    cols = st.columns(4)
    cols[0].metric("Rows", f"{summary['rows']:,}")
    cols[1].metric("Columns", len(summary["schema"]))
    cols[2].metric("Data sources", len(summary["sources"]) if summary["has_data_source"] else "no column")
    cols[3].metric("With ground truth", f"{presence['with_ground_truth']:,}")
    st.subheader("Schema")
    st.dataframe({"column": [c for c, _ in summary["schema"]], "type": [t for _, t in summary["schema"]]},
                 hide_index=True)


def _first_rows(summary: dict[str, Any]) -> None:
    st.subheader("First rows")
    head = summary["head"][:HEAD_ROWS]
    if not head:
        st.info("The file has no rows.")
        return
    columns = list(head[0])
    shown = [{c: (preview.render_prompt(v) if c == "prompt" else v) for c, v in row.items()} for row in head]
    table = preview.display_columns(columns, [[r[c] for c in columns] for r in shown])
    st.dataframe({"row": list(range(len(head))), **table}, hide_index=True)
    for i, row in enumerate(head[:5]):
        ref = preview.reference_answer(row)
        label = f"Row {i}" + (f" · {row['data_source']}" if row.get("data_source") else "")
        label += f" · ground truth {ref[1]}" if ref else " · no ground truth"
        with st.expander(label):
            if "prompt" in row:
                st.text(preview.render_prompt(row["prompt"]))
            st.json(json.dumps(row, default=str, ensure_ascii=False), expanded=False)


def _config_settings() -> tuple[str, int]:
    """The model and data.max_prompt_length of the config being edited."""
    draft = editing_config()
    return draft.actor_rollout_ref.model.path, draft.data.max_prompt_length


def _follow_config() -> None:
    """Set the model and length fields from the config being edited: on the first visit unless a test or another
    page set them, and again whenever that config names another model or length. An edit here holds until then."""
    ss = st.session_state
    settings = _config_settings()
    if FROM_CONFIG not in ss:
        ss.setdefault("data_model_name", settings[0])
        ss.setdefault("data_max_prompt_length", settings[1])
    elif ss[FROM_CONFIG] != settings:
        ss["data_model_name"], ss["data_max_prompt_length"] = settings
    ss[FROM_CONFIG] = settings


def _token_length_fields(summary: dict[str, Any]) -> tuple[str, int, Any] | None:
    """The section's fields and an empty slot that says what it waits for; the histogram fills the slot once
    the rest of the page is drawn (it needs the model's tokenizer, which may have to be built first)."""
    st.subheader("Prompt token lengths")
    st.session_state["_data_tokenizer_ok"] = st.session_state["_data_lengths_fit"] = None  # set once measured
    if not summary["prompts"]:
        st.info("No prompt column: nothing to measure.")
        return None
    model_from, length_from = st.session_state[FROM_CONFIG]
    left, right = st.columns(2)
    max_len = int(left.number_input("data.max_prompt_length", min_value=1, step=32, key="data_max_prompt_length"))
    model = right.text_input("Tokenizer of model", key="data_model_name",
                             help=f"A shipped model ({', '.join(SHIPPED)}), a model folder, or a Hub id.")
    st.caption(f"From the config being edited: {model_from}, data.max_prompt_length={length_from}. Change them "
               "here to look with another model or length; the config stays as it is.")
    slot = st.empty()
    slot.status(f"Loading the tokenizer of {model.strip() or '(no model)'} to count "
                f"{len(summary['prompts']):,} prompts' tokens...", state="running")
    return model, max_len, slot


def _token_lengths(slot, path: Path, stamp: tuple[int, int], summary: dict[str, Any], model: str,
                   max_len: int) -> None:
    try:
        checked = _checked_model(model)
        hist = _lengths(str(path), stamp, checked, max_len)
    except Exception as e:  # any tokenizer failure: skip the histogram, keep the page
        slot.warning(f"Token lengths skipped: the tokenizer of '{model}' could not be loaded or used "
                     f"({type(e).__name__}: {e})")
        return
    st.session_state["_data_tokenizer_ok"] = checked
    # Every row measured, none rejected or over: the engine's own length check would tokenize them all again.
    st.session_state["_data_lengths_fit"] = (hist["n"] == summary["rows"] and not hist["n_invalid"]
                                             and not hist["n_over"])
    fig = go.Figure(go.Histogram(x=hist["lengths"], nbinsx=50, name="prompts"))
    fig.add_vline(x=max_len, line_dash="dash", line_color="red",
                  annotation_text=f"max_prompt_length={max_len}", annotation_position="top right")
    fig.update_layout(xaxis_title="prompt tokens (chat template applied)", yaxis_title="prompts",
                      height=320, margin=dict(t=30, b=40, l=40, r=20), showlegend=False)
    sampled = "all rows" if hist["n"] + hist["n_invalid"] >= summary["rows"] else \
        f"a fixed sample of {hist['n'] + hist['n_invalid']:,} rows"
    note = f"; {hist['n_invalid']} prompts the engine would reject are left out" if hist["n_invalid"] else ""
    with slot.container():
        st.plotly_chart(fig, key="data_length_histogram")
        st.caption(f"{sampled}, {checked}'s tokenizer: max {hist['max']}, mean {hist['mean']:.1f} tokens; "
                   f"{hist['n_over']} over data.max_prompt_length={max_len}{note}.")


def _sources_and_truths(summary: dict[str, Any]) -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("Data sources")
        if not summary["has_data_source"]:
            st.info("No data_source column: the reward function cannot be chosen per row.")
        elif summary["sources"]:
            names = [str(s) for s, _ in summary["sources"]]
            fig = go.Figure(go.Bar(x=names, y=[n for _, n in summary["sources"]]))
            fig.update_layout(yaxis_title="rows", height=300, margin=dict(t=20, b=40, l=40, r=20))
            st.plotly_chart(fig, key="data_sources_chart")
            known = set(known_data_sources())
            unknown = [n for n in names if n not in known]
            if unknown:
                st.warning(f"No built-in reward for: {', '.join(unknown)} (set custom_reward_function).")
    with right:
        st.subheader("Ground truth")
        presence = summary["presence"]
        if not presence["by_column"]:
            st.warning("No ground-truth column (reward_model.ground_truth, ground_truth or answer).")
        else:
            st.dataframe({"column": list(presence["by_column"]),
                          "non-empty rows": list(presence["by_column"].values())}, hide_index=True)
            missing = presence["without_ground_truth"]
            (st.warning if missing else st.success)(
                f"{presence['with_ground_truth']:,} of {presence['rows']:,} rows have a ground truth"
                + (f"; {missing:,} do not." if missing else "."))


def _sql_box(path: Path) -> None:
    st.subheader("SQL (read-only)")
    st.caption("One SELECT over the view `data` (DuckDB). At most 1,000 rows come back; other files, "
               "tables and statements are refused.")
    sql = st.text_area("Query", key="sql_input", height=100)
    if st.button("Run query", key="sql_run"):
        try:
            with st.spinner("Running the query...", show_time=True), preview.open_parquet(path) as pv:
                columns, rows = pv.query(sql or "")
            st.session_state["_data_sql"] = (str(path), sql, columns, rows, None)
        except preview.PreviewError as e:
            st.session_state["_data_sql"] = (str(path), sql, None, None, str(e))
    last = st.session_state.get("_data_sql")
    if not last or last[0] != str(path) or last[1] != sql:
        return
    _, _, columns, rows, error = last
    if error:
        st.error(error)
        return
    st.dataframe(preview.display_columns(columns, rows), hide_index=True, key="sql_result")
    st.caption(f"{len(rows):,} row{'s' if len(rows) != 1 else ''}")


def _fill_from_reference(options: dict[str, tuple[str, str, str]]) -> None:
    picked = options.get(st.session_state.get("reward_reference_pick"))
    if picked is None:
        return
    source, response, truth = picked
    st.session_state["reward_response"] = response
    st.session_state["reward_ground_truth"] = truth
    if source in known_data_sources():
        st.session_state["reward_source"] = source


def _reward_playground(summary: dict[str, Any], path: Path) -> None:
    st.subheader("Reward playground")
    sources = known_data_sources()
    file_sources = [s for s, _ in summary["sources"] if s in sources]
    default = sources.index(file_sources[0]) if file_sources else 0
    options: dict[str, tuple[str, str, str]] = {}
    for i, row in enumerate(summary["head"][:REFERENCE_ROWS]):
        ref = preview.reference_answer(row)
        if ref:
            short = ref[0].replace("\n", " ")
            options[f"row {i}: {short[:60]}{'...' if len(short) > 60 else ''}"] = \
                (str(row.get("data_source") or ""), ref[0], ref[1])

    left, right = st.columns(2)
    if st.session_state.get("reward_source") not in sources:
        st.session_state["reward_source"] = sources[default]
    source = left.selectbox("Reward (by data_source)", sources, key="reward_source")
    right.selectbox("Fill in a reference answer from the file", [TYPE_YOUR_OWN, *options],
                    key="reward_reference_pick", on_change=_fill_from_reference, args=(options,))
    with st.expander("Your own reward function instead"):
        custom_path = st.text_input("custom_reward_function.path", key="reward_custom_path",
                                    placeholder="rewards/my_reward.py")
        custom_name = st.text_input("custom_reward_function.name", key="reward_custom_name",
                                    placeholder="compute_score")
    response = st.text_area("Response", key="reward_response", height=120,
                            placeholder="The model's answer, e.g. 3 + 4 = 7. #### 7")
    truth = st.text_input("Ground truth", key="reward_ground_truth", placeholder="7")
    inputs = (source, response, truth, custom_path, custom_name)
    if st.button("Score", key="reward_score_button"):
        with st.spinner("Scoring..."):
            st.session_state["_data_reward"] = (inputs, preview.score_response(*inputs))
    last = st.session_state.get("_data_reward")
    if last and last[0] == inputs:
        result = last[1]
        cols = st.columns(4)
        cols[0].metric("Score", "—" if result["score"] is None else str(round(result["score"], 4)))
        cols[1].metric("Strict (#### n)", result["strict"] or "—")
        cols[2].metric("Flexible (last number)", result["flexible"] or "—")
        cols[3].metric("Boxed", result["boxed"] or "—")
        if result["error"]:
            st.error(result["error"])
        if result["parts"] or result["pred"] is not None:
            st.json({"parts": result["parts"], "pred": result["pred"]}, expanded=True)

    if st.button(f"Score the reference answers of the first {REFERENCE_ROWS} rows", key="score_references_button"):
        with st.spinner("Scoring reference answers..."):
            st.session_state["_data_refs"] = (str(path), custom_path, custom_name, preview.score_reference_answers(
                summary["head"], n=REFERENCE_ROWS, custom_path=custom_path, custom_name=custom_name))
    refs = st.session_state.get("_data_refs")
    if refs and refs[:3] == (str(path), custom_path, custom_name):
        report = refs[3]
        if report["error"]:
            st.error(report["error"])
        elif report["n"] == 0:
            st.info("No row has a ground truth to build a reference answer from.")
        elif not report["failures"]:
            st.success(f"All {report['n']} reference answers get full marks.")
        else:
            st.error(f"{report['full_marks']} of {report['n']} reference answers get full marks; a correct "
                     "answer scored below 1 means the scorer or the ground truth is off.")
            fails = report["failures"]
            st.dataframe(preview.display_columns(list(fails[0]), [list(f.values()) for f in fails]), hide_index=True)


def _environment_playground(summary: dict[str, Any], path: Path) -> None:
    """One episode of the configured environment, stepped by hand: the user writes the assistant's turns."""
    st.subheader("Environment playground")
    mt = editing_config().actor_rollout_ref.rollout.multi_turn
    tools = ", ".join(mt.tools) or "none"
    st.caption(f"The environment `{mt.environment}` with tools {tools}, as actor_rollout_ref.rollout.multi_turn "
               f"in the config{'' if mt.enable else ' (multi-turn is off there: a run would not use it)'}. Write "
               'what the model might, e.g. `<tool_call>{"name": "calculator", "arguments": {"expression": '
               '"347 * 86"}}</tool_call>`, and see the environment answer.')
    rows = summary["head"][:REFERENCE_ROWS]
    if not rows:
        st.info("The file has no rows to start an episode from.")
        return
    pick = st.selectbox("Start from row", list(range(len(rows))), key="env_row",
                        format_func=lambda i: f"row {i}: {one_line(preview.render_prompt(rows[i].get('prompt')), 60)}")
    key = (str(path), pick, repr(mt))
    held = st.session_state.get("_env_trial")
    if st.button("Start again", key="env_restart") or held is None or held[0] != key:
        try:
            held = (key, playground.EnvironmentTrial(mt, rows[pick], f"{path.name} row {pick}"))
        except ValueError as e:  # a tool, an environment or the row that cannot be used: say which
            st.session_state.pop("_env_trial", None)
            st.error(str(e))
            return
        st.session_state["_env_trial"] = held
    trial = held[1]
    with st.expander(f"Tools offered to the model ({len(trial.tools)})"):
        st.json(trial.tools, expanded=False)
    for message in trial.messages:
        st.chat_message(message.get("role", "user")).markdown(markdown_literal(str(message.get("content", ""))))
    if trial.error:
        st.error(trial.error)
    for turn in trial.turns:
        _draw_turn(turn)
    if trial.done:
        total = trial.total_reward()
        st.success(f"Episode over after {len(trial.turns)} assistant turn(s)"
                   + (f"; environment reward {total}" if total else "; the run's reward function scores the last "
                      "assistant message"))
        return
    text = st.text_area("Assistant turn", key="env_assistant_text", height=100)
    if st.button("Send to the environment", key="env_send"):
        if not text.strip():
            st.warning("Write the assistant's turn first.")
            return
        with st.spinner("The environment answers..."):
            trial.step(text)
        st.rerun()


def _draw_turn(turn: dict[str, Any]) -> None:
    st.chat_message("assistant").code(turn["assistant"], language=None, wrap_lines=True)
    for call in turn["tool_calls"]:
        label = f"tool call `{call['name'] or '?'}` ({call['seconds']:.3f} s)"
        with st.chat_message("tool", avatar=":material/build:"):
            st.markdown(label)
            if call["arguments"] is not None:
                st.json(call["arguments"])
            (st.error if call["failure"] else st.code)(call["output"])
    for message in turn["observation"] if not turn["tool_calls"] else []:
        st.chat_message(message.get("role", "user")).markdown(markdown_literal(str(message.get("content", ""))))
    if turn["error"]:
        st.error(f"The environment failed: {turn['error']} (a run ends this episode with reward 0)")
    if turn["reward"]:
        st.caption(f"reward parts: {turn['reward']}")
    if turn.get("truncated"):
        st.warning(f"Episode ended: {turn['truncated']}")


def _engine_problems_slot(summary: dict[str, Any]) -> Any:
    """The section's header and an empty slot for its verdict (filled last: it waits for the tokenizer), or None
    when the file is too big to check without the user's go-ahead and it was not given."""
    st.subheader("Problems the engine would reject")
    if summary["rows"] > AUTO_CHECK_ROWS and not st.button(
            f"Check all {summary['rows']:,} rows (loads the file as the trainer does; may take a while)",
            key="problems_check_button"):
        return None
    slot = st.empty()
    slot.status("Reading every row as the trainer does (after the prompt lengths)...", state="running")
    return slot


def _engine_problems(slot, path: Path, stamp: tuple[int, int], max_len: int) -> None:
    model = st.session_state.get("_data_tokenizer_ok")
    fit = st.session_state.get("_data_lengths_fit")
    problems = _problems(str(path), stamp, None if fit else model, max_len)
    with slot.container():
        if not problems:
            length = f" and every prompt fits data.max_prompt_length={max_len}" if model else ""
            st.success(f"The engine would load this file: every row has the expected shape, every data_source a "
                       f"reward{length}.")
        for problem in problems:
            st.error(problem)
        st.caption("A custom_reward_function in the config scores data sources without a built-in reward.")


def main() -> None:
    if is_entry_point(__file__):
        st.set_page_config(page_title="Data · GRPO Workbench", layout="wide")
    # Defaults through session state, not value=: a test or another page may preset these keys.
    st.session_state.setdefault("sql_input", DEFAULT_SQL)
    _follow_config()
    st.title("Data")
    path = _pick_file()
    if path is None:
        return
    try:
        stamp = _stamp(path)
        with st.spinner(f"Reading {path.name}..."):
            summary = _summary(str(path), stamp)
    except (preview.PreviewError, OSError) as e:
        st.error(str(e))
        return
    except Exception as e:  # whatever else reading the file raised: say so, do not crash
        st.error(f"{path}: could not be read ({type(e).__name__}: {e})")
        return
    st.caption(f"Showing `{path}`")
    guarded(_overview, summary)
    guarded(_first_rows, summary)
    lengths = _token_length_fields(summary)
    guarded(_sources_and_truths, summary)
    guarded(_sql_box, path)
    guarded(_reward_playground, summary, path)
    guarded(_environment_playground, summary, path)
    problems_slot = _engine_problems_slot(summary)
    # What needs the model's tokenizer comes last, into the slots left for it: the rest of the page is drawn.
    max_len = int(st.session_state["data_max_prompt_length"])
    if lengths is not None:
        model, field_len, slot = lengths
        guarded(_token_lengths, slot, path, stamp, summary, model, field_len, slot=slot)
    if problems_slot is not None:
        guarded(_engine_problems, problems_slot, path, stamp, max_len, slot=problems_slot)


# Streamlit runs the page as `__main__` (streamlit run, st.navigation, AppTest); importing it under another
# name, as a test does to lower UPLOAD_LIMIT_MB before calling main(), must not draw it.
if __name__ == "__main__":
    main()
