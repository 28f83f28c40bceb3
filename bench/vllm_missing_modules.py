"""Which packages vLLM's offline generation path imports and this machine lacks, all in one run.

Imports the modules the vLLM rollout engine reaches; each missing package is noted and replaced by an
empty stand-in (in this process only) so the import goes on to the next one. A diagnostic for carrying
vLLM to a machine without a package index: carry the wheels of what it names.

    PYTHONPATH=/tmp/site python3 bench/vllm_missing_modules.py
"""

from __future__ import annotations

import importlib
import sys
import types

MODULES = ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu.model_runner", "vllm.v1.sample.sampler",
           "vllm.model_executor.models.qwen3", "vllm.model_executor.models.llama", "vllm.device_allocator.cumem")


class _StandIn(types.ModuleType):
    """Any attribute is a fresh class, so annotations, base classes and decorators at import time pass."""

    __path__: list[str] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})


def main() -> None:
    missing: list[str] = []
    for name in MODULES:
        while True:
            try:
                importlib.import_module(name)
                print(f"ok      {name}")
                break
            except ModuleNotFoundError as e:
                if not e.name or e.name in missing or e.name.startswith("vllm"):
                    print(f"failed  {name}: {e}")
                    break
                missing.append(e.name)
                sys.modules[e.name] = _StandIn(e.name)
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on to the next module
                print(f"failed  {name}: {type(e).__name__}: {e}")
                break
    print("missing:", ", ".join(missing) or "nothing")


if __name__ == "__main__":
    main()
