"""The workbench's services for the UI (and the CLI): launching and reading runs, presets and recipes,
data preview, rollout inspection, model comparison and export, the memory planner, interop with verl and
TRL. Pages call these; nothing here imports Streamlit."""
