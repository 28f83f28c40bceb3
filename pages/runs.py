"""Runs: launch the current config in the background, list runs, stop/resume/fork/delete them, and
watch one (or several overlaid) live. Everything shown is read from run directories."""

from __future__ import annotations

import time
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st
from page_support import current_config_text

from backend.core import workspace
from backend.core.config import ConfigError, config_from_yaml_text
from backend.core.runs import DUMP_REQUEST, list_dumps
from backend.services.compare import list_evaluations
from backend.services.launcher import (
    delete,
    fork,
    fork_config_text,
    fork_name,
    launch,
    list_runs,
    log_tail,
    read_run,
    request_dump,
    resume,
    resume_steps,
    stage_info,
    stop,
    stop_loss,
)
from backend.services.run_views import config_diff, smooth

REFRESH_S = 3

# Charts: title -> metric keys drawn as lines (the first key of "band" charts gets a min/max band).
CHARTS = {
    "Reward (score mean, min-max band)": ["critic/score/mean"],
    "Reward parts": "reward/*/mean",
    "Groups with zero reward spread": ["batch/zero_spread_groups"],
    "KL loss": ["actor/kl_loss", "actor/reward_kl_penalty"],
    "Policy loss": ["actor/pg_loss"],
    "Entropy": ["actor/entropy"],
    "Clip fraction": ["actor/pg_clipfrac", "actor/pg_clipfrac_lower"],
    "Grad norm": ["actor/grad_norm"],
    "Response length": ["response_length/mean", "response_length/max"],
    "Response clip ratio": ["response_length/clip_ratio"],
    "Validation accuracy": "val/*/accuracy",
    "Time per phase (s)": "timing_s/*",
    "Throughput (tokens/s)": ["perf/throughput"],
    # Non-zero in the steps that compiled: the first, and any whose shapes the compiled graphs did not cover.
    "torch.compile time in the step (s)": ["perf/compile_s"],
    "Supervised loss (python -m backend sft)": ["sft/loss"],
    # Runs whose rollout engine reports its own log-probs (vLLM, or trainer.rollout_mode=async).
    "Staleness (updates behind the actor)": ["rollout/staleness"],
    "Importance weights (trainer over rollout)": ["rollout/is_weight_mean", "rollout/is_weight_max",
                                               "rollout/is_clipfrac"],
    "Log-prob gap (trainer minus rollout)": ["rollout/log_prob_diff_mean"],
    # Multi-turn runs only (a chart with none of its keys is not drawn).
    "Turns per episode": ["num_turns/mean", "multi_turn/assistant_turns/mean"],
    "Tool calls per episode and success rate": ["tool/calls_per_episode/mean", "tool/success_rate",
                                                "val/tool_call_rate"],
    "Failed tool calls": ["tool/errors", "tool/timeouts", "tool/parse_errors", "tool/unknown_tool",
                          "tool/bad_arguments"],
    "Episodes truncated, without a call": ["multi_turn/truncated_by_budget", "multi_turn/truncated_by_turns",
                                           "multi_turn/no_tool_call"],
}


def announce(run_name: str, text: str) -> None:
    """Say what an action did, above the controls of the run it concerns, until the next action. An action changes
    some run's state, and the page reruns on every change of state: an st.success drawn by the click's own script
    run would be gone within seconds."""
    st.session_state["runs_notice"] = (run_name, text)


def expand(pattern: str | list[str], metrics: list[dict]) -> list[str]:
    if isinstance(pattern, list):
        return pattern
    prefix, suffix = pattern.split("*")
    keys = {k for m in metrics for k in m if k.startswith(prefix) and k.endswith(suffix)}
    return sorted(k for k in keys if isinstance(next((m[k] for m in metrics if k in m), None), (int, float)))


def figure(title: str, pattern, runs: dict[str, list[dict]], smoothing: float) -> go.Figure | None:
    fig = go.Figure()
    drawn = False
    for run_name, metrics in runs.items():
        for key in expand(pattern, metrics):
            points = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            label = key if len(runs) == 1 else f"{run_name}: {key}"
            if key == "critic/score/mean":
                lo = [m.get("critic/score/min") for m in metrics if isinstance(m.get(key), (int, float))]
                hi = [m.get("critic/score/max") for m in metrics if isinstance(m.get(key), (int, float))]
                fig.add_trace(go.Scatter(x=list(steps) + list(steps)[::-1], y=hi + lo[::-1], fill="toself",
                                         line={"width": 0}, opacity=0.2, showlegend=False, hoverinfo="skip"))
            fig.add_trace(go.Scatter(x=steps, y=smooth(list(values), smoothing), mode="lines+markers",
                                     name=label))
            drawn = True
    if not drawn:
        return None
    fig.update_layout(title=title, height=280, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      xaxis_title="step", legend={"orientation": "h", "y": -0.3})
    return fig


# ---- launch ----

st.title("Runs")
root = workspace.runs_root()

with st.expander("Launch the current config", expanded=True):
    cfg, problems = config_from_yaml_text(current_config_text())
    name = st.text_input("Run name (optional)", key="launch_name",
                         help="Letters, digits, '.', '_' and '-'; the run folder is runs/<date>-<name>.")
    if problems:
        st.error("The current config cannot start:\n\n" + "\n".join(f"- {p}" for p in problems))
    if cfg is not None and cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes > 1:
        st.info("Multi-worker and Ray-cluster runs are not built yet; this launches one local process.")
    if st.button("Launch", key="launch_button", type="primary", disabled=cfg is None):
        try:
            run_dir = launch(cfg, name=name.strip(), runs_root=root)
            st.session_state["runs_selected"] = run_dir.name
            announce(run_dir.name, f"Launched {run_dir.name}")
        except (ConfigError, ValueError) as e:
            st.error(str(e))

with st.expander("Import a TRL or verl run"):
    src = st.text_input("Folder", key="import_folder",
                        help="A TRL GRPOTrainer output_dir (trainer_state.json, completions/) or verl's rollout dump "
                             "(trainer.rollout_data_dir: <step>.jsonl files), inside the workspace or GRPO_WB_ROOTS.")
    import_name = st.text_input("Run name", key="import_name", placeholder="trl-gsm8k")
    if st.button("Import", key="import_button", disabled=not (src.strip() and import_name.strip())):
        from backend.services.interop import import_external_run

        try:
            run_dir = import_external_run(workspace.safe_path(src), root, import_name.strip())
            st.session_state["runs_selected"] = run_dir.name
            announce(run_dir.name, f"Imported {run_dir.name}")
        except (ValueError, OSError) as e:  # PathError and InteropError are ValueErrors
            st.error(str(e))

# ---- the table ----

runs = list_runs(root)
if not runs:
    st.info(f"No runs yet in {root}. Launch one above.")
    st.stop()


@st.fragment(run_every=REFRESH_S)
def runs_table(states_drawn: dict[str, str]) -> None:
    current = list_runs(root)
    # The action buttons below were drawn for the states of the last full run of the page; when a
    # run changes state (finishes, fails), redraw everything so they match.
    if {r.name: r.state for r in current} != states_drawn:
        st.rerun()
    st.dataframe(
        [{"name": r.name, "state": r.state, "step": f"{r.step}/{r.total_steps or '?'}",
          "reward": None if r.score is None else round(r.score, 3),
          "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)) if r.started else "",
          "duration": f"{r.duration_s:.0f} s" if r.duration_s else ""} for r in current],
        hide_index=True, width="stretch")


runs_table({r.name: r.state for r in runs})

names = [r.name for r in runs]
if st.session_state.get("runs_selected") not in names:
    st.session_state["runs_selected"] = names[0]
selected_name = st.selectbox("Open run", names, key="runs_selected")
selected = next(r for r in runs if r.name == selected_name)
run_dir = Path(selected.path)
if (notice := st.session_state.get("runs_notice")) and notice[0] == selected_name:
    st.success(notice[1])

# ---- the selected run: state, controls, log; charts below ----

info = read_run(run_dir)
# What the charts below are drawn from; the live status reruns the page when the run has written more.
st.session_state.setdefault("runs_metrics_drawn", {})[str(run_dir)] = len(info["metrics"])


def metrics_drawn() -> int:
    """How many metrics lines of the selected run the charts were drawn from (session state)."""
    return st.session_state.get("runs_metrics_drawn", {}).get(str(run_dir), -1)


def _reward_problem(metrics: list[dict]) -> str:
    """What went wrong with the reward function at the latest step that had trouble, or ""."""
    for m in reversed(metrics):
        counts = {kind: int(m.get(f"reward/{kind}") or 0) for kind in ("errors", "timeouts", "invalid")}
        if any(counts.values()):
            first = f" First error: {m['reward/first_error']}" if m.get("reward/first_error") else ""
            return (f"Step {m.get('step')}: {counts['errors']} reward call(s) raised, {counts['timeouts']} timed out "
                    f"(reward.timeout_s) and {counts['invalid']} returned a non-number; those responses scored 0 "
                    f"and the run went on.{first}")
    return ""


def _tool_problem(metrics: list[dict]) -> str:
    """What went wrong with tool calls or environments at the latest step that had trouble, or ""."""
    kinds = {"errors": "raised", "timeouts": "timed out", "parse_errors": "were not valid calls",
             "unknown_tool": "named no tool", "bad_arguments": "had wrong arguments"}
    for m in reversed(metrics):
        counts = {kind: int(m.get(f"tool/{kind}") or 0) for kind in kinds}
        env_errors = int(m.get("multi_turn/env_errors") or 0)
        if any(counts.values()) or env_errors:
            calls = ", ".join(f"{n} {kinds[k]}" for k, n in counts.items() if n) or "none failed"
            first = f" First: {m['tool/first_error']}" if m.get("tool/first_error") else ""
            return (f"Step {m.get('step')}: tool calls: {calls}; {env_errors} episode(s) ended by an environment "
                    f"error (scored 0). The model read each failed call's error as the tool's answer and the run "
                    f"went on.{first}")
    return ""


@st.fragment(run_every=REFRESH_S)
def live_status() -> None:
    """The state line, warnings and errors, every REFRESH_S. The charts are redrawn (a rerun of the page)
    only when the run has written a new metrics line: redrawing a dozen unchanged charts every few
    seconds kept the server and the browser busy (0.3 of a core for one idle tab), which made every page
    slow while runs trained."""
    if not run_dir.exists():
        st.warning(f"{run_dir.name} was deleted.")
        return
    current = read_run(run_dir)
    if len(current["metrics"]) != metrics_drawn():
        st.rerun()
    status = current.get("status") or {}
    state = status.get("state", "unknown")
    steps = f"step {status.get('step', 0)}/{status.get('total_steps') or '?'}"
    if state in ("queued", "running"):
        stall_after = ((current.get("config") or {}).get("trainer") or {}).get("stall_warning_s", 300.0)
        stage, elapsed, stalled = stage_info(status, time.time(), stall_after)
        if stage == "stopping":
            st.markdown(f"**stopping…** · {steps} · asked {elapsed:.0f} s ago")
        else:
            st.markdown(f"**{state}** · {steps} · {stage} · {elapsed:.0f} s")
        if stalled:
            st.warning(f"No progress reported for more than {stall_after:.0f} s (trainer.stall_warning_s): the run "
                       f"may be stuck in '{stage}'. Check the log below.")
    else:
        st.markdown(f"**{state}** · {steps}" + (f" · {status['note']}" if status.get("note") else ""))
    for role, key in (("workers", "workers"), ("rollout workers", "rollout_workers")):
        if status.get(key):
            st.caption(f"{role}: " + " · ".join(f"rank {w.get('rank')} pid {w.get('pid')} on {w.get('host')} "
                                                f"({w.get('device')})" for w in status[key]))
    if state == "running" and status.get("debugger"):
        st.info(f"A worker is waiting for a debugger at **{status['debugger']}**: attach with VS Code's "
                "'Python Debugger: Remote Attach' to that host and port; the step starts once it attaches.")
    for warning in (status.get("warnings") or [])[-3:]:
        st.warning(warning)
    reward_problem = _reward_problem(current["metrics"])
    if reward_problem:
        st.warning(reward_problem)
    tool_problem = _tool_problem(current["metrics"])
    if tool_problem:
        st.info(tool_problem)
    if status.get("error"):
        st.error(status["error"])
        if status.get("traceback"):
            with st.expander("Traceback"):
                st.code(status["traceback"], language="text")
    if status.get("diagnosis"):
        diagnosis_panel(status)


def diagnosis_panel(status: dict) -> None:
    """What the trainer found when a rank ran out of memory (the phase, what it held, what the planner says
    would fit), when a rollout engine kept stale weights after a sync (which tensors), or when a call to its
    workers ran far too long (where each rank was, every process's Python stacks)."""
    d = status["diagnosis"]
    st.markdown("**Diagnosis**")
    if d.get("kind") == "stale weights":
        st.error(f"After the weight sync in {d.get('call')}, {d.get('engine')}'s copy of {d.get('count')} of the "
                 f"actor's tensors differed from the actor's ({d.get('rank')}): the step failed before sampling "
                 "from them.")
        more = d.get("count", 0) - len(d.get("tensors", []))
        st.markdown("\n".join(f"- `{t}`" for t in d.get("tensors", [])) + (f"\n- and {more} more" if more else ""))
        st.markdown("A bug in the copy into the engine: report it with these names, and meanwhile train with "
                    "`actor_rollout_ref.rollout.name=hf`.")
        return
    if d.get("kind") == "out of memory":
        held = (f": {d['peak_reserved_gib']:.2f} GiB reserved at the phase's peak, of {d['device_gib']:.2f} GiB"
                if "peak_reserved_gib" in d else "")
        st.error(f"{d.get('rank')} ran out of memory during {d.get('call')} (phase {d.get('phase')}){held}.")
        if d.get("note"):
            st.markdown(d["note"][0].upper() + d["note"][1:] + ".")
        if d.get("suggestions"):
            st.markdown("Changes the planner says would fit:\n" + "\n".join(f"- {s}" for s in d["suggestions"]))
        return
    head = f"At step {d.get('step', 0)}, {d.get('call')} ran {d.get('seconds')} s"
    if d.get("final"):
        st.error(f"{head} and was still running at trainer.hang_timeout_s: the run failed with this diagnosis.")
    elif d.get("done_after_s") is not None:
        st.info(f"{head}; it returned after {d['done_after_s']} s.")
    elif status.get("state") in ("queued", "running"):
        st.warning(f"{head} and is still running: it may hang. Where each rank is:")
    else:
        st.info(head + ".")
    st.markdown("\n".join(f"- {line}" for line in d.get("ranks", [])))
    stacks = run_dir / d.get("file", "")
    if stacks.is_file():
        with st.expander("Python stacks of every process"):
            st.code(stacks.read_text(), language="text")


live_status()


active = selected.state in ("queued", "running")
c1, c2, c3, c4 = st.columns(4)
with c1:
    st.button("Stop", key="run_stop", disabled=not active or selected.stage == "stopping",
              on_click=stop, args=(run_dir,), kwargs={"wait": False})  # returns at once: the page shows it stopping
    if selected.stage == "stopping":
        st.info("Stop requested: the run ends within seconds.")
    if active:
        st.caption(stop_loss(info))
reached, suggested = resume_steps(info)
with c2:
    total = st.number_input("Train to step", min_value=1, value=suggested,
                            key=f"resume_total_steps_{selected.name}_{reached}",
                            help=f"Resume continues from the last checkpoint (step {reached}) up to this step, "
                                 f"which must be beyond {reached}.")
    if st.button("Resume", key="run_resume", disabled=active or not selected.checkpoints):
        try:
            resume(run_dir, overrides=[f"trainer.total_training_steps={int(total)}"])
            announce(selected.name, f"Resumed {selected.name}")
            st.rerun()
        except ConfigError as e:
            st.error("\n\n".join(e.problems))
        except ValueError as e:
            st.error(str(e))
with c3:
    confirm = st.checkbox("Really delete", key="run_delete_confirm")
    if st.button("Delete", key="run_delete", disabled=not confirm):
        try:
            delete(run_dir, root)
            st.session_state.pop("runs_selected", None)
            st.rerun()
        except ValueError as e:
            st.error(str(e))
with c4, st.popover("Fork", disabled=not selected.checkpoints):
    st.caption("A new run that starts from a checkpoint of this one, with the config below.")
    checkpoints = selected.checkpoints or ["(none)"]
    ckpt = st.selectbox("Checkpoint", checkpoints, index=len(checkpoints) - 1, key=f"fork_checkpoint_{selected.name}")
    fork_yaml = st.text_area("Config of the fork", fork_config_text(run_dir, ckpt) if selected.checkpoints else "",
                             height=240, key=f"fork_yaml_{selected.name}_{ckpt}",
                             help="This run's config, trained to a step beyond the checkpoint's; edit what the fork "
                                  "should change.")
    default_name = fork_name(run_dir, ckpt) if selected.checkpoints else ""
    chosen_name = st.text_input("Name of the fork", default_name, key=f"fork_name_{selected.name}_{default_name}",
                                help="The new run's folder name.")
    if st.button("Start fork", key="fork_button"):
        fork_cfg, fork_problems = config_from_yaml_text(fork_yaml)
        if fork_cfg is None:
            st.error("\n".join(fork_problems))
        else:
            try:
                new = fork(run_dir, run_dir / "checkpoints" / ckpt, fork_cfg, name=chosen_name.strip())
                announce(selected.name, f"Forked into {new.name}")
                st.rerun()
            except (ConfigError, ValueError) as e:
                st.error(str(e))


with st.expander("Replay a step in one process"):
    st.caption("A dump holds what one step's actor update consumed: its weights and optimizer, the batch, rewards, "
               "log-probs and advantages. `python -m backend replay` runs that update again in a plain Python "
               "process, without Ray, and prints its loss, KL, clip fraction and grad norm next to the run's; with "
               "`--pdb`, breakpoints in our code or your reward function stop there. trainer.dump_steps dumps "
               "chosen steps from the start.")
    asked = (run_dir / DUMP_REQUEST).exists()
    st.button("Dump the next step", key="run_dump_next", disabled=not active or asked, on_click=request_dump,
              args=(run_dir,))
    if asked and active:
        st.info("Asked: the next step saves its update into dumps/ as it ends.")
    for dump in list_dumps(run_dir):
        st.code(f"python -m backend replay {dump} --pdb", language="bash")


@st.fragment(run_every=REFRESH_S)
def live_log() -> None:
    if run_dir.exists():
        with st.expander("Log", expanded=selected.state == "failed"):
            st.code(log_tail(run_dir, 80) or "(empty)", language="text")


live_log()

# ---- charts ----

others = st.multiselect("Overlay other runs", [n for n in names if n != selected_name], key="runs_overlay")
smoothing = st.slider("Smoothing", 0.0, 0.95, 0.0, 0.05, key="runs_smoothing")


def charts(metrics: list[dict]) -> None:
    """The selected run's charts (other runs overlaid), config differences and evaluations."""
    series = {run_dir.name: metrics}
    for other in others:
        if (root / other).exists():
            series[other] = read_run(root / other)["metrics"]
    if not any(series.values()):
        st.caption("No metrics yet: the first step is still running.")
    else:
        columns = st.columns(2)
        drawn = 0
        for title, pattern in CHARTS.items():
            fig = figure(title, pattern, series, smoothing)
            if fig is not None:
                columns[drawn % 2].plotly_chart(fig, key=f"chart_{title}", width="stretch")
                drawn += 1
    if others:
        configs = {name: (read_run(root / name).get("config") or {}) for name in series}
        diff = config_diff(configs)
        st.subheader("Config keys that differ")
        if diff:
            st.dataframe([{"key": k, **{n: str(v) for n, v in vals.items()}} for k, vals in diff.items()],
                         hide_index=True)
        else:
            st.caption("The configs are the same.")
    evaluations = list_evaluations(run_dir) if run_dir.exists() else []
    if evaluations:
        st.subheader("Evaluations")
        st.dataframe([{"checkpoint": e.get("checkpoint"), "data": Path(str(e.get("data_file", ""))).name,
                       **{k: round(v, 4) for k, v in (e.get("metrics") or {}).items() if isinstance(v, float)}}
                      for e in evaluations], hide_index=True)


charts(info["metrics"])
