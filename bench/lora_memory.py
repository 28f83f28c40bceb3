"""GPU memory of full fine-tuning against LoRA on the same step: one worker in this process generates a
batch, computes the reference log-probs and takes one update, first training every weight, then with LoRA
adapters of each given rank. Prints each phase's peak and what stays allocated between steps; writes a JSON.

    python bench/lora_memory.py --tokenizer <folder> --out bench/results/<date>-h200-lora-memory.json
    python bench/lora_memory.py --tokenizer <folder> --small       # checks the script on the CPU

The model is the performance workload's (Qwen3-0.6B architecture, random weights; --small: 2 layers).
Layers are not compiled and the engine runs without graphs, so each configuration starts in seconds;
both configurations run the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import grpo_step  # noqa: E402
import reference_step  # noqa: E402
import trl_grpo  # noqa: E402

from backend.core.config import load_config, to_dict  # noqa: E402
from backend.engine import distributed  # noqa: E402
from backend.engine.workers import ActorRolloutRefWorker  # noqa: E402


def measure(model_dir: Path, prompts: Path, rank: int, device: str, small: bool) -> dict:
    prompts_per_step, response, micro = (4, 16, 8) if small else (16, 256, 32)
    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{prompts}]",
                 f"data.train_batch_size={prompts_per_step}", "actor_rollout_ref.rollout.n=8",
                 "data.max_prompt_length=16", f"data.max_response_length={response}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step}",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
                 "actor_rollout_ref.rollout.generation_batch_size=128", "actor_rollout_ref.rollout.enforce_eager=true",
                 "actor_rollout_ref.actor.use_torch_compile=false", "actor_rollout_ref.actor.kl_loss_coef=0.04",
                 f"actor_rollout_ref.model.lora_rank={rank}", f"actor_rollout_ref.model.lora_alpha={2 * max(rank, 1)}",
                 f"custom_reward_function.path={BENCH / 'bench_reward.py'}",
                 "custom_reward_function.name=distinct_words", f"trainer.device={device}"]
    cfg = load_config(None, overrides)
    worker = ActorRolloutRefWorker(to_dict(cfg), 0, 1, *distributed.local_meeting_point(), device, total_steps=2)
    batch = reference_step.rollout_batch(worker, cfg)
    metrics, _ = worker.update_actor(batch, mini_rows=batch["responses"].shape[0])
    row = {"lora_rank": rank,
           "trainable_params": sum(p.numel() for p in worker.actor.parameters() if p.requires_grad),
           "total_params": sum(p.numel() for p in worker.actor.parameters()),
           "grad_norm": metrics["actor/grad_norm"]}
    if device == "cuda":
        torch.cuda.synchronize()
        row["allocated_between_steps_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        row.update({k.removeprefix("perf/"): round(v, 2) for k, v in metrics.items() if k.startswith("perf/")})
    worker.shutdown()
    del worker, batch
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="lora-memory-"))
    model_dir = grpo_step.build_model(args.tokenizer, work / "model", small=args.small)
    prompts = grpo_step.write_prompts(trl_grpo.random_prompts(16), work / "prompts.parquet")
    rows = []
    for rank in [0, *args.ranks]:
        rows.append(measure(model_dir, prompts, rank, device, args.small))
        print(json.dumps(rows[-1]), flush=True)  # each row as soon as it is measured
    keys = ["lora_rank", "trainable_params", "allocated_between_steps_gib", "max_memory_allocated_gb",
            "max_memory_reserved_gb", "max_memory_allocated_gb/update_actor", "max_memory_allocated_gb/gen"]
    print("| " + " | ".join(keys) + " |")
    for row in rows:
        print("| " + " | ".join(str(row.get(k)) for k in keys) + " |")
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "workload": "Qwen3-0.6B architecture, 16 prompts x 8 x 256 tokens, micro-batch 32, KL to the reference",
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
