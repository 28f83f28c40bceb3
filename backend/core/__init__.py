"""What every other part stands on: the config schema, data files, finding and loading models (with
LoRA adapters and the checkpoint format), the run directory, the workspace and experiment trackers."""
