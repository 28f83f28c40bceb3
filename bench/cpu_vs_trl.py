"""Our engine against TRL's GRPOTrainer on this CPU, on the same settings: the ratio of median step times
over repeated runs of each (a fresh process state per run: each run loads the model and trains anew).

    pip install -e '.[bench]'
    python bench/cpu_vs_trl.py --runs 5 --steps 2                    # tiny-qwen3 and the default SmolLM2 config
    python bench/cpu_vs_trl.py --runs 1 --steps 2 --models tiny-qwen3   # a quick check

Settings, from configs/default.yaml for both: 4 arithmetic prompts x 4 samples, at most 64 new tokens (EOS
allowed), KL (k3, 0.001) to a reference, lr 2e-6, micro-batches of 8, one optimizer step a step, and the
same precision: where our engine computes in bf16 (param_dtype auto on a CPU with bf16 matrix instructions)
TRL runs its own default there, bf16 autocast over fp32 weights; elsewhere both run fp32. Each framework
keeps its own defaults otherwise (TRL: gradient checkpointing on; ours: off). In a run the first step is a
warm-up; a run's number is its median counted step. Run i of ours is followed by run i of TRL, a pair; the
table gives the median over runs of each, and the median and spread of the pairs' ratios. Appends to
bench/results/<date>-cpu-vs-trl.json, with each run's phases.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import engine_step  # noqa: E402
import trl_grpo  # noqa: E402

from backend.core.config import load_config  # noqa: E402
from backend.core.models import resolve_model  # noqa: E402
from backend.engine.distributed import param_dtype  # noqa: E402

CONFIG = "configs/default.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="steps per run, the first a warm-up")
    p.add_argument("--models", nargs="+", default=["tiny-qwen3", "smollm2-135m-instruct"])
    p.add_argument("--out", default=str(BENCH / "results" / f"{time.strftime('%Y-%m-%d')}-cpu-vs-trl.json"))
    args = p.parse_args()

    results = []
    for model in args.models:
        overrides = [f"actor_rollout_ref.model.path={model}"]
        cfg = load_config(CONFIG, overrides)
        arr = cfg.actor_rollout_ref
        prompts = trl_grpo.parquet_prompts(cfg.data.train_files[0], cfg.data.train_batch_size)
        bf16 = param_dtype(arr.actor.fsdp_config.param_dtype, torch.device("cpu")) == torch.bfloat16
        ours, trl, ours_phases, trl_phases = [], [], [], []
        for run in range(args.runs):
            row = engine_step.measure(CONFIG, overrides, args.steps, f"ours {model} run {run + 1}")
            ours.append(row["median_step_s"])
            ours_phases.append({k: v for k, v in row.items() if k.startswith("median_")})
            got = trl_grpo.run_trl(resolve_model(model), prompts, steps=args.steps, num_generations=arr.rollout.n,
                                   max_completion_length=cfg.data.max_response_length, force_length=False,
                                   beta=arr.actor.kl_loss_coef, lr=arr.actor.optim.lr,
                                   micro_batch=arr.actor.ppo_micro_batch_size_per_gpu,
                                   temperature=arr.rollout.temperature, device="cpu", bf16=bf16)
            trl.append(got["median"]["step"])
            trl_phases.append(got["median"])
            print(f"{model} run {run + 1}: ours {ours[-1]:.2f} s, TRL {trl[-1]:.2f} s a step", flush=True)
        pairs = [t / o for o, t in zip(ours, trl, strict=True)]
        results.append({"model": model, "runs": args.runs, "steps_per_run": args.steps,
                        "precision": "bf16 mixed" if bf16 else "fp32",
                        "ours_step_s": ours, "trl_step_s": trl, "ours_phases": ours_phases, "trl_phases": trl_phases,
                        "ours_median_s": statistics.median(ours), "trl_median_s": statistics.median(trl),
                        "pair_ratios": [round(r, 2) for r in pairs],
                        "trl_over_ours": round(statistics.median(pairs), 2)})

    print(f"\n| {'model':<24} | {'precision':<10} | {'ours (s)':>9} | {'TRL (s)':>9} | {'TRL / ours, pairs':>22} |")
    for r in results:
        spread = f"{r['trl_over_ours']} ({min(r['pair_ratios'])}-{max(r['pair_ratios'])})"
        print(f"| {r['model']:<24} | {r['precision']:<10} | {r['ours_median_s']:>9.2f} | {r['trl_median_s']:>9.2f} "
              f"| {spread:>22} |")
    out = Path(args.out)
    engine_step.append_record(out, {"settings": f"{CONFIG} defaults", "results": results})


if __name__ == "__main__":
    main()
