"""The workbench's entry point: `streamlit run app/main.py` (what `make run` starts)."""

import streamlit as st
from page_support import remember_opened_run, warm_up_imports

st.set_page_config(page_title="GRPO Workbench", layout="wide")
warm_up_imports()

runs = st.Page("../pages/runs.py", title="Runs", icon=":material/monitoring:")
rollouts = st.Page("../pages/rollouts.py", title="Rollouts", icon=":material/article:")
navigation = st.navigation([
    st.Page("../pages/config.py", title="Config", icon=":material/tune:", default=True),
    st.Page("../pages/data.py", title="Data", icon=":material/table_view:"),
    runs,
    rollouts,
    st.Page("../pages/compare.py", title="Compare", icon=":material/compare:"),
    st.Page("../pages/sweeps.py", title="Sweeps", icon=":material/grid_view:"),
])
# The widget each page selects a run with: the run selected there is the one the user opened last.
selection = {runs.url_path: "runs_selected", rollouts.url_path: "rollouts_run"}
try:
    navigation.run()
finally:  # also when the page stopped early (st.stop, a rerun): its selection is what the user is looking at
    if navigation.url_path in selection:
        remember_opened_run(selection[navigation.url_path])
