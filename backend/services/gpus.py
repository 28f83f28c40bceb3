"""The GPU kinds the planner knows: memory and the speeds its time predictions use. Apart from the planner, so
that naming one on the command line (`plan --gpu`) does not import torch."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str                     # the table's name, or the device's own for a GPU not in the table
    memory_gib: float
    tflops: float | None          # dense bf16 TFLOP/s; None: time is not predicted
    bandwidth_tbs: float | None   # memory TB/s


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h200", 141, 989, 4.8),
    GPU("h100", 80, 989, 3.35),
    GPU("a100-80gb", 80, 312, 2.0),
    GPU("a100-40gb", 40, 312, 1.55),
    GPU("l40s", 48, 362, 0.86),
    GPU("rtx4090", 24, 165, 1.0),
    GPU("l4", 24, 121, 0.3),
)}
DEFAULT_GPU = "h200"


def match_gpu(device_name: str, memory_gib: float) -> str | None:
    """The table's name for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    name = device_name.lower()
    for key, pattern in (("h200", r"h200"), ("h100", r"h100"), ("l40s", r"l40s"), ("rtx4090", r"4090"),
                         ("l4", r"\bl4\b")):
        if re.search(pattern, name):
            return key
    if "a100" in name:
        return "a100-80gb" if memory_gib > 60 else "a100-40gb"
    return None
