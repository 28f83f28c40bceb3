"""What the workbench's pages share about how Streamlit runs them. The pages import it as `page_support`:
Streamlit puts app/ (the entry point's folder) on the import path."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from typing import Any

import streamlit as st

from backend.core.config import Config, draft_config
from backend.services import presets

# The run the user opened last, on the Runs or the Rollouts page (a run name): what Compare starts from.
OPENED_RUN = "_opened_run"


def is_entry_point(page_file: str) -> bool:
    """True when `page_file` is the app's entry point (AppTest.from_file on the page), False when it
    runs as a page of app/main.py, where only the entry point may call st.set_page_config."""
    try:
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        return ctx is not None and Path(ctx.main_script_path).resolve() == Path(page_file).resolve()
    except Exception:  # an internal API: when in doubt, behave as a page and leave the config alone
        return False


def guarded(section, *args, slot=None) -> None:
    """Draw one section of a page; a bug in it becomes a message and the rest of the page still draws. The
    message goes into `slot` (an st.empty the section was to fill) when there is one, replacing what waited there."""
    try:
        section(*args)
    except Exception as e:  # a section's own bug must not take down the rest of the page
        (slot or st).error(f"{section.__name__.strip('_').replace('_', ' ')} failed: {type(e).__name__}: {e}")


def current_config_text() -> str:
    """The Config page's YAML (session state), else the landing preset's: what Launch and a new sweep start."""
    return st.session_state.get(presets.SESSION_KEY) or presets.preset_yaml_text(presets.DEFAULT_PRESET)


def editing_config() -> Config:
    """The config being edited on the Config page (else the landing preset's), as far as it reads: a config
    with problems still gives every key it can."""
    return draft_config(current_config_text()) or Config()


_MD_SPECIAL = set("\\`*_{}[]<>()#+-.!|~$:")


def markdown_literal(text: Any) -> str:
    """User text made literal inside markdown (labels, captions, chat messages): every ASCII punctuation escaped."""
    return "".join("\\" + c if c in _MD_SPECIAL else c for c in str(text))


def one_line(text: Any, n: int) -> str:
    """`text` on one line, cut to `n` characters with an ellipsis."""
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= n else flat[: n - 1] + "…"


def remember_opened_run(selection_key: str) -> None:
    """Keep the run selected by the widget `selection_key` of the page that just ran as the run opened last. The
    widget's own value goes when the user leaves that page (Streamlit drops the state of widgets not drawn)."""
    selected = st.session_state.get(selection_key)
    if selected:
        st.session_state[OPENED_RUN] = selected


# What pages import on first use, seconds of it on two cores: pandas (st.dataframe, 0.75 s), plotly's figures,
# transformers' AutoTokenizer (1.6 s) and what its first from_pretrained imports, a model's config class, whose
# transformers.activations pulls in torch.distributed.tensor (1.1 s). Imported once per server, in the background,
# while the first page draws: the Data page's first visit finds them loaded.
_SLOW_IMPORTS = ("pandas", "plotly.graph_objects", "transformers.models.auto.tokenization_auto",
                 "transformers.activations")
_warm_up_started = threading.Lock()
_warm_up_done = threading.Event()


def _import_slow_modules() -> None:
    try:
        for name in _SLOW_IMPORTS:
            importlib.import_module(name)
    finally:
        _warm_up_done.set()


def warm_up_imports() -> None:
    """Start importing _SLOW_IMPORTS on a thread of their own, the first time only."""
    if _warm_up_started.acquire(blocking=False):
        threading.Thread(target=_import_slow_modules, name="warm-up-imports", daemon=True).start()


def imports_warmed_up() -> None:
    """Wait until the warm-up's imports are done, if it started. A page calls it before anything that imports
    transformers: a second thread importing transformers while the warm-up is inside it can be handed the
    half-made module ("cannot import name 'AutoTokenizer' from 'transformers'", seen on a first Data visit)."""
    if _warm_up_started.locked():
        _warm_up_done.wait()
