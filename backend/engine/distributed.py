"""torch.distributed inside a worker: the process group, FSDP2 sharding, and gathering the shards.

Memory of the colocated actor on each of W ranks, for a model of P parameters (bytes; GPU, bf16
mixed precision; the reference adds its own shard):

    phase                at rest                         transient on top
    between phases       4P/W fp32 master shard          -
                         + 8P/W Adam moments (after the first update)
    generation           same                            2P: every layer's bf16 parameters gathered at
                                                         once (`unsharded`), + the KV cache
    log-probs / update   same (+ 4P/W fp32 grad shard)   2P/L per layer being computed (gathered, freed
                                                         after its forward and backward), + activations
    reference log-probs  2P/W reference shard (bf16)     2P/L per layer

The workbench rollout engine (backend.rollout.static_cache) also keeps its own 2P bf16 copy of the weights through
every phase: the gathered weights are copied into it and freed before decoding starts, and its KV cache
is freed after generation. backend.services.planner turns this table into numbers for a config.

With `offload_policy` the shards, gradients and optimizer state live in CPU memory instead, and the
optimizer steps on the CPU; only the gathered layers sit on the GPU. A CPU computes in bf16 the same
way where it has bf16 instructions (param_dtype), and in fp32 elsewhere: the gathered copies are then 4P
and 4P/L.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

# How long ranks wait for each other to join (torch's own default for a store).
_MEET_TIMEOUT = timedelta(seconds=300)


def meeting_store(host: str) -> dist.TCPStore:
    """The store a process group's ranks meet at, served from this process (the controller) on a port the
    OS picks as it binds. Keep it as long as the group runs. A free port found here and bound later by rank
    0 can be taken in between: with eight runs starting at once on one machine, one was."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_MEET_TIMEOUT)


@functools.cache
def _local_store() -> dist.TCPStore:
    return meeting_store("127.0.0.1")


def local_meeting_point() -> tuple[str, int]:
    """Where a worker built inside this process (a test's, a benchmark's: rank 0 of a one-rank group) meets:
    one store served here for the process's life, since its process group, made once, outlives the worker."""
    return "127.0.0.1", _local_store().port


def init_process_group(rank: int, world_size: int, store_host: str, store_port: int, device: torch.device) -> None:
    """Join the run's process group through the store at `store_host:store_port` (`meeting_store`): NCCL
    between GPUs, gloo between CPU processes. A process that already has one (a test holding several
    one-rank workers) keeps it."""
    if dist.is_initialized():
        return
    # vLLM's external launcher reads this rank's place from the environment (backend.rollout.vllm_engine).
    os.environ.update(MASTER_ADDR=store_host, MASTER_PORT=str(store_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=_MEET_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # cuDNN's attention builds an execution graph for each new (rows, positions) shape, tens to hundreds
        # of milliseconds each, and micro-batches cut to their rows' widths are nearly all new shapes; the
        # flash kernel prepares nothing per shape (bench/attention_shapes.py, docs/performance.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def transfer_group(store_host: str, store_port: int, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """A process group of its own between the actor's rank 0 (rank 0 here) and the rollout workers, for moving
    weights (trainer.rollout_mode=async): outside the actor's group, whose collectives involve only the actor's
    ranks. NCCL between GPUs, gloo between CPU processes; it meets at the store `meeting_store` serves."""
    store = dist.PrefixStore("weights", dist.TCPStore(store_host, store_port, is_master=False, timeout=_MEET_TIMEOUT))
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, _MEET_TIMEOUT)


def broadcast_tensors(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0's tensors into every other rank's, in place, one after another (every rank passes tensors of the
    same shapes and dtypes, in the same order)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for t in tensors:
        group.broadcast([t], options).wait()


def param_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype parameters are gathered and computed in: unless told otherwise, bf16 on GPUs and on CPUs
    with bf16 matrix instructions (AVX512-BF16 or AMX: there a bf16 matrix product ran 4.5 times as fast
    as fp32's), fp32 on other CPUs, where bf16 would be emulated."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[setting]


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def shard_model(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype,
                offload: bool = False, compile_layers: bool = False, per_layer: bool = True) -> torch.nn.Module:
    """Wrap `model` with FSDP2: each decoder layer is one unit (gathered for its own forward and
    backward, freed after), the root holds the embeddings, final norm and head. Parameters stay in the
    dtype they were loaded in (fp32 master weights for the actor); they are gathered in `compute_dtype`
    and gradients are reduced in fp32.

    per_layer=False: the root is the only unit, for a model whose phases gather it whole anyway
    (`gathers_once`): units per layer would then only add FSDP's hooks around each layer's forward and
    backward, host work the GPU waits on.

    compile_layers: compile each decoder layer's forward (not the module call, so FSDP's gather and
    free hooks stay outside the graph and parameter names do not change). All layers share one graph,
    compiled for any batch and sequence length: both change from call to call (each step's prompt
    width, a shorter last micro-batch, the token view's few rows), and a graph compiled for the first
    shapes would be compiled again on the second step.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if compile_layers:
        # The layers' float attributes (norm epsilons, attention scaling) are constants. Left unspecialised, as
        # dynamic=True would have them, Dynamo traces them as symbols, cannot turn them into tensors and traces
        # each of the layer's first graphs twice ("Restarting analysis due to ... tensorify_python_scalars").
        torch._dynamo.config.specialize_float = True
    for layer in decoder_layers(model):
        if compile_layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        if per_layer:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (the class its `_no_split_modules` names)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """All parameters gathered for the duration, kept through every forward and backward, and sharded
    again after (which drops the gathered copies: an optimizer step must come after this context, since
    it changes only the shards).

    While gathered, forward passes run no collectives, so ranks may take different numbers of decoding
    steps (their responses end at different lengths) without waiting for each other.
    """
    modules = fsdp_modules(model)
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_reshard_after_forward(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()


def gathers_once(world_size: int, offload: bool) -> bool:
    """Whether a phase (log-probs, one mini-batch of the update) should gather the model once instead of
    layer by layer. On one rank a shard is the whole layer, so sharding saves no memory and only costs
    time: each micro-batch's forward and backward would cast and copy every layer's weights again (and
    reduce its gradients), host work that left the GPU idle between kernels. It costs the gathered copy
    (2P bytes in bf16) and, in the update, unreduced fp32 gradients (4P) until the last micro-batch.
    Offloaded parameters stay layer by layer: gathering them all would undo the offload."""
    return world_size == 1 and not offload


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors on rank 0 (empty on the other ranks); every rank
    must call it, since gathering is collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def global_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip gradients by their norm over all ranks' shards; returns that norm as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
