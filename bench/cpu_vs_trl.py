"""Our engine against TRL's GRPOTrainer on this CPU, on the same settings: the ratio of median step times
over repeated runs of each (a fresh process state per run: each run loads the model and trains anew).

    pip install -e '.[bench]'
    python bench/cpu_vs_trl.py --runs 5 --steps 2                    # tiny-qwen3 and the default SmolLM2 config
    python bench/cpu_vs_trl.py --runs 1 --steps 2 --models tiny-qwen3   # a quick check

Settings, from configs/default.yaml for both: 4 arithmetic prompts x 4 samples, at most 64 new tokens (EOS
allowed), KL (k3, 0.001) to a reference, lr 2e-6, micro-batches of 8, one optimizer step a step. Each
framework keeps its own defaults otherwise (TRL: gradient checkpointing on; ours: off). In a run the first
step is a warm-up; a run's number is its median counted step; the table gives the median over runs.
Appends to bench/results/<date>-cpu-vs-trl.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import engine_step  # noqa: E402
import trl_grpo  # noqa: E402

from backend.core.config import load_config  # noqa: E402
from backend.core.models import resolve_model  # noqa: E402

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
        ours, trl = [], []
        for run in range(args.runs):
            row = engine_step.measure(CONFIG, overrides, args.steps, f"ours {model} run {run + 1}")
            ours.append(row["median_step_s"])
            got = trl_grpo.run_trl(resolve_model(model), prompts, steps=args.steps, num_generations=arr.rollout.n,
                                   max_completion_length=cfg.data.max_response_length, force_length=False,
                                   beta=arr.actor.kl_loss_coef, lr=arr.actor.optim.lr,
                                   micro_batch=arr.actor.ppo_micro_batch_size_per_gpu,
                                   temperature=arr.rollout.temperature, device="cpu")
            trl.append(got["median"]["step"])
            print(f"{model} run {run + 1}: ours {ours[-1]:.2f} s, TRL {trl[-1]:.2f} s a step", flush=True)
        results.append({"model": model, "runs": args.runs, "steps_per_run": args.steps,
                        "ours_step_s": ours, "trl_step_s": trl,
                        "ours_median_s": statistics.median(ours), "trl_median_s": statistics.median(trl),
                        "trl_over_ours": round(statistics.median(trl) / statistics.median(ours), 2)})

    print(f"\n| {'model':<24} | {'ours (s)':>9} | {'TRL (s)':>9} | {'TRL / ours':>10} |")
    for r in results:
        print(f"| {r['model']:<24} | {r['ours_median_s']:>9.2f} | {r['trl_median_s']:>9.2f} "
              f"| {r['trl_over_ours']:>10} |")
    out = Path(args.out)
    engine_step.append_record(out, {"settings": f"{CONFIG} defaults", "results": results})


if __name__ == "__main__":
    main()
