"""Baseline: time TRL's GRPOTrainer (HF generate, no vLLM) on a fixed workload, per optimizer step, so our
engine can be compared with TRL on the same settings. Prints a table; `--json` writes the numbers.

    pip install trl==1.16.0 datasets                     # not a dependency of the workbench
    python bench/trl_grpo.py --model DIR --random-prompts 4 --num-generations 4 \\
        --max-completion-length 16 --force-length --steps 3 --micro-batch 8          # CPU smoke run
    python bench/trl_grpo.py --model DIR --prompts-parquet sample_data/arithmetic_train.parquet \\
        --num-prompts 4 --num-generations 4 --max-completion-length 64 --steps 2     # CPU, a real model
    python bench/trl_grpo.py --model DIR --random-prompts 64 --num-generations 8 \\
        --max-completion-length 256 --force-length --steps 4 --micro-batch 64 --bf16 --json trl.json   # GPU anchor

Every optimizer step generates fresh completions for ALL prompts x num_generations, then runs them through
the loss in micro-batches of --micro-batch completions (gradient accumulation). The first step is a warm-up
and is left out of the medians.

How each phase is measured (TRL 1.16.0, by wrapping, TRL itself unchanged):
  step          TrainerCallback on_step_begin -> on_step_end (one optimizer step; the logging that follows
                on_step_end is outside it)
  gen           the policy's `generate` (the object TRL's unwrap_model_for_generation hands back)
  ref           GRPOTrainer._get_per_token_logps_and_entropies called with the reference model
  old_log_prob  the same method called on the policy under no_grad; TRL skips it (0 s) when generations are
                not reused (steps_per_generation == gradient_accumulation_steps, num_iterations == 1)
  other         GRPOTrainer._generate_and_score_completions minus gen, ref and old_log_prob: tokenizing,
                decoding, rewards, advantages, metric gathering
  update        step minus _generate_and_score_completions: every micro-batch's forward, loss and backward,
                gradient clipping, AdamW, scheduler, zero_grad. update_forward is the policy forward part.
So step = gen + ref + old_log_prob + other + update. On CUDA every boundary synchronizes first.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PHASES = ["step", "gen", "ref", "old_log_prob", "update", "update_forward", "other"]
TESTED_TRL = "1.16.0"
WORDS = ["river", "robot", "garden", "violin", "comet", "lantern", "harbor", "desert", "falcon", "castle",
         "meadow", "glacier", "engine", "orchard", "compass", "thunder"]

Prompt = str | list[dict[str, str]]


def random_prompts(n: int) -> list[str]:
    """n distinct plain-text prompts of about 8 tokens each, the same on every call."""
    return [f"Write a story about {WORDS[i % len(WORDS)]} number {i}" for i in range(n)]


def parquet_prompts(path: str | Path, n: int) -> list[list[dict[str, str]]]:
    """The first n rows' `prompt` column of a verl-shaped parquet: each a list of chat messages."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
    if len(rows) < n:
        raise ValueError(f"{path} has {len(rows)} rows, fewer than the {n} prompts asked for: lower --num-prompts")
    return [[{"role": m["role"], "content": m["content"]} for m in messages] for messages in rows[:n]]


def distinct_token_reward(completions: list, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Fraction of distinct tokens in each completion: cheap, and it varies within a group, so advantages are
    not all zero (with equal rewards the policy loss would be trivially zero)."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


class PhaseClock:
    """Seconds per phase for the optimizer step in progress; `sync` makes CUDA work count where it ran."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.current: dict[str, float] = {}
        self.generated_tokens = 0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def timed(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            out = fn(*args, **kwargs)
            self.add(phase, self.now() - start)
            return out

        return wrapper


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def run_trl(
    model_dir: str | Path,
    prompts: list[Prompt],
    *,
    steps: int = 4,
    num_generations: int = 8,
    max_completion_length: int = 256,
    force_length: bool = True,
    beta: float = 0.04,
    lr: float = 1e-6,
    micro_batch: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    bf16: bool | None = None,
    gradient_checkpointing: bool = True,
    reward_fn: Callable[..., list[float]] | None = None,
    device: str = "auto",
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
) -> dict[str, Any]:
    """Train `steps` optimizer steps of TRL's GRPOTrainer and time each one (see the module docstring).

    prompts: plain strings, or chat message lists (these go through the tokenizer's chat template, as our
    engine renders the data's `prompt` column). Each step: len(prompts) * num_generations fresh completions,
    micro-batches of `micro_batch` completions. top_k <= 0 means no top-k. bf16=None: bf16 weights on CUDA,
    fp32 on CPU; bf16=True on CPU: fp32 weights in TRL's autocast to bf16. reward_fn has TRL's signature
    (prompts, completions, completion_ids, **kwargs) -> floats.
    device: "cpu", "cuda" or "auto". lora_rank > 0: PEFT adapters of that rank (and lora_alpha) on every
    linear layer but the head, as our actor_rollout_ref.model.lora_rank; TRL's reference is then the base
    with the adapters off, as ours.

    Returns per-step lists (`step_s`, `gen_s`, ... with the warm-up first), medians over the steps after
    the first (`median`), `tokens_per_s` (median of generated tokens / gen seconds), `generated_tokens_per_step`,
    `peak_allocated_gb` / `peak_reserved_gb` (GiB, CUDA only, from the second step on), versions, `settings`.
    """
    # TRL is not a workbench dependency: import it only when a baseline is actually run.
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if steps < 2:
        raise ValueError(f"steps={steps}: need at least 2, the first step is a warm-up and is not counted")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'cpu', 'cuda' or 'auto'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no GPU: use device='cpu'")
    cuda = device == "cuda"
    bf16 = cuda if bf16 is None else bf16
    completions = len(prompts) * num_generations
    micro_batch = min(micro_batch, completions)
    if completions % micro_batch:
        divisors = [d for d in range(1, completions + 1) if completions % d == 0]
        raise ValueError(f"{len(prompts)} prompts x {num_generations} generations = {completions} completions is "
                         f"not divisible by micro_batch={micro_batch}: choose one of {divisors}")
    grad_accum = completions // micro_batch

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # TRL left-pads prompts with it
    # On GPUs the weights are bf16 (passing the model object, not a path, is what makes them so: TRL's own
    # load is float32; the reference model TRL builds takes the policy's dtype). On the CPU they stay fp32
    # and bf16 means TRL's own mixed precision (autocast), as a run of TRL's defaults there does.
    dtype = torch.bfloat16 if bf16 and cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    chat = not isinstance(prompts[0], str)
    if chat:
        prompt_lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"]) for p in prompts]
    else:
        prompt_lengths = [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]

    out_dir = tempfile.mkdtemp(prefix="trl-grpo-")
    args = GRPOConfig(
        output_dir=out_dir,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",  # the lr as given on every step, not TRL's linear decay
        warmup_steps=0,
        per_device_train_batch_size=micro_batch,  # in completions, not prompts
        gradient_accumulation_steps=grad_accum,
        # One generation of len(prompts) * num_generations per optimizer step, never reused: the generation
        # batch is micro_batch * steps_per_generation, and TRL regenerates every steps_per_generation *
        # num_iterations micro-steps.
        steps_per_generation=grad_accum,
        num_iterations=1,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        # min_new_tokens masks EOS until the last token, so every completion decodes all the steps.
        generation_kwargs={"min_new_tokens": max_completion_length} if force_length else None,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        beta=beta,
        bf16=bf16,
        gradient_checkpointing=gradient_checkpointing,
        use_cpu=not cuda,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        seed=0,
    )
    dataset = datasets.Dataset.from_dict({"prompt": list(prompts)})
    peft_config = None
    if lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn or distinct_token_reward, args=args,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)

    # ---- hooks: wrap, don't edit TRL ----
    clock = PhaseClock(cuda)
    for name in ("_generate_and_score_completions", "_get_per_token_logps_and_entropies"):
        if not hasattr(trainer, name):
            raise RuntimeError(f"TRL {trl.__version__} has no GRPOTrainer.{name}; this runner was written against "
                               f"TRL {TESTED_TRL}")
    eos_ids = torch.tensor(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])

    policy = trainer.model
    generate = policy.generate

    @functools.wraps(generate)
    def timed_generate(*a: Any, **kw: Any) -> torch.Tensor:
        start = clock.now()
        out = generate(*a, **kw)
        clock.add("gen", clock.now() - start)
        # Tokens up to and including the first EOS: what the completion holds, as TRL masks it.
        new = out[:, kw["input_ids"].shape[1]:].cpu()  # (batch, new_tokens)
        is_eos = torch.isin(new, eos_ids)
        first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new.shape[1])
        clock.generated_tokens += int(first_eos.sum())
        return out

    policy.generate = timed_generate  # instance attribute: shadows the class method for this model only

    logps = trainer._get_per_token_logps_and_entropies

    @functools.wraps(logps)
    def timed_logps(model: Any, *a: Any, **kw: Any) -> Any:
        # With LoRA, TRL's reference pass is the policy inside PEFT's disable_adapter().
        if model is trainer.ref_model or (lora_rank and any(getattr(m, "disable_adapters", False)
                                                            for m in model.modules() if hasattr(m, "lora_A"))):
            phase = "ref"
        elif torch.is_grad_enabled():
            phase = "update_forward"  # the policy forward inside the loss, part of update
        else:
            phase = "old_log_prob"
        start = clock.now()
        out = logps(model, *a, **kw)
        clock.add(phase, clock.now() - start)
        return out

    trainer._get_per_token_logps_and_entropies = timed_logps
    trainer._generate_and_score_completions = clock.timed("rollout", trainer._generate_and_score_completions)

    per_step: dict[str, list[float]] = {f"{p}_s": [] for p in PHASES}
    per_step["generated_tokens"] = []
    logged: list[dict[str, float]] = []
    step_start = [0.0]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if cuda and state.global_step == 1:
                torch.cuda.reset_peak_memory_stats()  # peaks from the first counted step on
            clock.current = {}
            clock.generated_tokens = 0
            step_start[0] = clock.now()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = clock.now() - step_start[0]
            c = clock.current
            rollout = c.get("rollout", 0.0)
            phases = {
                "step": step, "gen": c.get("gen", 0.0), "ref": c.get("ref", 0.0),
                "old_log_prob": c.get("old_log_prob", 0.0), "update_forward": c.get("update_forward", 0.0),
                "update": step - rollout,
                "other": rollout - c.get("gen", 0.0) - c.get("ref", 0.0) - c.get("old_log_prob", 0.0),
            }
            for name, value in phases.items():
                per_step[f"{name}_s"].append(round(value, 4))
            per_step["generated_tokens"].append(clock.generated_tokens)
            print(f"step {state.global_step}/{args.max_steps}: {step:.2f} s (gen {phases['gen']:.2f}, "
                  f"ref {phases['ref']:.2f}, update {phases['update']:.2f}), "
                  f"{clock.generated_tokens} tokens generated", flush=True)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs and "completions/mean_length" in logs:
                logged.append(dict(logs))

    trainer.add_callback(StepTimer())
    trainer.train()

    # ---- summary: the first step is the warm-up ----
    counted = slice(1, None)
    gen_tps = [t / g for t, g in zip(per_step["generated_tokens"][counted], per_step["gen_s"][counted], strict=True)
               if g > 0]
    result: dict[str, Any] = {
        **per_step,
        "completion_mean_length": [m.get("completions/mean_length") for m in logged],
        "completion_min_length": [m.get("completions/min_length") for m in logged],
        "trl_step_time_s": [m.get("step_time") for m in logged],  # TRL's own: the sum of its training_step calls
        "counted_steps": len(per_step["step_s"]) - 1,
        "median": {p: _median(per_step[f"{p}_s"][counted]) for p in PHASES},
        "tokens_per_s": round(statistics.median(gen_tps), 1) if gen_tps else None,
        "generated_tokens_per_step": _median(per_step["generated_tokens"][counted]),
        "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else f"cpu x{torch.get_num_threads()} threads",
    }
    result["forced_length_ok"] = (not force_length) or all(
        n == max_completion_length for n in result["completion_min_length"])
    result["settings"] = {
        "model_dir": str(model_dir), "prompts": len(prompts), "prompt_format": "chat" if chat else "text",
        "prompt_tokens_mean": round(statistics.mean(prompt_lengths), 1), "num_generations": num_generations,
        "completions_per_step": completions, "micro_batch": micro_batch, "gradient_accumulation_steps": grad_accum,
        "steps_per_generation": args.steps_per_generation, "generation_batch_size": args.generation_batch_size,
        "num_iterations": args.num_iterations, "steps": steps, "max_completion_length": max_completion_length,
        "force_length": force_length, "beta": beta, "lr": lr, "lora_rank": lora_rank, "lora_alpha": lora_alpha,
        "loss_type": args.loss_type,
        "scale_rewards": args.scale_rewards, "temperature": temperature, "top_p": top_p, "top_k": args.top_k,
        "bf16": bf16, "weights_dtype": str(dtype).removeprefix("torch."),
        "gradient_checkpointing": gradient_checkpointing, "reference_model": trainer.ref_model is not None,
        "reward": (reward_fn or distinct_token_reward).__name__,
    }
    return result


def print_table(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(f"\nTRL {result['trl_version']} GRPOTrainer on {result['device']}: {s['prompts']} prompts x "
          f"{s['num_generations']} x {s['max_completion_length']} tokens, micro-batch {s['micro_batch']}, "
          f"{s['weights_dtype']}, checkpointing {s['gradient_checkpointing']}, beta {s['beta']}; "
          f"median of {result['counted_steps']} steps after the warm-up")
    print(f"| {'quantity':<26} | {'value':>12} |")
    print(f"|{'-' * 28}|{'-' * 14}|")
    rows = [(f"{p} s", v) for p, v in result["median"].items()]
    rows += [("generated tokens / step", result["generated_tokens_per_step"]),
             ("gen tokens/s", result["tokens_per_s"]),
             ("peak allocated GiB", result["peak_allocated_gb"]),
             ("peak reserved GiB", result["peak_reserved_gb"])]
    for name, value in rows:
        print(f"| {name:<26} | {value!s:>12} |")
    print(f"step times (s): {result['step_s']}")
    print(f"completion mean length per step (TRL's log): {result['completion_mean_length']}")
    if not result["forced_length_ok"]:
        print(f"WARNING: --force-length but completion lengths {result['completion_min_length']} fell short of "
              f"{s['max_completion_length']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (weights + tokenizer)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts-parquet", help="verl-shaped parquet; its `prompt` column holds chat messages")
    source.add_argument("--random-prompts", type=int, metavar="N", help="N distinct plain prompts of ~8 tokens")
    p.add_argument("--num-prompts", type=int, default=64, help="how many rows of --prompts-parquet to use")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, the first a warm-up")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--force-length", action="store_true", help="no early EOS: every completion is full length")
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient; 0 drops TRL's reference model")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--micro-batch", type=int, default=64, help="completions per forward/backward")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or less: no top-k")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and autocast (default: on with CUDA, off on CPU)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="TRL's default, on")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--lora-rank", type=int, default=0, help="PEFT LoRA adapters of this rank (0: every weight)")
    p.add_argument("--json", default=None, help="write the result dict here")
    args = p.parse_args()

    prompts: list[Prompt] = (parquet_prompts(args.prompts_parquet, args.num_prompts) if args.prompts_parquet
                             else random_prompts(args.random_prompts))
    result = run_trl(args.model, prompts, steps=args.steps, num_generations=args.num_generations,
                     max_completion_length=args.max_completion_length, force_length=args.force_length,
                     beta=args.beta, lr=args.lr, micro_batch=args.micro_batch, temperature=args.temperature,
                     top_p=args.top_p, top_k=args.top_k, bf16=args.bf16,
                     gradient_checkpointing=args.gradient_checkpointing, device=args.device,
                     lora_rank=args.lora_rank)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"written to {args.json}")


if __name__ == "__main__":
    main()
