"""Compare: two models side by side, on your own prompts (answers streamed as they are written) or
scored on a data file (accuracy, pass@k, maj@k, the difference with its confidence interval, and the
questions where they disagree); and evaluating or exporting one checkpoint of a run.

The page draws what `backend.services.compare` and `backend.services.export` answer; loaded models are cached there,
not here. Every error is shown as a message where it happened; the rest of the page still renders.

Runs inside the workbench (app/main.py, st.navigation), or on its own under AppTest.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import streamlit as st
from page_support import OPENED_RUN, editing_config, guarded, imports_warmed_up, is_entry_point

from backend.core import workspace
from backend.core.models import SHIPPED, is_model_folder
from backend.rollout.base import SamplingParams
from backend.services import compare
from backend.services.export import export_checkpoint
from backend.services.launcher import list_runs
from backend.services.model_picker import compare_defaults, exports_dir, model_choices

MAX_PROMPTS = 20
MAX_DISAGREEMENTS_SHOWN = 50
DEFAULT_PROMPTS = "Tom has 3 apples and buys 4 more. How many apples does he have now?"


def _error(what: str, e: Exception) -> None:
    st.error(f"{what}: {e}" if isinstance(e, (ValueError, OSError)) else f"{what}: {type(e).__name__}: {e}")


# ---- picking models and files ----


def _choices() -> list[tuple[str, str]]:
    return model_choices(workspace.runs_root(), exports_dir())


def _resolve_model(side: str, choices: dict[str, str]) -> str:
    """The model of side "a" or "b": a typed folder wins over the list."""
    typed = (st.session_state.get(f"compare_path_{side}") or "").strip()
    if typed:
        path = workspace.safe_path(typed)
        if not is_model_folder(path):
            raise workspace.PathError(f"{typed!r} is not a model folder (no config.json): point at a checkpoint "
                                      "(runs/<id>/checkpoints/step_N), a run's export/ or a Hugging Face folder")
        return str(path)
    label = st.session_state.get(f"compare_model_{side}")
    if label not in choices:
        raise workspace.PathError("pick a model")
    return choices[label]


def _pickers() -> tuple[str | None, str | None]:
    pairs = _choices()
    choices = dict(pairs)
    labels = list(choices)
    opened = st.session_state.get(OPENED_RUN)
    base = editing_config().actor_rollout_ref.model.path
    defaults = dict(zip("ab", compare_defaults(pairs, workspace.runs_root(), opened, base), strict=True))
    if opened:
        st.caption(f"Starting from the run you opened last, {opened}: A is its base model, B what it trained.")
    models: list[str | None] = []
    for col, side in zip(st.columns(2), "ab", strict=True):
        key = f"compare_model_{side}"
        if st.session_state.get(key) not in choices:  # a new visit (the page's pickers start over), or a run is gone
            st.session_state[key] = defaults[side]
        with col:
            st.subheader(f"Model {side.upper()}")
            st.selectbox("Model", labels, key=key,
                         help=f"Shipped models ({', '.join(SHIPPED)}), each run's export/ and checkpoints, "
                              "and the folders under exports/.")
            st.text_input("...or a model folder", key=f"compare_path_{side}",
                          placeholder="runs/<id>/checkpoints/step_4",
                          help="Relative to the workspace folder, or absolute inside an allowed folder "
                               "(GRPO_WB_ROOTS). A typed folder wins over the list.")
            try:
                models.append(_resolve_model(side, choices))
            except workspace.PathError as e:
                st.error(str(e))
                models.append(None)
    return models[0], models[1]


def _listed_files() -> list[str]:
    root = workspace.workspace_root()
    found = []
    for folder in (root / "sample_data", workspace.uploads_dir()):
        if folder.is_dir():
            found += sorted(str(p.relative_to(root)) for p in folder.glob("*.parquet") if p.is_file())
    return found


def _pick_data(prefix: str, with_path: bool = True) -> Path | None:
    files = _listed_files()
    if files and st.session_state.get(f"{prefix}_data") not in files:
        val = [f for f in files if "val" in Path(f).stem]
        st.session_state[f"{prefix}_data"] = val[0] if val else files[0]
    left, right = st.columns(2)
    choice = left.selectbox("Data file", files, key=f"{prefix}_data",
                            placeholder="no parquet files in sample_data/ or uploads/")
    typed = right.text_input("...or a path to a parquet file", key=f"{prefix}_data_path",
                             placeholder="data/test.parquet") if with_path else ""
    try:
        if typed and typed.strip():
            return workspace.safe_path(typed, suffixes=(".parquet",))
        if choice:
            return workspace.safe_path(choice, suffixes=(".parquet",))
    except workspace.PathError as e:
        st.error(str(e))
        return None
    st.info("Pick a parquet file (sample_data/ and uploads/ are listed).")
    return None


def _sampling() -> tuple[float, int, int]:
    cols = st.columns(3)
    temperature = cols[0].number_input("Temperature (0 = greedy)", min_value=0.0, max_value=2.0, step=0.1,
                                       key="compare_temperature")
    max_tokens = cols[1].number_input("Max new tokens", min_value=1, max_value=4096, step=16,
                                      key="compare_max_tokens")
    seed = cols[2].number_input("Seed", min_value=0, step=1, key="compare_seed",
                                help="Both models sample with the same seed.")
    return float(temperature), int(max_tokens), int(seed)


# ---- prompts, streamed side by side ----


def _answer_boxes(prompt: str):
    st.markdown(f"**Prompt:** {prompt}")
    left, right = st.columns(2)
    return left.empty(), right.empty()


def _answer(text: str) -> None:
    """An answer in a box; one that shows nothing gets a line saying what it is made of and why."""
    st.code(text or " ", language=None, wrap_lines=True)
    blank = compare.blank_answer(text)
    if blank == "empty":
        st.caption("The answer is empty: the model stopped at once, or wrote only special tokens, which are not shown.")
    elif blank:
        st.caption(f"The answer is {blank}, nothing else. Small random models such as the shipped tiny ones often "
                   "answer with whitespace only; a trained real model answers in words.")


def _show(slot, text: str, done: bool = True) -> None:
    """The answer so far in `slot`; what a blank one is made of only once it is complete."""
    if done:
        with slot.container():
            _answer(text)
    else:
        slot.code(text or " ", language=None, wrap_lines=True)


def _prompts_section(model_a: str | None, model_b: str | None, temperature: float, max_tokens: int,
                     seed: int) -> None:
    st.text_area(f"Prompts, one per line (at most {MAX_PROMPTS})", key="compare_prompts", height=110)
    prompts = [p.strip() for p in (st.session_state.get("compare_prompts") or "").splitlines() if p.strip()]
    if len(prompts) > MAX_PROMPTS:
        st.warning(f"{len(prompts)} prompts: only the first {MAX_PROMPTS} are answered.")
        prompts = prompts[:MAX_PROMPTS]
    params = SamplingParams(n=1, temperature=temperature or 1.0, max_new_tokens=max_tokens, greedy=temperature == 0)
    inputs = (model_a, model_b, tuple(prompts), temperature, max_tokens, seed)
    clicked = st.button("Answer with both models", key="compare_go", type="primary",
                        disabled=not (model_a and model_b and prompts))
    if clicked:
        st.session_state.pop("_compare_answers", None)
        try:
            with st.spinner("Loading the models (once; they stay loaded)..."):
                imports_warmed_up()
                compare.load_cached(model_a)
                compare.load_cached(model_b)
        except Exception as e:  # noqa: BLE001 - any loading failure is a message
            _error("Could not load the models", e)
            return
        answers = []
        for prompt in prompts:
            slot_a, slot_b = _answer_boxes(prompt)
            text_a = text_b = ""
            try:
                for text_a, text_b in compare.stream_answers(model_a, model_b, prompt, params, seed=seed):
                    _show(slot_a, text_a, done=False)
                    _show(slot_b, text_b, done=False)
            except Exception as e:  # noqa: BLE001
                _error("Generation failed", e)
                return
            _show(slot_a, text_a)
            _show(slot_b, text_b)
            answers.append((prompt, text_a, text_b))
        st.session_state["_compare_answers"] = (inputs, answers)
        return
    saved = st.session_state.get("_compare_answers")
    if saved and saved[0] == inputs:
        for prompt, text_a, text_b in saved[1]:
            slot_a, slot_b = _answer_boxes(prompt)
            _show(slot_a, text_a)
            _show(slot_b, text_b)


# ---- scored on a data file ----


def _fmt(x: float) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _verdict(result: compare.CompareResult) -> str:
    if math.isnan(result.ci_low):
        return "too few questions for an interval"
    if result.ci_low > 0:
        return "B is better (the interval lies above 0)"
    if result.ci_high < 0:
        return "A is better (the interval lies below 0)"
    return "no clear difference (the interval contains 0)"


def _draw_batch(result: compare.CompareResult) -> None:
    how = "greedy" if result.k == 1 else f"{result.k} samples at temperature {result.temperature:g}, seed {result.seed}"
    st.caption(f"{result.n} questions of `{result.data_file}` · {how} · at most {result.max_new_tokens} new tokens")
    for col, side, scores in zip(st.columns(2), "AB", (result.a, result.b), strict=True):
        with col:
            st.markdown(f"**{side}:** `{scores.model}`")
            cells = st.columns(3)
            cells[0].metric("Accuracy", _fmt(scores.accuracy),
                            help="First sample of each question (the greedy answer when k = 1).")
            cells[1].metric(f"pass@{result.k}", _fmt(scores.pass_at_k), help="Any of the k samples correct.")
            cells[2].metric(f"maj@{result.k}", _fmt(scores.maj_at_k),
                            help="The most frequent extracted answer correct (ties: the answer seen first).")
    st.metric("Accuracy difference B − A", f"{result.difference:+.3f}",
              help="Paired by question: mean of d_i = correct_B − correct_A, with a 95% interval "
                   "mean ± 1.96·sd(d)/√n (normal approximation).")
    st.markdown(f"95% confidence interval [{_fmt(result.ci_low)}, {_fmt(result.ci_high)}]: {_verdict(result)}.")
    st.subheader(f"Disagreements ({len(result.disagreements)})")
    if not result.disagreements:
        st.info("On every question both models are right, or both wrong.")
    for d in result.disagreements[:MAX_DISAGREEMENTS_SHOWN]:
        who = "A right, B wrong" if d["correct_a"] else "B right, A wrong"
        with st.expander(f"Question {d['index']} · {who} · ground truth {d['ground_truth']}"):
            st.text(d["question"])
            left, right = st.columns(2)
            with left:
                st.markdown(f"**A** ({'right' if d['correct_a'] else 'wrong'}, answer {d['pred_a']})")
                _answer(d["answer_a"])
            with right:
                st.markdown(f"**B** ({'right' if d['correct_b'] else 'wrong'}, answer {d['pred_b']})")
                _answer(d["answer_b"])
    if len(result.disagreements) > MAX_DISAGREEMENTS_SHOWN:
        st.caption(f"The first {MAX_DISAGREEMENTS_SHOWN} of {len(result.disagreements)} are shown.")


def _batch_section(model_a: str | None, model_b: str | None, temperature: float, max_tokens: int,
                   seed: int) -> None:
    data_file = _pick_data("compare")
    cols = st.columns(2)
    k = int(cols[0].number_input("Samples per question (k)", min_value=1, max_value=64, key="compare_k",
                                 help="k = 1: one greedy answer. k > 1: k sampled answers at the temperature "
                                      "above (1.0 when it is 0), for pass@k and maj@k."))
    limit = int(cols[1].number_input("First N questions (0 = all)", min_value=0, step=10, key="compare_limit"))
    inputs = (model_a, model_b, str(data_file), k, limit, temperature, max_tokens, seed)
    if st.button("Compare on the file", key="compare_batch_go", type="primary",
                 disabled=not (model_a and model_b and data_file)):
        st.session_state.pop("_compare_batch", None)
        bar = st.progress(0.0, text="Loading the models...")

        def progress(what: str, done: int, total: int) -> None:
            offset = 0 if what.endswith("A") else total
            bar.progress(min(1.0, (offset + done) / max(1, 2 * total)), text=f"{what}: {done}/{total} questions")

        try:
            imports_warmed_up()
            result = compare.compare_on_file(model_a, model_b, data_file, k=k, limit=limit,
                                             temperature=temperature or 1.0, max_new_tokens=max_tokens, seed=seed,
                                             progress=progress)
        except Exception as e:  # noqa: BLE001 - bad file, unknown data source, model that will not load
            bar.empty()
            _error("Comparison failed", e)
            return
        bar.empty()
        st.session_state["_compare_batch"] = (inputs, result)
    saved = st.session_state.get("_compare_batch")
    if saved and saved[0] == inputs:
        _draw_batch(saved[1])


# ---- one run: evaluate a checkpoint, export it ----


def _run_section() -> None:
    runs = list_runs(workspace.runs_root())
    if not runs:
        st.info("No runs yet: launch one on the Runs page (or `python -m backend train`).")
        return
    by_name = {r.name: r for r in runs}
    if st.session_state.get("evalx_run") not in by_name:
        opened = st.session_state.get(OPENED_RUN)
        st.session_state["evalx_run"] = opened if opened in by_name else runs[0].name
    left, right = st.columns(2)
    run = by_name[left.selectbox("Run", list(by_name), key="evalx_run")]
    checkpoints = list(reversed(run.checkpoints)) + (["export"] if (run.path / "export" / "config.json").is_file()
                                                     else [])
    if not checkpoints:
        st.info(f"Run {run.name} has no checkpoint yet.")
        _previous_evaluations(run.path)
        return
    if st.session_state.get("evalx_checkpoint") not in checkpoints:
        st.session_state["evalx_checkpoint"] = checkpoints[0]
    ckpt = right.selectbox("Checkpoint", checkpoints, key="evalx_checkpoint")

    st.subheader("Evaluate")
    data_file = _pick_data("evalx", with_path=False)
    limit = int(st.number_input("First N questions (0 = all)", min_value=0, step=10, key="evalx_limit"))
    if st.button("Evaluate the checkpoint", key="evalx_eval", disabled=data_file is None):
        with st.status(f"Evaluating {run.name} · {ckpt} on {data_file.name}...", expanded=True) as status:
            bar = st.progress(0.0, text="Loading the model...")
            try:
                imports_warmed_up()
                out = compare.evaluate_checkpoint(
                    run.path, ckpt, data_file, limit=limit,
                    progress=lambda done, total: bar.progress(done / max(1, total), text=f"{done}/{total} questions"))
            except Exception as e:  # noqa: BLE001
                status.update(label="Evaluation failed", state="error")
                _error("Evaluation failed", e)
            else:
                status.update(label=f"Evaluated: saved in {out.relative_to(run.path)}", state="complete",
                              expanded=False)
                st.session_state["_evalx_last"] = str(out)
    last = next((e for e in compare.list_evaluations(run.path) if e["path"] == st.session_state.get("_evalx_last")),
                None)
    if last is not None:
        acc = last.get("metrics", {}).get("val/accuracy")
        st.metric(f"Accuracy of {last['checkpoint']} on {Path(last['data_file']).name} ({last.get('n')} questions)",
                  _fmt(acc))
    _previous_evaluations(run.path)

    st.subheader("Export")
    default = f"{run.name}-{ckpt}"[:64].strip("-._") or "export"
    if st.session_state.get("_evalx_default_name") != default:
        if st.session_state.get("evalx_export_name") in (None, "", st.session_state.get("_evalx_default_name")):
            st.session_state["evalx_export_name"] = default
        st.session_state["_evalx_default_name"] = default
    cols = st.columns([3, 1])
    name = cols[0].text_input("Folder name under exports/", key="evalx_export_name",
                              help="A plain Hugging Face folder: weights, tokenizer and a model card.")
    overwrite = cols[1].checkbox("Replace if it exists", key="evalx_export_overwrite")
    if st.button("Export as a Hugging Face folder", key="evalx_export"):
        st.session_state.pop("_evalx_exported", None)
        try:
            target = exports_dir() / workspace.check_name((name or "").strip(), "export folder name")
            source = run.path / ("export" if ckpt == "export" else f"checkpoints/{ckpt}")
            with st.spinner(f"Exporting {ckpt} to {target}..."):
                out = export_checkpoint(source, target, overwrite=overwrite)
            st.session_state["_evalx_exported"] = str(out)
        except Exception as e:  # noqa: BLE001
            _error("Export failed", e)
    exported = st.session_state.get("_evalx_exported")
    if exported and Path(exported).is_dir():
        st.success(f"Exported to `{exported}`; it loads with AutoModelForCausalLM.from_pretrained and is listed "
                   "in the model pickers above.")


def _previous_evaluations(run_dir: Path) -> None:
    evaluations = compare.list_evaluations(run_dir)
    if not evaluations:
        st.caption("No saved evaluations of this run yet.")
        return
    st.markdown("**Saved evaluations of this run**")
    st.dataframe({
        "checkpoint": [e.get("checkpoint") for e in evaluations],
        "step": [e.get("step") for e in evaluations],
        "data file": [Path(str(e.get("data_file"))).name for e in evaluations],
        "questions": [e.get("n") for e in evaluations],
        "accuracy": [e.get("metrics", {}).get("val/accuracy") for e in evaluations],
        "evaluated": [time.strftime("%Y-%m-%d %H:%M", time.localtime(e.get("timestamp") or 0)) for e in evaluations],
    }, hide_index=True, key="evalx_previous")


def main() -> None:
    if is_entry_point(__file__):
        st.set_page_config(page_title="Compare · GRPO Workbench", layout="wide")
    # Defaults through session state, not value=: a test or another page may preset these keys.
    for key, value in (("compare_temperature", 0.0), ("compare_max_tokens", 64), ("compare_seed", 0),
                       ("compare_prompts", DEFAULT_PROMPTS), ("compare_k", 1), ("compare_limit", 20),
                       ("evalx_limit", 50)):
        st.session_state.setdefault(key, value)
    st.title("Compare")
    try:
        model_a, model_b = _pickers()
    except Exception as e:  # noqa: BLE001 - listing runs or building a shipped model failed
        _error("Could not list the models", e)
        model_a = model_b = None
    temperature, max_tokens, seed = _sampling()
    prompts, batch, run = st.tabs(["Prompts", "Data file", "Evaluate and export a run"])
    with prompts:
        guarded(_prompts_section, model_a, model_b, temperature, max_tokens, seed)
    with batch:
        guarded(_batch_section, model_a, model_b, temperature, max_tokens, seed)
    with run:
        guarded(_run_section)


main()
