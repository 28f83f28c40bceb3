"""Rollouts: what the model actually wrote, step by step.

Pick a run and a step; see the n responses to each prompt together, with the group's reward mean and
spread (a group whose responses all scored the same gives GRPO no signal), filter them, follow one
prompt across steps, and look at a logged response token by token (log-prob, entropy, advantage, KL,
clipping). A multi-turn run's responses are episodes: they are shown turn by turn, with each tool call,
its output and why the episode ended, and their tool and environment tokens are greyed in the token view.
Everything is read from the run directory through `backend.services.rollouts`; a run with no rollouts yet,
a deleted run or a torn file gets a message, never a stack trace.

Runs inside the workbench (app/main.py, st.navigation), or on its own under AppTest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import streamlit as st
from page_support import is_entry_point, one_line
from page_support import markdown_literal as _md

from backend.core import workspace
from backend.services import rollouts as ir
from backend.services.launcher import list_runs

MAX_GROUPS = 40  # expanders drawn per step; the filters narrow the rest
HISTORY_STEPS = 20  # steps whose texts are shown under the reward-vs-step chart (newest first)
PROMPT_LABEL = 70


# ---- cached reads (keyed by the file's stamp, so a rewritten file is read again) ----


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


@st.cache_data(show_spinner=False, max_entries=32)
def _load_step(run_dir: str, step: int, stamp: tuple[int, int] | None) -> list[dict]:
    return ir.load_step(run_dir, step)


@st.cache_data(show_spinner=False, max_entries=32)
def _history(run_dir: str, index: int, stamps: tuple) -> list[dict]:
    return ir.prompt_history(run_dir, index)


@st.cache_data(show_spinner=False, max_entries=32)
def _logged_rows(run_dir: str, step: int, stamp: tuple[int, int] | None) -> list[int]:
    return ir.logged_rows(run_dir, step)


@st.cache_data(show_spinner=False, max_entries=64)
def _token_view(run_dir: str, step: int, row: int, stamp: tuple[int, int] | None) -> dict | None:
    return ir.token_view(run_dir, step, row)


def _valid(key: str, options: list, default: Any) -> None:
    """Keep a widget's session value among its options (a new run or step changes them)."""
    if st.session_state.get(key) not in options:
        st.session_state[key] = default


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


# ---- picking a run and a step ----


def _pick_run() -> Path | None:
    root = workspace.runs_root()
    runs = list_runs(root)
    if not runs:
        st.info(f"No runs yet in {root}. Launch one on the Runs page.")
        return None
    names = [r.name for r in runs]
    _valid("rollouts_run", names, names[0])
    name = st.selectbox("Run", names, key="rollouts_run",
                        format_func=lambda n: f"{n} ({next(r.state for r in runs if r.name == n)})")
    run_dir = root / name
    if not run_dir.is_dir():
        st.warning(f"{name} was deleted.")
        return None
    return run_dir


def _pick_step(run_dir: Path) -> int | None:
    steps = ir.rollout_steps(run_dir)
    if not steps:
        st.info(f"{run_dir.name} has no rollouts yet: rollouts/step_NNNNNN.parquet is written when a step "
                "finishes (and not at all with trainer.rollout_log_max=0).")
        return None
    _valid("rollouts_step", steps, steps[-1])
    if len(steps) == 1:
        st.caption(f"Step {steps[0]}: the only step with rollouts so far.")
        return steps[0]
    return st.select_slider("Step", steps, key="rollouts_step",
                            help="Steps that have a rollouts parquet; new steps appear on the next interaction.")


# ---- filters ----


def _filters(rows: list[dict], summary: dict[str, Any]) -> dict[str, Any]:
    # At least [0, 1], so a filter set on one step still means the same on the next.
    lo = min(0.0, summary["min_reward"] if summary["min_reward"] is not None else 0.0)
    hi = max(1.0, summary["max_reward"] if summary["max_reward"] is not None else 1.0)
    current = st.session_state.get("rollouts_reward_range")
    previous = st.session_state.get("_rollouts_reward_bounds")
    whole_before = previous is not None and tuple(current or ()) == tuple(previous)
    if whole_before or not (isinstance(current, (tuple, list)) and len(current) == 2
                            and lo <= current[0] <= current[1] <= hi):
        st.session_state["rollouts_reward_range"] = (lo, hi)  # the whole range stays the whole range
    st.session_state["_rollouts_reward_bounds"] = (lo, hi)
    sources = summary["data_sources"]
    picked = [s for s in st.session_state.get("rollouts_sources") or [] if s in sources]
    st.session_state["rollouts_sources"] = picked
    c1, c2 = st.columns(2)
    low, high = c1.slider("Reward range", lo, hi, step=0.05, key="rollouts_reward_range",
                          help="Responses whose reward lies in the range (inclusive).")
    chosen = c2.multiselect("Data sources", sources, key="rollouts_sources", placeholder="all data sources")
    c3, c4, c5 = st.columns([1, 1, 2])
    truncated = c3.checkbox("Only truncated", key="rollouts_truncated",
                            help="finish_reason = length: the response hit data.max_response_length.")
    zero = c4.checkbox("Only zero-spread groups", key="rollouts_zero_spread",
                       help="Groups whose responses all got the same reward: GRPO's advantage is 0 for them.")
    text = c5.text_input("Search prompt and response", key="rollouts_search", placeholder="case-insensitive text")
    episode = {"tool_error": False, "max_turns": False, "no_tool_call": False}
    if ir.has_episodes(rows):
        c6, c7, c8 = st.columns([1, 1, 2])
        episode["tool_error"] = c6.checkbox("tool error", key="rollouts_tool_error",
                                            help="Episodes with a failed tool call or an environment error.")
        episode["max_turns"] = c7.checkbox("hit max turns", key="rollouts_max_turns",
                                           help="finish_reason = max_turns: the turn limits ended the episode.")
        episode["no_tool_call"] = c8.checkbox("no tool call", key="rollouts_no_tool_call",
                                              help="Episodes in which the model never called a tool.")
    return {"reward_min": low if low > lo else None, "reward_max": high if high < hi else None,
            "data_sources": chosen or None, "truncated_only": truncated, "zero_spread_only": zero,
            "text": text or None, **episode}


# ---- sections ----


def _header(step: int, summary: dict[str, Any]) -> None:
    cols = st.columns(5)
    cols[0].metric("Responses", summary["responses"])
    cols[1].metric("Prompts (groups)", summary["groups"])
    cols[2].metric("Mean reward", _fmt(summary["mean_reward"]))
    cols[3].metric("Zero-spread groups", summary["zero_spread_groups"],
                   help="All n responses got the same reward: no learning signal from this prompt.")
    cols[4].metric("Truncated", summary["truncated"], help="finish_reason = length")


def _response_line(r: dict, parts: list[str], tag: str) -> str:
    bits = [f"reward **{_fmt(r.get('reward'))}**"]
    shown_parts = [f"{p} {_fmt(r.get(ir.PART_PREFIX + p), '.2f')}" for p in parts]
    if shown_parts:
        bits[0] += f" ({', '.join(shown_parts)})"
    bits += [f"advantage {_fmt(r.get('advantage'), '+.3f')}", f"{r.get('response_length', '?')} tokens",
             f"finish {_md(r.get('finish_reason', '?'))}",
             f"answer {_md(r.get('pred'))}" if r.get("pred") is not None
             else "no answer extracted", f"row {r['row']}"]
    return f"{tag}{' · '.join(bits)}"


def _response(r: dict, parts: list[str], tag: str) -> None:
    """A response's line, then its text; an episode's turns in order instead, and why it ended."""
    st.markdown(_response_line(r, parts, tag))
    turns = ir.episode_turns(r)
    if turns is None:
        st.text(r.get("response") or "")
        if ir.is_episode(r):
            st.caption("The turns of this episode could not be read; its last assistant message is shown.")
        return
    for turn in turns:
        _turn(turn)
    if r.get("episode_error") and not any(t.get("role") == "error" for t in turns):  # reset or rendering failed
        st.error(f"Environment error: {_md(r['episode_error'])}")
    reason = r.get("finish_reason")  # the line above names it; this says why in words
    st.caption(f"turns {r.get('num_turns', len(turns))} · tool calls {r.get('tool_calls', '?')}, failed "
               f"{r.get('tool_failures', '?')} · ended: {_md(ir.finish_words(reason))}")


def _turn(turn: dict) -> None:
    role = str(turn.get("role") or "?")
    if role == "error":
        st.error(f"Environment error: {_md(turn.get('text'))}")
    elif role == "assistant":
        st.markdown(f"**assistant** · {_md(turn.get('tokens', '?'))} tokens")
        st.text(turn.get("text") or "")
        for call in turn.get("tool_calls") or []:
            _tool_call(call)
    else:  # an observation: a tool's output or the environment's message
        name = f" · {_md(turn['name'])}" if turn.get("name") else ""
        st.markdown(f"**{_md(role)}**{name}")
        st.text(turn.get("text") or "")


def _tool_call(call: dict) -> None:
    seconds = call.get("seconds")
    took = f" · {seconds:.2f} s" if isinstance(seconds, (int, float)) else ""
    st.markdown(f"↳ tool call **{_md(call.get('name') or 'unnamed')}**{took}")
    arguments = call.get("arguments")
    if arguments is None:
        st.caption("no arguments parsed")
    else:
        st.code(json.dumps(arguments, indent=2, ensure_ascii=False, default=str), language="json")
    failure = call.get("failure")
    if failure:
        words = ir.FAILURE_WORDS.get(str(failure), "")
        st.markdown(f":red-badge[tool error] **{_md(failure)}**{': ' + _md(words) if words else ''} · output:")
    else:
        st.caption("output:")
    st.text(call.get("output") or "")


def _groups(groups: list[dict], parts: list[str], n_groups: int) -> None:
    st.subheader("Groups")
    n_shown = sum(len(g["shown"]) for g in groups)
    st.caption(f"{len(groups)} of {n_groups} groups have responses passing the filters ({n_shown} responses). "
               "Mean and spread are over all n responses of a group.")
    if not groups:
        st.info("No response passes the filters.")
        return
    if len(groups) > MAX_GROUPS:
        st.caption(f"Showing the first {MAX_GROUPS} groups; narrow the filters to see the others.")
    for g in groups[:MAX_GROUPS]:
        spread = "zero spread" if g["zero_spread"] else f"min {_fmt(g['min'], '.2f')} … max {_fmt(g['max'], '.2f')}"
        label = (f"group {g['group']} · index {g['index']} · {_md(g['data_source'])} · mean {_fmt(g['mean'])} ± "
                 f"{_fmt(g['std'])} · {spread} · n={g['n']} · {_md(one_line(g['prompt'], 50))}")
        with st.expander(label):
            st.markdown(f"**Prompt** · ground truth {_md(g['ground_truth'])}")
            st.text(g["prompt"] or "")
            if len(g["shown"]) < g["n"]:
                st.caption(f"{len(g['shown'])} of the {g['n']} responses pass the filters.")
            for r in g["shown"]:
                tag = ""
                if not g["zero_spread"] and r.get("reward") == g["max"]:
                    tag = ":green-badge[best] "
                elif not g["zero_spread"] and r.get("reward") == g["min"]:
                    tag = ":red-badge[worst] "
                _response(r, parts, tag)


def _history_section(run_dir: Path, rows: list[dict], groups: list[dict]) -> None:
    st.subheader("Same prompt across steps")
    prompts = {int(g["index"]): g for g in groups if g.get("index") is not None}
    if not prompts:
        st.info("These rollouts have no dataset index column to follow a prompt by.")
        return
    options = list(prompts)
    _valid("rollouts_prompt", options, options[0])
    index = st.selectbox("Prompt", options, key="rollouts_prompt",
                         format_func=lambda i: f"index {i} · {prompts[i]['data_source']} · mean "
                                               f"{_fmt(prompts[i]['mean'], '.2f')} · "
                                               f"{one_line(prompts[i]['prompt'], PROMPT_LABEL)}")
    stamps = tuple((s, _stamp(ir.step_file(run_dir, s))) for s in ir.rollout_steps(run_dir))
    history = _history(str(run_dir), index, stamps)
    if not history:
        st.info("No readable responses to this prompt.")
        return
    visits = ir.group_rows(history)  # one group per step the prompt was sampled at
    steps = sorted({g["step"] for g in visits})
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[r["step"] for r in history], y=[r["reward"] for r in history], mode="markers",
                             name="responses", opacity=0.6,
                             text=[one_line(r.get("response"), 80) for r in history], hoverinfo="x+y+text"))
    fig.add_trace(go.Scatter(x=[g["step"] for g in visits], y=[g["mean"] for g in visits], mode="lines+markers",
                             name="group mean"))
    fig.update_layout(height=260, margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      xaxis={"title": "step", "tickformat": "d"},
                      yaxis_title="reward", legend={"orientation": "h", "y": -0.35})
    st.plotly_chart(fig, key="rollouts_history_chart")
    if len(steps) == 1:
        st.caption(f"So far this prompt was sampled only at step {steps[0]} (a prompt comes back once an epoch).")
    parts = ir.reward_parts(history)
    recent = set(steps[-HISTORY_STEPS:])
    for g in reversed([g for g in visits if g["step"] in recent]):
        with st.expander(f"step {g['step']} · group {g['group']} · {g['n']} responses · mean reward "
                         f"{_fmt(g['mean'])} ± {_fmt(g['std'])}"):
            for r in g["responses"]:
                _response(r, parts, "")
    if len(steps) > HISTORY_STEPS:
        st.caption(f"Texts of the newest {HISTORY_STEPS} of {len(steps)} steps shown; the chart has all.")


def _token_section(run_dir: Path, step: int, rows: list[dict]) -> None:
    st.subheader("Tokens")
    stamp = _stamp(ir.tokens_file(run_dir, step))
    logged = set(_logged_rows(str(run_dir), step, stamp))
    if not logged:
        st.info(f"No response of step {step} has a token record: rollouts/tokens_step_{step:06d}.parquet is "
                "missing (trainer.token_log_max=0, or a trainer from before the token log).")
        return
    st.caption(f"{len(logged)} of the {len(rows)} responses of this step have token records "
               "(trainer.token_log_max); the others say 'not logged'. Each token is decoded on its own.")
    by_row = {r["row"]: r for r in rows}
    options = sorted(by_row)
    _valid("rollouts_token_row", options, min(logged))
    c1, c2 = st.columns([2, 3])
    row = c1.selectbox("Response", options, key="rollouts_token_row",
                       format_func=lambda i: f"row {i} · group {by_row[i]['group']} · reward "
                                             f"{_fmt(by_row[i].get('reward'), '.2f')} · "
                                             f"{'logged' if i in logged else 'not logged'}")
    names = list(ir.TOKEN_QUANTITIES)
    _valid("rollouts_quantity", names, "advantage")
    quantity = c2.radio("Colour by", names, key="rollouts_quantity", horizontal=True,
                        format_func=lambda q: ir.TOKEN_QUANTITIES[q].label)
    if row not in logged:
        st.info(f"Row {row} was not logged: only {len(logged)} responses of this step have token records. "
                "Pick one marked 'logged'.")
        return
    record = _token_view(str(run_dir), step, row, stamp)
    if record is None:
        st.info(f"Row {row} was not logged.")
        return
    values, sampled = record[quantity], record["sampled"]
    spec = ir.TOKEN_QUANTITIES[quantity]
    stats = ir.token_summary(record, quantity)
    if not stats["with_value"]:
        st.info(f"{spec.label}: no values for this response"
                + (" (the run has no reference model)." if quantity in ("kl", "ref_log_prob") else "."))
    st.caption(spec.help)
    st.html(ir.token_legend_html(quantity, values, sampled=sampled))
    st.html(ir.token_html(record["tokens"], values, quantity, clipped=record["clipped"], sampled=sampled))
    counted = f"{stats['tokens']} tokens"
    if stats["sampled"] < stats["tokens"]:
        counted += f", {stats['sampled']} sampled by the policy"
    st.caption(f"{counted} · mean {spec.label.lower()} {_fmt(stats['mean'], '.4f')} · "
               f"{stats['clipped']} clipped · hover a token for its exact value.")
    if stats["sampled"] < stats["tokens"]:
        st.caption("Grey tokens are tool or environment output inside the episode: not sampled by the policy, they "
                   "carry no loss and are left out of the mean and the clipped count.")


def _guarded(section, *args) -> None:
    try:
        section(*args)
    except ir.InspectError as e:
        st.error(str(e))
    except Exception as e:  # a section's own bug must not take down the rest of the page
        st.error(f"{section.__name__.strip('_').replace('_', ' ')} failed: {type(e).__name__}: {e}")


def main() -> None:
    if is_entry_point(__file__):
        st.set_page_config(page_title="Rollouts · GRPO Workbench", layout="wide")
    st.title("Rollouts")
    run_dir = _pick_run()
    if run_dir is None:
        return
    step = _pick_step(run_dir)
    if step is None:
        return
    try:
        rows = _load_step(str(run_dir), step, _stamp(ir.step_file(run_dir, step)))
    except ir.InspectError as e:
        st.error(str(e))
        return
    except Exception as e:  # whatever else reading the file raised: say so, do not crash
        st.error(f"step {step} of {run_dir.name} could not be read ({type(e).__name__}: {e})")
        return
    if not rows:
        st.info(f"Step {step} logged no responses.")
        return
    summary = ir.step_summary(rows)
    _header(step, summary)
    filters = _filters(rows, summary)
    groups = ir.filtered_groups(rows, **filters)
    _guarded(_groups, groups, ir.reward_parts(rows), summary["groups"])
    _guarded(_history_section, run_dir, rows, ir.group_rows(rows))
    _guarded(_token_section, run_dir, step, rows)


main()
