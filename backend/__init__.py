"""GRPO Workbench engine: the public Python API.

    import backend

    @backend.register_reward("arithmetic")
    def score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0

    config = backend.load_config("config.yaml", ["trainer.total_training_steps=10"])
    trainer = backend.Trainer(config)
    trainer.train()
    print(trainer.evaluate())

The CLI (`python -m backend`) and the workbench call these same objects. Names are resolved on first
use, so `import backend` stays cheap (torch and transformers load only when a model is needed).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "load_config": "backend.core.config",     # YAML + dotted overrides -> validated Config
    "Config": "backend.core.config",          # the config dataclass
    "Trainer": "backend.engine.trainer",        # one run: train(), evaluate(), generate(), export()
    "register_reward": "backend.rewards.registry",  # decorator: your scorer for a data_source
    "generate": "backend.engine.inference",     # answer prompts with any model
    "evaluate": "backend.engine.inference",     # greedy accuracy of any model on a parquet file
    "ConfigError": "backend.core.config",
    "DataError": "backend.core.data",
    "RewardError": "backend.rewards.registry",
    "ModelError": "backend.core.models",
    "Environment": "backend.envs.environment",  # multi-turn: subclass with reset(row) and step(assistant_text)
    "Step": "backend.envs.environment",         # what an environment's step returns
    "register_environment": "backend.envs.environment",  # decorator: your environment under a name
    "register_tool": "backend.envs.tools",      # decorator: a function the model can call
    "SweepSpec": "backend.services.sweeps",     # a sweep: the keys varied (SweepParam), metric, budget, early stopping
    "SweepParam": "backend.services.sweeps",
    "create_sweep": "backend.services.sweeps",  # write a sweep's folder from a base config and a SweepSpec
    "run_sweep": "backend.services.sweeps",     # run it to its end (again after a restart: it continues)
    "read_sweep": "backend.services.sweeps",    # its trials, their states, metric and why each stopped
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'backend' has no attribute '{name}'")


def __dir__() -> list[str]:
    return __all__
