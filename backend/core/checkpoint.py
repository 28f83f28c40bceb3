"""Sharded checkpoints: what each rank writes, how a run resumes from them, and how they are merged
into a plain Hugging Face folder.

    checkpoints/step_N/
      trainer_state.json        the controller: step, data position, KL coefficient, world size
      huggingface/              rank 0 and the controller: config.json, generation_config.json, tokenizer
      shards/                   torch.distributed.checkpoint: one __<rank>_0.distcp file per rank (its
                                FSDP shards of the weights and of the optimizer state) and .metadata
      extra_state_rank_R.pt     each rank: learning-rate schedule and RNG state

Merging (what verl's model merger does for FSDP) reads only the weights out of shards/ into full
tensors, without a process group, and writes them with the config and tokenizer from huggingface/.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from backend.core import lora
from backend.core.runs import HF

SHARDS = "shards"
_MODEL = "model"
_OPTIM = "optim"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says why and what to do."""


def is_sharded(folder: str | Path) -> bool:
    return (Path(folder) / SHARDS / ".metadata").is_file()


def world_size_of(folder: str | Path) -> int | None:
    """The number of ranks that wrote a sharded checkpoint (from its trainer_state.json)."""
    try:
        return json.loads((Path(folder) / "trainer_state.json").read_text()).get("world_size")
    except (OSError, ValueError):
        return None


# ---- inside the workers (collective: every rank calls these) ----

def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({_MODEL: model_sd, _OPTIM: optim_sd}, checkpoint_id=folder / SHARDS)
    torch.save({"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
               folder / f"extra_state_rank_{rank}.pt")
    if rank == 0:
        inner = model.module if hasattr(model, "module") else model
        inner.config.save_pretrained(folder / HF)
        if inner.generation_config is not None:
            inner.generation_config.save_pretrained(folder / HF)


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, rank: int) -> None:
    """Restore this rank's shards; the controller has checked that as many ranks wrote them (checks.resume_problems).
    `optimizer` and `scheduler` are built from the current config, whose learning rate, betas and weight decay
    are kept."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {_MODEL: model_sd, _OPTIM: optim_sd}
    dcp.load(state, checkpoint_id=folder / SHARDS)
    set_state_dict(model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM])
    extra = torch.load(folder / f"extra_state_rank_{rank}.pt", weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    # The optimizer as configured now wins over the checkpoint's settings: a fork with an edited learning rate
    # trains at that rate from its first step (a plain resume has the same settings, so nothing changes).
    lr = optimizer.defaults["lr"]
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(initial_lr=lr, lr=lr * factor(scheduler.last_epoch), betas=optimizer.defaults["betas"],
                     weight_decay=optimizer.defaults["weight_decay"])


# ---- anywhere (no process group) ----

def merged_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint, assembled from every rank's shards (fp32, CPU), under the
    plain model's names (a LoRA run's adapters merged in)."""
    import torch.distributed.checkpoint as dcp

    shards = Path(folder) / SHARDS
    if not (shards / ".metadata").is_file():
        raise CheckpointError(f"{folder} is not a sharded checkpoint (no {SHARDS}/.metadata)")
    metadata = dcp.FileSystemReader(str(shards)).read_metadata()
    prefix = f"{_MODEL}."
    weights = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and hasattr(meta, "size")}
    state = {_MODEL: weights}
    with warnings.catch_warnings():  # loading without a process group is the point here, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=shards, no_dist=True)
    settings = lora.load_settings(Path(folder))
    if settings is not None:  # a LoRA run's checkpoint: fold the adapters into the plain model's weights
        return lora.merge_state_dict(state[_MODEL], settings["rank"], settings["alpha"])
    return state[_MODEL]


def model_from_state_dict(config, state: dict[str, torch.Tensor], generation_config=None,
                          dtype: torch.dtype = torch.float32, source: str = "the checkpoint"):
    """A `transformers` causal LM built from `config` holding the weights `state`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or any(k not in tied and "lm_head" not in k for k in missing):
        raise CheckpointError(f"the weights of {source} do not match its config: missing {missing}, "
                              f"unexpected {unexpected}")
    model.tie_weights()
    if generation_config is not None:
        model.generation_config = generation_config
    return model


def save_hf(state: dict[str, torch.Tensor], config, generation_config, folder: Path) -> None:
    """Full weights as a Hugging Face folder (safetensors, config.json, generation_config.json)."""
    model_from_state_dict(config, state, generation_config).save_pretrained(folder)


def load_merged_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """A sharded checkpoint as a `transformers` model, built from its config and merged weights."""
    from transformers import AutoConfig, GenerationConfig

    folder = Path(folder)
    generation = GenerationConfig.from_pretrained(folder / HF) if (folder / HF / "generation_config.json").is_file() \
        else None
    return model_from_state_dict(AutoConfig.from_pretrained(folder / HF), merged_state_dict(folder), generation,
                                 dtype, source=str(folder))


def merge(folder: str | Path, output: str | Path) -> Path:
    """Write a sharded checkpoint's weights, config and (when it holds one) tokenizer into `output`
    as a Hugging Face folder that `from_pretrained` loads."""
    from transformers import AutoTokenizer

    folder, output = Path(folder), Path(output)
    load_merged_model(folder).save_pretrained(output)
    if (folder / HF / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(folder / HF).save_pretrained(output)
    return output
