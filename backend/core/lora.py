"""LoRA through PEFT: low-rank adapters on the actor's linear layers, trained while the base stays frozen
(Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

What it changes in a run:
- Only the adapters (2 x rank x (in + out) numbers per adapted layer) get gradients and AdamW state;
  the base keeps its weights in memory but no optimizer state.
- The reference model is the actor with its adapters switched off (`reference_mode`): no second copy.
- The rollout engine samples with the merged weights W + (alpha / rank) B A (`effective_weight`).
- Checkpoints hold the whole PEFT model (base and adapters, PEFT's parameter names) and `lora.json`;
  export and merging fold the adapters in (`merge_state_dict`), so what comes out is a plain Hugging
  Face folder that loads without PEFT.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

SETTINGS_FILE = "lora.json"  # rank and alpha, next to a checkpoint's shards


def wrap(model: torch.nn.Module, rank: int, alpha: float, target_modules: list[str]) -> torch.nn.Module:
    """`model` with LoRA adapters of `rank` on `target_modules` (["all-linear"] for every linear layer but
    the output head); only the adapters train. Adapters start at B = 0, so the model is unchanged."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = "all-linear" if target_modules == ["all-linear"] else list(target_modules)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_wrapped(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "disable_adapter")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside a PEFT model (its linear layers still carry the adapters), or `model`."""
    return model.get_base_model() if is_wrapped(model) else model


@contextlib.contextmanager
def reference_mode(model: torch.nn.Module) -> Iterator[None]:
    """The base model's outputs for the duration: what the reference model of a LoRA run computes.

    Each adapted layer's switch is flipped directly rather than through PEFT's `disable_adapter`, which
    also turns the adapters' requires_grad off and on: FSDP2 reads requires_grad at its first forward to
    choose the dtype it reduces gradients in, and a first forward in this mode would make it reduce the
    adapters' gradients in bf16 into fp32 parameters (it fails on the GPU)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    saved = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, state in zip(layers, saved, strict=True):
            m._disable_adapters = state


def effective_weight(linear: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as the forward uses it: W + scaling * B A for a LoRA layer, else W."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    weight = base.weight
    for name in linear.active_adapters:
        if name in linear.lora_A:
            weight = weight + linear.get_delta_weight(name).to(weight.dtype)
    return weight


def save_settings(folder: Path, rank: int, alpha: float) -> None:
    (folder / SETTINGS_FILE).write_text(json.dumps({"rank": rank, "alpha": alpha}))


def load_settings(folder: Path) -> dict | None:
    path = Path(folder) / SETTINGS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.[^.]+\.weight$")


def merge_state_dict(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict as the plain model's: W' = W + (alpha / rank) B A for every adapted
    layer, PEFT's prefixes and `base_layer` dropped from the names.

    state: PEFT names, e.g. base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight with its
    ...q_proj.lora_A.default.weight (rank, in) and ...q_proj.lora_B.default.weight (out, rank).
    """
    scaling = alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _LORA_KEY.match(key)
        if match:
            pairs.setdefault(match["module"], {})[match["which"]] = value
        else:
            out[key] = value
    for module, ab in pairs.items():
        base = f"{module}.base_layer.weight"
        out[base] = (out[base].float() + scaling * (ab["B"].float() @ ab["A"].float())).to(out[base].dtype)
    plain = {}
    for key, value in out.items():
        key = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        plain[key] = value
    return plain
