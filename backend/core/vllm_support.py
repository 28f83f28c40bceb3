"""Whether this machine can run the vLLM rollout engine (`actor_rollout_ref.rollout.name=vllm`): checked
when a config is validated, without importing vLLM itself."""

from __future__ import annotations

import importlib.metadata
import importlib.util

SUPPORTED = (0, 26)  # the vLLM minor release this engine is written against (pyproject's `vllm` extra)
INSTALL = "pip install 'grpo-workbench[vllm]'"
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses a temperature above 2


def installed_version() -> str | None:
    """The installed vLLM's version, or None when it is not installed (vLLM itself is not imported)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _minor(version: str) -> tuple[int, int] | None:
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def config_problems(cfg) -> list[str]:
    """Why a config with rollout.name=vllm cannot run here: vLLM missing or of another release, no CUDA,
    or sampling settings vLLM refuses. Called by config.validate_config."""
    import torch  # only for a config that chose vLLM: the config module stays light without it

    problems = []
    key = "actor_rollout_ref.rollout.name=vllm"
    version = installed_version()
    if version is None:
        problems.append(f"{key} needs vLLM, which is not installed here: {INSTALL} (vLLM "
                        f"{SUPPORTED[0]}.{SUPPORTED[1]}, which brings its own CUDA build of torch), or choose "
                        "rollout.name=auto")
    elif _minor(version) != SUPPORTED:
        problems.append(f"{key} is written against vLLM {SUPPORTED[0]}.{SUPPORTED[1]}, and vLLM {version} is "
                        f"installed: {INSTALL}")
    if cfg.trainer.device == "cpu":
        problems.append(f"{key} runs on CUDA GPUs only, and trainer.device=cpu: set trainer.device=auto (or cuda), "
                        "or choose rollout.name=auto")
    elif not cfg.trainer.ray_address and not torch.cuda.is_available():
        problems.append(f"{key} runs on CUDA GPUs only, and this machine has none visible to torch "
                        f"(torch {torch.__version__}): run it on a GPU machine, or choose rollout.name=auto")
    t = cfg.actor_rollout_ref.rollout.temperature
    if t > MAX_TEMPERATURE:
        problems.append(f"actor_rollout_ref.rollout.temperature={t} is above {MAX_TEMPERATURE:g}, the most vLLM "
                        "samples with")
    return problems
