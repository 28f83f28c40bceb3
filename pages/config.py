"""Config page: start from a preset, an earlier run or a saved config; edit the common fields or the
whole YAML; see what one training step does and what the engine says is wrong; save, download, or copy
the command line that trains it.

Session-state contract (other pages rely on it):
    st.session_state["config_yaml_text"]  (backend.services.presets.SESSION_KEY)
        The YAML text of the config being edited: the single source of truth. The fields and the YAML
        text area are views of it; the Runs page's Launch reads it (validate it with
        backend.core.config.config_from_yaml_text). Absent until this page has run once; then the text of
        backend.services.presets.DEFAULT_PRESET is the fallback. Another page may replace it: this page shows
        the new text the next time it runs.

Runs on its own too under AppTest.from_file("pages/config.py").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st
from page_support import guarded, imports_warmed_up

from backend.core import config as C
from backend.core import workspace
from backend.core.config import ConfigError
from backend.services import presets

TEXT = presets.SESSION_KEY      # the YAML text; see the docstring
SYNCED = "_config_synced_text"  # the text the field widgets were last filled from
PREFLIGHT = "_config_preflight"  # {"text": ..., "problems": [...]} of the last file check
LOADED = "_config_loaded_from"
PLAN_OPEN = "config_plan_open"          # whether the plan panel is open (it plans only then)
PLAN_GPUS_FROM = "_config_plan_gpus_from"  # the trainer.n_gpus_per_node the GPU count field was last set from
THIS_MACHINE = "this machine"            # the plan panel's first choice: plan for where the workbench runs

# The common fields, by group: (dotted key, label). The widget kind, help and choices come from the schema.
GROUPS: dict[str, list[tuple[str, str]]] = {
    "Model and data": [
        ("actor_rollout_ref.model.path", "Model"),
        ("data.train_files", "Train files (one a line)"),
        ("data.val_files", "Validation files (one a line)"),
        ("data.max_prompt_length", "Max prompt length"),
        ("data.max_response_length", "Max response length"),
    ],
    "Algorithm and sampling": [
        ("algorithm.adv_estimator", "Algorithm (advantage estimator)"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "Policy loss"),
        ("actor_rollout_ref.actor.loss_agg_mode", "Loss aggregation"),
        ("actor_rollout_ref.rollout.n", "Responses per prompt (rollout.n)"),
        ("actor_rollout_ref.rollout.temperature", "Temperature"),
    ],
    "Batch sizes": [
        ("data.train_batch_size", "Prompts per step (train_batch_size)"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "Prompts per optimizer step (ppo_mini_batch_size)"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "Responses per forward pass (micro-batch)"),
    ],
    "Optimizer and KL": [
        ("actor_rollout_ref.actor.optim.lr", "Learning rate"),
        ("actor_rollout_ref.actor.use_kl_loss", "KL loss to the reference model"),
        ("actor_rollout_ref.actor.kl_loss_type", "KL estimator"),
        ("actor_rollout_ref.actor.kl_loss_coef", "KL loss coefficient"),
    ],
    "PPO critic (algorithm gae)": [
        ("critic.optim.lr", "Critic learning rate"),
        ("critic.ppo_micro_batch_size_per_gpu", "Critic responses per forward pass"),
        ("trainer.critic_warmup", "Critic warm-up steps"),
    ],
    "Schedule": [
        ("trainer.total_training_steps", "Training steps (0 = total_epochs worth)"),
        ("trainer.save_freq", "Checkpoint every N steps"),
        ("trainer.test_freq", "Validate every N steps"),
    ],
    "Reward": [
        ("custom_reward_function.path", "Custom reward file (empty = built-in by data_source)"),
        ("custom_reward_function.name", "Custom reward function name"),
        ("reward.overlong_buffer.enable", "DAPO overlong penalty"),
    ],
}
FIELDS = [key for group in GROUPS.values() for key, _ in group]
SPECS = C.field_specs()
FLOAT_FORMATS = {"actor_rollout_ref.actor.optim.lr": ("%.2e", 1e-7), "critic.optim.lr": ("%.2e", 1e-6),
                 "actor_rollout_ref.actor.kl_loss_coef": ("%.4f", 0.001)}


def widget_key(key: str) -> str:
    return "cfg_" + key.replace(".", "__")


def _kind(key: str) -> str:
    tp, meta = SPECS[key]
    if meta["choices"]:
        return "choice"
    return {int: "int", float: "float", bool: "bool", str: "text"}.get(tp, "files")


def _to_widget(key: str, value):
    return "\n".join(value) if _kind(key) == "files" else value


def _from_widget(key: str, value):
    kind = _kind(key)
    if kind == "files":
        return [line.strip() for line in (value or "").splitlines() if line.strip()]
    if kind == "text":
        return (value or "").strip()
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    return value


# ---- keeping the fields, the YAML text area and the text in session_state in step ----

def _fill_widgets(text: str) -> None:
    """Fill every field and the YAML text area from `text` (before they are drawn in this run)."""
    ss = st.session_state
    draft = C.draft_config(text)
    if draft is not None:
        for key in FIELDS:
            ss[widget_key(key)] = _to_widget(key, C.get_value(draft, key))
    ss["config_yaml"] = text
    ss[SYNCED] = text


def _set_text(text: str) -> None:
    st.session_state[TEXT] = text
    _fill_widgets(text)


def _on_field(key: str) -> None:
    ss = st.session_state
    try:
        ss[TEXT] = C.set_yaml_value(ss[TEXT], key, _from_widget(key, ss[widget_key(key)]))
    except (ConfigError, ValueError, TypeError):
        return  # the YAML does not parse; the fields are frozen and the page says so
    ss["config_yaml"] = ss[SYNCED] = ss[TEXT]


def _on_yaml() -> None:
    _set_text(st.session_state["config_yaml"])


def _start_options() -> dict[str, tuple[str, Path | str]]:
    """Label -> ("preset", name) or ("file", path) for everything a config can start from."""
    options: dict[str, tuple[str, Path | str]] = {f"preset · {name}": ("preset", name)
                                                  for name in presets.list_presets()}
    options.update({f"saved · {name}": ("file", path) for name, path in presets.list_saved_configs().items()})
    options.update({f"run · {run_id}": ("file", path)
                    for run_id, path in presets.run_configs(workspace.runs_root()).items()})
    return options


def _on_load() -> None:
    ss = st.session_state
    label = ss.get("config_start")
    kind, source = _start_options().get(label, ("preset", presets.DEFAULT_PRESET))
    try:
        text = presets.preset_yaml_text(source) if kind == "preset" else Path(source).read_text()
    except (OSError, KeyError) as e:
        ss[LOADED] = ("error", f"could not read {label}: {e}")
        return
    _set_text(text)
    ss[LOADED] = ("ok", label)


@st.cache_data(show_spinner=False, ttl=60)
def _time_estimate(name: str, stamp: int) -> str:
    # ttl: a shipped model made since (by a run or a check) turns "estimated once the model is made" into a time
    return presets.time_estimate(name)


def _new_here(times: dict[str, str] | None) -> None:
    quick, learns = presets.DEFAULT_PRESET, "GRPO on the arithmetic sample"
    here = (lambda name: f" *{times[name]}*.") if times else (lambda name: "")
    st.markdown(f"**New here?**\n- **{quick}**, loaded below: the whole flow (launch, live charts, rollouts, compare, "
                f"export) with a model too small and random to learn anything.{here(quick)}\n"
                f"- **{learns}**: SmolLM2-135M-Instruct, which does learn the arithmetic.{here(learns)}")


def _which_preset() -> Any:
    """What to pick when new, in a slot that gets each preset's time here last (the first estimate reads the
    models' sizes and measures this machine: a few seconds)."""
    slot = st.empty()
    with slot.container():
        _new_here(None)
        st.status("Estimating how long each preset takes on this machine...", state="running")
    return slot


def _preset_times(slot) -> None:
    times = {name: _time_estimate(name, path.stat().st_mtime_ns)
             for name, path in presets.list_presets().items() if path is not None}
    with slot.container():
        _new_here(times)
        with st.expander("How long each preset takes on this machine"):
            st.caption("The steps' time as the plan panel predicts it here; start-up, validation and checkpoints "
                       "come on top.")
            st.markdown("\n".join(f"- {name}: {time}" for name, time in times.items()))


def _on_check_files(text: str) -> None:
    cfg, problems = C.config_from_yaml_text(text)
    if cfg is not None:
        from backend.engine.checks import preflight  # loads torch and transformers: only when asked

        try:
            problems = preflight(cfg)
        except Exception as e:  # noqa: BLE001 - a check that breaks must not take the page down
            problems = [f"the check itself failed: {type(e).__name__}: {e}"]
    st.session_state[PREFLIGHT] = {"text": text, "problems": problems, "ran": cfg is not None}


# ---- drawing ----

def _errors(messages: list[str]) -> None:
    for message in messages:
        st.error(message)


def _field(key: str, label: str, disabled: bool, problems: dict[str, list[str]]) -> None:
    _, meta = SPECS[key]
    wkey = widget_key(key)
    help_text = f"{meta['help']}\n\n`{key}`"
    common = {"key": wkey, "help": help_text, "disabled": disabled, "on_change": _on_field, "args": (key,)}
    kind = _kind(key)
    if kind == "choice":
        options = list(meta["choices"])
        current = st.session_state.get(wkey)
        if current is not None and current not in options:
            options.append(current)  # a value the schema refuses: shown, with the engine's message below
        st.selectbox(label, options, **common)
    elif kind == "bool":
        st.checkbox(label, **common)
    elif kind == "int":
        st.number_input(label, step=1, **common)
    elif kind == "float":
        fmt, step = FLOAT_FORMATS.get(key, ("%.2f", 0.1))
        st.number_input(label, step=step, format=fmt, **common)
    elif kind == "files":
        st.text_area(label, height=96, **common)
    else:
        st.text_input(label, **common)
    _errors(problems.get(key, []))


def _user_code_notice(draft: C.Config | None) -> None:
    # A custom reward is imported and called by the trainer, not sandboxed: whoever launches a config they did
    # not write (a shared YAML, an earlier run, a pasted verl script) should see whose code that puts in play.
    if draft is None:
        return
    targets = []
    crf = draft.custom_reward_function
    path = crf.path.strip() if isinstance(crf.path, str) else ""
    if path:
        name = crf.name.strip() if isinstance(crf.name, str) and crf.name.strip() else "(no function name set)"
        targets.append(f"`{name}` from `{path}`")
    functions = draft.reward.functions if isinstance(draft.reward.functions, list) else []
    targets += [f"`{t}`" for t in functions if isinstance(t, str) and t.strip()]
    if not targets:
        return
    st.warning(f"Launching this config runs your code: {', '.join(targets)} "
               f"{'is' if len(targets) == 1 else 'are'} imported and called inside the training process, with "
               "your user's permissions (it can read and write your files and reach the network). Launch it only "
               "if you trust that code.", icon="⚠️")


def _derived(draft: C.Config | None) -> None:
    st.subheader("One training step")
    if draft is None:
        st.info("Fix the YAML to see what one training step does.")
        return
    numbers = C.derived_numbers(draft)
    for col, (label, value) in zip(st.columns(len(numbers)), numbers.items(), strict=True):
        with col:
            if isinstance(value, str):
                number, _, why = value.partition(" (")
                st.metric(label, number, delta=why.rstrip(")"), delta_color="red", delta_arrow="off",
                          help="Does not come out whole: see the batch-size messages.")
            else:
                st.metric(label, value)


def _preflight(text: str, cfg_ok: bool) -> None:
    st.subheader("Files, model and reward")
    st.caption("Checks what the config alone cannot: that the data files exist and fit, that the model loads "
               "and its context holds prompt + response, that the reward can be found. The first check of "
               "smollm2-135m-instruct converts the model once (can take a minute); later ones are quick.")
    st.button("Check files, model and reward", key="config_check_files", on_click=_on_check_files,
              args=(text,), disabled=not cfg_ok)
    if not cfg_ok:
        st.caption("Fix the problems above first.")
    result = st.session_state.get(PREFLIGHT)
    if not result or result["text"] != text or not result["ran"]:
        return
    if result["problems"]:
        _errors(result["problems"])
    else:
        st.success("Data files, model and reward are ready: the run can start.")


def _plan_panel(cfg: C.Config | None) -> None:
    ss = st.session_state
    panel = st.expander("Will it fit? Memory and time plan", key=PLAN_OPEN, on_change="rerun")
    # Drawn only while open: the first plan of a model reads its config and builds it on the meta device.
    if not panel.open or cfg is None:  # an invalid config: its problems are shown above already
        return
    from backend.core.models import ModelError
    from backend.services import planner

    with panel:
        st.caption("Predicted peak memory of each worker in each phase of a step, and the step's time, from the "
                   "config and the model's dimensions (`python -m backend plan CONFIG` prints the same).")
        if ss.get(PLAN_GPUS_FROM) != cfg.trainer.n_gpus_per_node or "config_plan_gpus" not in ss:
            ss["config_plan_gpus"] = ss[PLAN_GPUS_FROM] = cfg.trainer.n_gpus_per_node
        gpu_col, count_col = st.columns(2)
        target = gpu_col.selectbox(
            "Plan for", [THIS_MACHINE, *planner.GPUS], key="config_plan_gpu",
            format_func=lambda t: planner.this_machine() if t == THIS_MACHINE else f"{t} GPU",
            help="Where the run will train: this machine (its GPU, else its CPU and memory), or a GPU of the table.")
        gpus = count_col.number_input("GPUs per node", min_value=1, step=1, key="config_plan_gpus",
                                      help="trainer.n_gpus_per_node for the plan; the YAML is not changed.")
        try:
            with st.spinner("Reading the model's dimensions..."):
                imports_warmed_up()
                result = planner.plan(cfg, gpu=None if target == THIS_MACHINE else target, gpus=int(gpus))
        except ConfigError as e:
            _errors(e.problems)
            return
        except ModelError as e:
            st.warning(f"No plan: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a plan that breaks must not take the page down
            st.error(f"the plan itself failed: {type(e).__name__}: {e}")
            return
        st.dataframe(result.table(), hide_index=True)
        st.caption(result.step_time_text())
        (st.success if result.fits else st.error)(result.verdict)
        alone = [s for s in result.suggestions if len(s.changes) == 1]
        if alone:
            st.markdown("**What to change** (each alone, re-planned with it):\n"
                        + "\n".join(f"- `{s.overrides[0]}`: {s.effect}" for s in alone))
        for s in result.suggestions:
            if len(s.changes) > 1:
                st.markdown(f"**Or all of these together**: {s.effect}")
                st.code(" ".join(s.overrides), language="bash")
        for note in result.notes:
            st.caption(note)


def _save_and_commands(text: str, cfg: C.Config | None) -> None:
    st.subheader("Save, download, command line")
    name_col, over_col, save_col, dl_col = st.columns([3, 1.3, 1, 1.2], vertical_alignment="bottom")
    name = name_col.text_input("Name", key="config_save_name", placeholder="my-gsm8k-run",
                               help="Saved as configs/saved/<name>.yaml: letters, digits, '.', '_' and '-'.")
    overwrite = over_col.checkbox("Overwrite", key="config_save_overwrite")
    saved_path = None
    if save_col.button("Save", key="config_save"):
        try:
            saved_path = presets.save_config(name, text, overwrite=overwrite)
        except ConfigError as e:
            st.error("; ".join(e.problems))
        except (ValueError, FileExistsError) as e:  # workspace.PathError is a ValueError
            st.error(str(e))
        else:
            st.success(f"Saved {saved_path}" + ("" if cfg else " (as a draft: it has problems to fix)"))
    try:
        file_name = f"{workspace.check_name(name.strip().removesuffix('.yaml'))}.yaml"
    except workspace.PathError:
        file_name = "config.yaml"
    dl_col.download_button("Download", data=text, file_name=file_name, mime="application/x-yaml",
                           key="config_download", on_click="ignore")

    root = workspace.workspace_root()
    target = saved_path or workspace.saved_configs_dir() / file_name
    shown = target.relative_to(root) if target.is_relative_to(root) else target
    st.caption("Train the saved file (run from the workspace folder):")
    st.code(C.cli_command(shown), language="bash")
    if cfg is not None:
        st.caption("Or, with no file, the schema defaults plus what differs from them:")
        st.code(C.cli_overrides_command(cfg), language="bash")


def _on_from_verl() -> None:
    from backend.services.interop import InteropError, from_verl_script

    ss = st.session_state
    try:
        raw, notes = from_verl_script(ss.get("config_verl_script", ""))
    except InteropError as e:
        ss["config_verl_notes"] = ("error", [str(e)])
        return
    _set_text(C.dump_yaml(raw))
    ss["config_verl_notes"] = ("ok", notes)


def _verl(cfg: C.Config | None) -> None:
    from backend.services.interop import to_verl_command

    with st.expander("From / to verl"):
        st.text_area("verl launch script", key="config_verl_script", height=200,
                     placeholder="python3 -m verl.trainer.main_ppo \\\n    algorithm.adv_estimator=grpo \\\n    ...",
                     help="Paste a bash script that runs verl.trainer.main_ppo; its key=value overrides replace "
                          "the config above (keys not set stay at the schema defaults).")
        st.button("Load into the editor", key="config_from_verl", on_click=_on_from_verl)
        outcome, notes = st.session_state.get("config_verl_notes", ("", []))
        if outcome == "error":
            st.error(notes[0])
        elif outcome == "ok":
            st.caption("Loaded the verl script." + (" Not carried over:" if notes else ""))
            if notes:
                st.markdown("\n".join(f"- `{n}`" for n in notes))
        if cfg is not None:
            st.caption("The verl command for the current config:")
            st.code(to_verl_command(cfg), language="bash")


def render() -> None:
    ss = st.session_state
    if TEXT not in ss:
        ss[TEXT] = presets.preset_yaml_text(presets.DEFAULT_PRESET)
    if ss.get(SYNCED) != ss[TEXT] or any(widget_key(k) not in ss for k in FIELDS) or "config_yaml" not in ss:
        _fill_widgets(ss[TEXT])  # first run, back from another page, or the text was replaced elsewhere
    text = ss[TEXT]

    st.title("Config")
    st.caption("Start from a preset, an earlier run or a saved config; edit the fields or the YAML (they stay in "
               "step). The Runs page launches the config shown here.")

    # ---- start ----
    options = _start_options()
    start_col, load_col = st.columns([4, 1], vertical_alignment="bottom")
    start_col.selectbox("Start from", list(options), key="config_start",
                        help="Presets ship in configs/; earlier runs' configs are runs/<id>/config.yaml; "
                             "saved configs are configs/saved/. Loading replaces the config below.")
    load_col.button("Load", key="config_load", on_click=_on_load)
    outcome, what = ss.get(LOADED, ("", ""))
    if outcome == "error":
        st.error(what)
    elif outcome == "ok":
        st.caption(f"Loaded {what}.")
    times_slot = _which_preset()

    # ---- what the engine says ----
    cfg, problems = C.config_from_yaml_text(text)
    draft = C.draft_config(text)
    by_key = C.problems_by_key(problems)
    general = [m for key, messages in by_key.items() if key not in FIELDS for m in messages]
    if general:
        _errors(general)
    if len(general) < len(problems):
        st.warning(f"{len(problems) - len(general)} problem(s) with the fields below: see the message under each.")
    elif cfg is not None:
        st.success("The config is valid.")

    # ---- fields and YAML ----
    fields_col, yaml_col = st.columns([1, 1], gap="large")
    with fields_col:
        for group, fields in GROUPS.items():
            with st.container(border=True):
                st.markdown(f"**{group}**")
                for key, label in fields:
                    _field(key, label, draft is None, by_key)
                if group == "Reward":
                    _user_code_notice(draft)
    with yaml_col:
        st.text_area("YAML", key="config_yaml", height=720, on_change=_on_yaml,
                     help="The whole config. Every key is in backend/core/config.py with its help. Editing a field "
                          "rewrites this text (comments at the top are kept).")
        st.button("Apply YAML", key="config_apply_yaml", on_click=_on_yaml)
        if draft is None:
            st.error("The YAML does not parse (see the message above); the fields are frozen until it does.")

    _derived(draft)
    _preflight(text, cfg is not None)
    _plan_panel(cfg)
    _save_and_commands(text, cfg)
    _verl(cfg)
    guarded(_preset_times, times_slot, slot=times_slot)


render()
