"""vLLM as the rollout engine (`actor_rollout_ref.rollout.name=vllm`), colocated with the FSDP actor.

Each worker (one rank of the FSDP group, one GPU) holds its own offline vLLM engine (`vllm.LLM`, tensor
parallel size 1) inside its own process, as TRL's colocate mode and verl's hybrid engine do. Written against
vLLM 0.26 (the `vllm` extra pins it); vLLM is optional and imported only when this engine is built.

- In process: `distributed_executor_backend="external_launcher"` (vLLM's ExecutorWithExternalLauncher) runs
  the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and joins the process group FSDP
  already started (RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from the environment): the world splits into
  world-size engines of one GPU each, which generate independently.
- Weights: before each generation the actor's gathered weights (`distributed.unsharded`) go, a tensor at a
  time under their Hugging Face names, to the in-process model's `load_weights`: device to device, no disk
  round trip. The engine starts with dummy weights (load_format="dummy"); it never samples before the
  first push.
- Memory: vLLM takes `rollout.gpu_memory_utilization` of the GPU for its weights, activations and KV
  cache (that much must be free when it starts). With `rollout.free_cache_engine` it runs in sleep mode:
  after each generation it sleeps at level 2 (weights and KV cache released: the next push overwrites the
  weights anyway), and before the next one it wakes the weights, takes the push, and only then wakes the
  KV cache, so the gathered actor and the KV cache are never held at once. An episode batch's turns run
  inside `awake()`: one push and one sleep for all its turns.
- Sampling: one request per response row with its own seed from (params.seed, global row id), so a row
  draws the same tokens whichever worker, batch or resumed step generates it (up to the numerics of
  batching). The log-prob of each sampled token comes back with logprobs_mode="processed_logprobs": after
  temperature (and top-k / top-p), the distribution the token was drawn from.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import torch

from backend.core import lora
from backend.core.vllm_support import INSTALL, installed_version
from backend.rollout.base import RolloutBatch, SamplingParams, assemble, fingerprint, stale_tensors

# ---- the pure parts: requests and weights ----

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, row: int) -> int:
    """A request seed for global row `row` of a batch sampled with `seed`: splitmix64 of the pair, kept
    to 63 bits (vLLM holds request seeds in int64). Rows of one batch, and the same row in another step,
    get unrelated seeds; the same (seed, row) always gets the same one."""
    x = (seed * 0x9E3779B97F4A7C15 + (row + 1) * 0xD6E8FEB86659FD93) & _MASK64
    for shift, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mul) & _MASK64
    return (x ^ (x >> 31)) >> 1


def sampling_kwargs(params: SamplingParams, eos_ids: list[int], row: int) -> dict:
    """`vllm.SamplingParams(**kwargs)` for global row `row` of a batch sampled with `params`: one
    response (rows are separate requests, each with its own seed), stop at the model's EOS ids unless
    ignore_eos, and the log-prob of each sampled token. Our top_k 0 means off, as vLLM's does; greedy is
    vLLM's temperature 0 (which also turns top-k and top-p off)."""
    greedy = params.greedy
    return {
        "n": 1,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": 0 if greedy else params.top_k,
        "max_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": [] if params.ignore_eos else list(eos_ids),
        "seed": row_seed(params.seed, row),
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,  # the trainer decodes; the engine has no tokenizer (skip_tokenizer_init)
    }


def vllm_requests(prompts: list[list[int]], params: SamplingParams, eos_ids: list[int],
                  first_row: int = 0, row_ids: list[int] | None = None,
                  max_model_len: int | None = None) -> list[tuple[dict, dict]]:
    """(prompt, sampling kwargs) per response row: `params.n` rows per prompt, prompt-major as every engine
    lays them out, row i of this call being global row first_row + i (or row_ids[i]). With max_model_len,
    a row asks at most what the context leaves after its prompt: a lockstep episode turn asks every row
    for the longest budget, and vLLM refuses a request that cannot fit."""
    rows = [p for p in prompts for _ in range(params.n)]
    keys = row_ids if row_ids is not None else range(first_row, first_row + len(rows))
    requests = []
    for p, key in zip(rows, keys, strict=True):
        kwargs = sampling_kwargs(params, eos_ids, key)
        if max_model_len is not None:
            kwargs["max_tokens"] = min(kwargs["max_tokens"], max_model_len - len(p))
        requests.append(({"prompt_token_ids": list(p)}, kwargs))
    return requests


def hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of `model` under its Hugging Face name, as vLLM's `load_weights` takes them.

    model: the actor while its parameters are whole (inside `distributed.unsharded`), or a plain model. A
    LoRA (PEFT) model gives its merged weights W + (alpha / rank) B A under the base model's names; the
    adapters themselves are not yielded. Tied weights come once (named_parameters drops repeats).
    """
    base = lora.unwrap(model)
    modules = dict(base.named_modules())
    for name, param in base.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            continue  # lora_A / lora_B: folded into their layer's weight below
        if owner.endswith(".base_layer"):
            layer = owner.removesuffix(".base_layer")
            tensor = lora.effective_weight(modules[layer]) if leaf == "weight" else param
            yield f"{layer}.{leaf}", tensor.detach()
            continue
        yield name, param.detach()


# The Hugging Face tensors vLLM's Llama and Qwen models stack into one parameter, and each one's place in the
# stack: its rows follow those before it (tensor parallel size 1).
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def engine_name(hf_name: str) -> tuple[str, int]:
    """The name of vLLM's parameter holding the Hugging Face tensor `hf_name`, and the tensor's place in it."""
    owner, _, leaf = hf_name.rpartition(".")
    module, _, last = owner.rpartition(".")
    if last in STACKED:
        stacked, place = STACKED[last]
        return f"{module}.{stacked}.{leaf}", place
    return hf_name, 0


def stale_in_engine(engine_params: dict[str, torch.Tensor],
                    weights: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the actor's `weights` (as `hf_weights` gives them) whose rows in vLLM's parameters differ
    from them, in the order they came: empty right after a whole weight push. A stacked parameter's rows are
    found from its parts' places and sizes; rows past the parts (vLLM pads the vocabulary) are not compared,
    nor weights that vLLM's model lays out otherwise than STACKED says (`load_weights` already fails when
    the push leaves a parameter of vLLM's unset). Each weight is reduced to its fingerprint as it comes, so a
    LoRA model's merged weights are never held together."""
    order = []
    stacks: dict[str, list[tuple[int, str, torch.Size, torch.Tensor]]] = {}
    for name, tensor in weights:
        order.append(name)
        target, place = engine_name(name)
        if target in engine_params:
            stacks.setdefault(target, []).append((place, name, tensor.shape, fingerprint(tensor).clone()))
    samples = []
    for target, parts in stacks.items():
        start = 0
        for _, name, shape, sample in sorted(parts, key=lambda part: part[0]):
            engine_rows = engine_params[target][start:start + shape[0]]
            if engine_rows.shape == shape:
                samples.append((name, fingerprint(engine_rows), sample))
            start += shape[0]
    stale = set(stale_tensors(samples))
    return [name for name in order if name in stale]


def log_prob_rows(log_probs: list[torch.Tensor], response_mask: torch.Tensor) -> torch.Tensor:
    """Each row's sampled-token log-probs laid out as the batch's responses: (B, R) fp32, 0 at padding."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, lp in enumerate(log_probs):
        n = min(len(lp), out.shape[1])
        out[i, :n] = lp[:n]
    return out * response_mask


# ---- the engine ----

def _prepare_environment(device: torch.device) -> None:
    """What ExecutorWithExternalLauncher reads: the engine core in this process, and this rank's place in
    the process group (distributed.init_process_group set RANK and MASTER_*; a process without a group
    gets a one-rank one)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    if torch.distributed.is_initialized():
        os.environ["RANK"] = str(torch.distributed.get_rank())
        os.environ["WORLD_SIZE"] = str(torch.distributed.get_world_size())
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


class VLLMEngine:
    """A rollout engine (see backend.rollout.base.RolloutEngine) on vLLM, colocated with the actor.

    Like decode.StaticCacheEngine, `load_weights(actor)` must be called while the actor's parameters are
    whole (under `distributed.unsharded`) before each `generate`: vLLM keeps its own copy of the weights.
    """

    def __init__(self, model_path: str, eos_ids: list[int], pad_id: int, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, *, gpu_memory_utilization: float, max_num_seqs: int, enforce_eager: bool,
                 sleep: bool, seed: int, kv_cache_dtype: str = "auto"):
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"actor_rollout_ref.rollout.name=vllm runs on CUDA GPUs only, and this worker's "
                               f"device is {device}: set trainer.device=auto (or cuda) on a GPU machine")
        if installed_version() is None:
            raise RuntimeError(f"actor_rollout_ref.rollout.name=vllm needs vLLM in every worker: {INSTALL}")
        _prepare_environment(device)
        from vllm import LLM

        self.eos_ids, self.pad_id = list(eos_ids), pad_id
        self.max_model_len = max_model_len
        self.sleep_mode = sleep
        self.llm = LLM(
            model=model_path, skip_tokenizer_init=True, generation_config="vllm", load_format="dummy",
            dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32"),
            tensor_parallel_size=1, distributed_executor_backend="external_launcher", seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager, enable_sleep_mode=sleep, logprobs_mode="processed_logprobs",
            kv_cache_dtype=kv_cache_dtype)
        # What is resident now; with sleep mode, nothing until the first push and generation.
        self.weights_awake = self.cache_awake = True
        self.loaded = False
        self._held = False  # inside awake(): generations do not sleep after themselves
        if sleep:
            self._sleep()

    def _sleep(self) -> None:
        # Level 2: the weights are overwritten by the next push, so nothing is kept in host memory.
        self.llm.sleep(level=2)
        self.weights_awake = self.cache_awake = self.loaded = False

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Generations inside stay awake and sleep once at the end (with sleep mode): an episode batch's turns
        share one weight push and one KV cache mapping instead of a sleep and a wake each."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
            if self.sleep_mode and (self.weights_awake or self.cache_awake):
                self._sleep()

    def _model(self) -> torch.nn.Module:
        """The model inside the in-process engine core (vLLM's driver worker's model)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise RuntimeError("vLLM's engine core runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING is on), "
                               "so its model cannot take the actor's weights in place")
        return executor.driver_worker.worker.get_model()

    @torch.no_grad()
    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the actor's current (whole, gathered) weights into vLLM's model, in place."""
        if not self.weights_awake:
            torch.cuda.empty_cache()  # what training freed goes back to the device before vLLM maps its weights
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True
        target = self._model()
        loaded = target.load_weights(hf_weights(model))
        if loaded is not None:
            missing = sorted({name for name, _ in target.named_parameters()} - set(loaded))
            if missing:
                raise RuntimeError(f"the actor's weights left {len(missing)} of vLLM's parameters unset "
                                   f"({', '.join(missing[:5])}...): its architecture's weight names do not match")
        self.loaded = True

    @torch.no_grad()
    def stale_tensors(self, model: torch.nn.Module) -> list[str]:
        """The names of the actor's (whole, gathered) weights whose copy in vLLM's model differs from them:
        empty right after a whole `load_weights` (a sample of each compared, see stale_in_engine)."""
        return stale_in_engine(dict(self._model().named_parameters()), hf_weights(model))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, progress=None,
                 first_row: int = 0, row_ids: list[int] | None = None) -> RolloutBatch:
        """n responses per prompt (rows prompt-major), with `rollout_log_probs`; `first_row` is the global
        id of the first row, the key of its seed (see row_seed), or `row_ids` each row's."""
        if not self.loaded:
            raise RuntimeError("VLLMEngine.generate before load_weights")
        from vllm import SamplingParams as VLLMSamplingParams

        requests = vllm_requests(prompts, params, self.eos_ids, first_row, row_ids, self.max_model_len)
        if progress is not None:
            progress(0, len(requests), 0, params.max_new_tokens)
        if not self.cache_awake:
            torch.cuda.empty_cache()  # the gathered actor was just freed: let vLLM map its KV cache there
            self.llm.wake_up(tags=["kv_cache"])
            self.cache_awake = True
        try:
            outputs = self.llm.generate([prompt for prompt, _ in requests],
                                        [VLLMSamplingParams(**kwargs) for _, kwargs in requests], use_tqdm=False)
        finally:
            if self.sleep_mode and not self._held:
                self._sleep()
        responses, log_probs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            responses.append(torch.tensor(ids, dtype=torch.long))
            # logprobs=0: each position holds the sampled token's entry (under its id)
            log_probs.append(torch.tensor([completion.logprobs[t][tok].logprob for t, tok in enumerate(ids)],
                                          dtype=torch.float32))
        batch = assemble(prompts, params.n, responses, self.eos_ids, self.pad_id, params.ignore_eos)
        batch.rollout_log_probs = log_prob_rows(log_probs, batch.response_mask)
        if progress is not None:
            progress(0, len(requests), max((len(r) for r in responses), default=0), params.max_new_tokens)
        return batch
