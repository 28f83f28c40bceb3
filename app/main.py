"""The workbench's entry point: `streamlit run app/main.py` (what `make run` starts)."""

import streamlit as st
from page_support import warm_up_imports

st.set_page_config(page_title="GRPO Workbench", layout="wide")
warm_up_imports()

navigation = st.navigation([
    st.Page("../pages/config.py", title="Config", icon=":material/tune:", default=True),
    st.Page("../pages/data.py", title="Data", icon=":material/table_view:"),
    st.Page("../pages/runs.py", title="Runs", icon=":material/monitoring:"),
    st.Page("../pages/rollouts.py", title="Rollouts", icon=":material/article:"),
    st.Page("../pages/compare.py", title="Compare", icon=":material/compare:"),
])
navigation.run()
