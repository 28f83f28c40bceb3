"""Sweeps page: start a sweep of the config being edited over a grid or random ranges of keys, watch its
trials (table, overlaid curves, settings against result), stop a trial or the sweep, change how many trials
run at once, clone a trial with an edited config into the sweep, put the best trial's config on the Config
page, and delete a sweep once confirmed. Everything here calls backend.services.sweeps and reads the sweep's
folder; the trials are ordinary runs.

Runs on its own too under AppTest.from_file("pages/sweeps.py").
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import streamlit as st
from page_support import current_config_text, guarded, is_entry_point, one_line

from backend.core import workspace
from backend.core.config import ConfigError, config_from_yaml_text, to_yaml
from backend.core.runs import latest_checkpoint
from backend.services import launcher, presets, sweeps

if is_entry_point(__file__):
    st.set_page_config(page_title="Sweeps", layout="wide")

SELECTED = "sweeps_selected"
NOTICE = "_sweeps_notice"  # (sweep name, text): what the last control did, kept across the page's refreshes
DELETED = "_sweeps_deleted"  # what the delete button did, shown once after the page redraws without the sweep
REFRESH_S = 2.0


def _new_sweep(root) -> None:
    """The form that makes a sweep of the current config and starts it in the background."""
    cfg, problems = config_from_yaml_text(current_config_text())
    if problems:
        st.error("The current config cannot start:\n\n" + "\n".join(f"- {p}" for p in problems))
    keys = st.text_area("Keys to vary, one a line", key="sweep_keys", height=100,
                        placeholder="actor_rollout_ref.actor.optim.lr=1e-6,3e-6,1e-5\nactor_rollout_ref.rollout.n=4,8",
                        help="key=v1,v2,... for a grid (every combination), or key=low:high (key=low:high:log "
                             "for a log scale) for random draws, with a number of random trials below.")
    c1, c2, c3, c4 = st.columns(4)
    metric = c1.text_input("Rank by metric", value=launcher.SCORE_KEY, key="sweep_metric")
    direction = c2.radio("Best is", ["max", "min"], horizontal=True, key="sweep_direction")
    steps = c3.number_input("Steps a trial (0: the config's)", min_value=0, value=0, key="sweep_steps")
    trials = c4.number_input("Random trials (ranges only)", min_value=0, value=0, key="sweep_trials")
    c1, c2, c3 = st.columns(3)
    parallel = c1.number_input("Trials at once (0: as many as fit)", min_value=0, value=1, key="sweep_parallel")
    early = c2.selectbox("Early stopping", sweeps.EARLY_STOPPING, key="sweep_early",
                         help="median: stop a trial whose metric is worse than the median of the finished trials "
                              "at the same step (Optuna's median pruner); halving: of N trials, the best N/4 at step 1 "
                              "go on, N/16 at step 4, and so on, ranked once every running trial has reached the step.")
    name = c3.text_input("Sweep name", key="sweep_name", placeholder="lr-n")
    if st.button("Start sweep", key="sweep_start", type="primary", disabled=cfg is None):
        lines = [line.strip() for line in keys.splitlines() if line.strip()]
        try:
            grid = [line for line in lines if ":" not in line.split("=", 1)[-1]]
            params = sweeps.parse_grid(grid) + sweeps.parse_ranges([line for line in lines if line not in grid])
            spec = sweeps.SweepSpec(params=params, metric=metric.strip(), direction=direction,
                                    trials=int(trials) or None, steps=int(steps) or None, parallel=int(parallel),
                                    early_stopping=early)
            folder = sweeps.create_sweep(cfg, spec, name=name.strip() or sweeps.default_name(), runs_root=root)
        except sweeps.SweepError as e:
            st.error(str(e))
            return
        st.session_state[SELECTED] = folder.name
        try:
            sweeps.start_sweep(folder)
        except ConfigError as e:  # a cluster that takes no job: the sweep stays, to resume once it does
            st.error("\n\n".join(e.problems))
            return
        st.success(f"Started {folder.name}: {spec.total_trials()} trials")


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _trials_table(sweep: dict) -> None:
    spec = sweep["spec"]
    better = max if spec.direction == "max" else min
    best_so_far = None
    rows = []
    for t in sweep["trials"]:
        if t.state == "complete" and t.value is not None:
            best_so_far = t.value if best_so_far is None else better(best_so_far, t.value)
        rows.append({"trial": t.number, "state": t.state,
                     **{_short(k): v for k, v in t.values.items()},
                     "step": t.step, spec.metric: t.value, "best so far": best_so_far,
                     "why it stopped": one_line(t.reason or "", 120),
                     "clone of": "" if t.clone_of is None else f"#{t.clone_of}",
                     "run": t.run.rsplit("/", 1)[-1] if t.run else ""})
    st.dataframe(rows, hide_index=True, key="sweep_trials_table")


def _curves(sweep: dict) -> None:
    fig = go.Figure()
    for t in sweep["trials"]:
        if t.curve:
            label = f"#{t.number} " + " ".join(f"{_short(k)}={v:g}" if isinstance(v, float) else f"{_short(k)}={v}"
                                              for k, v in t.values.items())
            fig.add_trace(go.Scatter(x=[s for s, _ in t.curve], y=[v for _, v in t.curve], mode="lines+markers",
                                     name=label))
    if not fig.data:
        st.info("No trial has logged the metric yet.")
        return
    fig.update_layout(title=sweep["spec"].metric, height=320, xaxis_title="step",
                      margin={"l": 10, "r": 10, "t": 40, "b": 10})
    st.plotly_chart(fig, key="sweep_curves")


def _settings_against_result(sweep: dict) -> None:
    """Parallel coordinates: one axis per varied key (log10 for a log range), the metric last."""
    done = [t for t in sweep["trials"] if t.value is not None]
    if len(done) < 2:
        return
    dims = []
    for p in sweep["spec"].params:
        values = [t.values.get(p.key) for t in done]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            logs = p.log or (all(v > 0 for v in values) and max(values) / min(values) >= 100)
            dims.append({"label": ("log10 " if logs else "") + _short(p.key),
                         "values": [math.log10(v) if logs else v for v in values]})
        else:
            names = sorted({str(v) for v in values})
            dims.append({"label": _short(p.key), "values": [names.index(str(v)) for v in values],
                         "tickvals": list(range(len(names))), "ticktext": names})
    metric = [t.value for t in done]
    dims.append({"label": sweep["spec"].metric, "values": metric})
    fig = go.Figure(go.Parcoords(line={"color": metric, "colorscale": "Viridis", "showscale": True},
                                 dimensions=dims))
    fig.update_layout(height=320, margin={"l": 60, "r": 60, "t": 40, "b": 10})
    st.plotly_chart(fig, key="sweep_parcoords")


def _controls(sweep: dict) -> None:
    folder = sweep["path"]
    state = sweep["state"]
    active = state.get("state") in ("starting", "running")
    c1, c2, c3 = st.columns(3)
    at_once = c1.number_input("Trials at once", min_value=0, value=int(state.get("parallel", 1)),
                              key=f"sweep_at_once_{sweep['name']}")
    if c1.button("Apply", key="sweep_apply_parallel", disabled=not active):
        sweeps.set_parallel(folder, int(at_once))
        _notice(sweep, f"{int(at_once) or 'as many as fit'} at once from the next check on")
    if c2.button("Stop the sweep", key="sweep_stop", disabled=not active):
        sweeps.request_stop(folder)
        _notice(sweep, "Stopping: its running trials stop and no more start")
    if c3.button("Put the best trial's config on the Config page", key="sweep_promote",
                 disabled=sweep["best"] is None):
        st.session_state[presets.SESSION_KEY] = to_yaml(sweeps.best_config(folder))
        _notice(sweep, f"The Config page now holds trial #{sweep['best'].number}'s config")
    if state.get("state") in ("interrupted", "failed") and st.button("Resume the sweep", key="sweep_resume"):
        try:
            sweeps.start_sweep(folder)
        except ConfigError as e:
            _notice(sweep, "Not resumed: " + " ".join(e.problems))
        st.rerun()
    c1, c2, c3 = st.columns(3)
    confirm = c1.checkbox("Really delete this sweep", key="sweep_delete_confirm",
                          help="Stop the sweep first." if active else None)
    with_runs = c2.checkbox("with its trials' runs", key="sweep_delete_runs",
                            help="Without this the trials stay on the Runs page as ordinary runs.")
    if c3.button("Delete sweep", key="sweep_delete", disabled=active or not confirm):
        try:
            sweeps.delete_sweep(folder, with_runs=with_runs)
        except (sweeps.SweepError, ValueError, OSError) as e:
            _notice(sweep, f"Not deleted: {e}")
        st.session_state[DELETED] = f"Deleted sweep {sweep['name']}" + (" and its trials' runs" if with_runs else "")
        st.session_state.pop(SELECTED, None)
        st.rerun()
    running = [t for t in sweep["trials"] if t.state == "running" and t.run]
    if running:
        c1, c2 = st.columns([3, 1])
        pick = c1.selectbox("Running trial", [t.number for t in running], key="sweep_trial_to_stop",
                            format_func=lambda n: f"#{n}")
        if c2.button("Stop this trial", key="sweep_stop_trial"):
            run = next(t.run for t in running if t.number == pick)
            launcher.stop(run, wait=False)
            _notice(sweep, f"Stopping trial #{pick}; the sweep records it as stopped by hand")


def _notice(sweep: dict, text: str) -> None:
    """Say what a control did, and keep saying it: the refresh every two seconds redraws the page without
    the click that drew a plain message."""
    st.session_state[NOTICE] = (sweep["name"], text)
    st.rerun(scope="fragment")


def _clone(folder) -> None:
    """Fork a trial from its latest checkpoint with an edited config into the running sweep. Outside the
    refreshing part of the page, so that the editor keeps what is typed."""
    sweep = sweeps.read_sweep(folder)
    candidates = [(t, ckpt) for t in sweep["trials"] if t.run and (ckpt := latest_checkpoint(t.run)) is not None]
    if not candidates:
        st.caption("No trial has a checkpoint yet: a trial saves one every trainer.save_freq steps.")
        return
    numbers = [t.number for t, _ in candidates]
    pick = st.selectbox("Trial", numbers, index=len(numbers) - 1, format_func=lambda n: f"#{n}",
                        key="sweep_clone_trial")
    trial, ckpt = candidates[numbers.index(pick)]
    text = st.text_area(f"Config of the clone (from {ckpt.name})", launcher.fork_config_text(trial.run, ckpt.name),
                        height=240, key=f"sweep_clone_yaml_{sweep['name']}_{pick}_{ckpt.name}",
                        help="The trial's config: edit what the clone should change. It starts from the checkpoint "
                             "and joins the sweep as a new trial.")
    if st.button("Start clone", key="sweep_clone"):
        cfg, problems = config_from_yaml_text(text)
        if cfg is None:
            st.error("\n".join(problems))
            return
        try:
            number = sweeps.clone_trial(folder, pick, cfg)
        except sweeps.SweepError as e:
            st.error(str(e))
            return
        except ConfigError as e:
            st.error("\n\n".join(e.problems))
            return
        st.success(f"Trial #{number}: a clone of #{pick} from {ckpt.name}, now in the sweep")


@st.fragment(run_every=REFRESH_S)
def _live(folder) -> None:
    sweep = sweeps.read_sweep(folder)
    spec = sweep["spec"]
    done = sum(t.state not in ("running", "waiting") for t in sweep["trials"])
    best = sweep["best"]
    st.markdown(f"**{sweep['name']}**: {sweep['state'].get('state', 'unknown')}, {done} of {spec.total_trials()} "
                f"trials ended, ranked by `{spec.metric}` ({spec.direction})"
                + (f"; best so far #{best.number}: {best.value:.4g}" if best else ""))
    guarded(_trials_table, sweep)
    notice = st.session_state.get(NOTICE)
    if notice and notice[0] == sweep["name"]:
        st.success(notice[1])
    guarded(_controls, sweep)
    c1, c2 = st.columns(2)
    with c1:
        guarded(_curves, sweep)
    with c2:
        guarded(_settings_against_result, sweep)


st.title("Sweeps")
root = workspace.runs_root()
if DELETED in st.session_state:
    st.success(st.session_state.pop(DELETED))
with st.expander("New sweep of the current config", expanded=not sweeps.list_sweeps(root)):
    guarded(_new_sweep, root)

found = sweeps.list_sweeps(root)
if not found:
    st.info("No sweeps yet: start one above, or run `python -m backend sweep CONFIG --grid key=v1,v2`.")
else:
    names = [f.name for f in found]
    if st.session_state.get(SELECTED) not in names:
        st.session_state[SELECTED] = names[0]
    chosen = st.selectbox("Sweep", names, key=SELECTED)
    _live(found[names.index(chosen)])
    with st.expander("Clone a trial with an edited config"):
        guarded(_clone, found[names.index(chosen)])
