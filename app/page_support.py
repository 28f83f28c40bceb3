"""What the workbench's pages share about how Streamlit runs them. The pages import it as `page_support`:
Streamlit puts app/ (the entry point's folder) on the import path."""

from __future__ import annotations

from pathlib import Path

import streamlit as st


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
