"""The planner's memory prediction against the measured peak, for three configs that differ in batch and
length, on the performance workload's model (Qwen3-0.6B architecture, random weights) on this GPU.

    python bench/plan_check.py --tokenizer .tok --out bench/results/<date>-<gpu>-plan.json

Each config trains 2 steps through `Trainer`; the measured peak is the largest `perf/max_memory_*` a
worker reported. Prints predicted / measured per config and writes the pairs to the JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import engine_step  # noqa: E402
import grpo_step  # noqa: E402
import trl_grpo  # noqa: E402

from backend.core.config import load_config  # noqa: E402
from backend.services import planner  # noqa: E402

# (label, prompts per step, samples, response tokens, micro-batch, generation batch)
CONFIGS = [
    ("64 x 8 x 256, micro 32", 64, 8, 256, 32, 512),
    ("32 x 8 x 512, micro 16", 32, 8, 512, 16, 256),
    ("16 x 4 x 128, micro 64", 16, 4, 128, 64, 64),
]


def overrides(data: Path, prompts: int, samples: int, response: int, micro: int, gen_batch: int) -> list[str]:
    return [f"data.train_files=[{data}]", f"data.train_batch_size={prompts}", "data.max_prompt_length=16",
            f"data.max_response_length={response}", f"actor_rollout_ref.rollout.n={samples}",
            "actor_rollout_ref.rollout.ignore_eos=true", f"actor_rollout_ref.rollout.generation_batch_size={gen_batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro * 2}",
            f"custom_reward_function.path={BENCH / 'bench_reward.py'}", "custom_reward_function.name=distinct_words",
            "trainer.logger=[console]"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--small", action="store_true", help="a 2-layer model and short runs: checks the script on CPU")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    model = grpo_step.build_model(args.tokenizer, work / "model", small=args.small)
    data = grpo_step.write_prompts(trl_grpo.random_prompts(64), work / "prompts.parquet")
    pairs = []
    configs = [(label, 4, 2, 8, 4, 8) for label, *_ in CONFIGS[:1]] if args.small else CONFIGS
    for label, *shape in configs:
        extra = overrides(data, *shape)
        cfg = load_config("configs/default.yaml", extra + [f"actor_rollout_ref.model.path={model}"])
        predicted = planner.plan(cfg)
        row = engine_step.measure("configs/default.yaml", extra, 2, label, model)
        pair = {"config": label, "overrides": extra,
                "predicted_reserved_gib": round(predicted.need_gib, 2),
                "measured_reserved_gib": row.get("peak_reserved_gib"),
                "predicted_allocated_gib": {ph.name: round(ph.allocated_gib, 2) for ph in predicted.phases if ph.runs},
                "measured_allocated_gib": {k.removeprefix("peak_allocated_gib/"): v for k, v in row.items()
                                           if k.startswith("peak_allocated_gib/")},
                "predicted_step_s": predicted.step_seconds,
                "measured_step_s": row["median_step_s"]}
        measured = pair["measured_reserved_gib"]
        pair["error_pct"] = round(100 * (pair["predicted_reserved_gib"] - measured) / measured, 1) if measured else None
        pairs.append(pair)
    print(f"\n| {'config':<26} | {'predicted GiB':>13} | {'measured GiB':>12} | {'error %':>7} |")
    for pair in pairs:
        print(f"| {pair['config']:<26} | {pair['predicted_reserved_gib']:>13} | {pair['measured_reserved_gib']!s:>12} "
              f"| {pair['error_pct']!s:>7} |")
    for pair in pairs:
        print(pair["config"], "allocated by phase: predicted", pair["predicted_allocated_gib"],
              "measured", pair["measured_allocated_gib"])
    Path(args.out).write_text(json.dumps({"calibration": planner.CALIBRATION, "pairs": pairs}, indent=1))
    print(f"written to {args.out}")
    shutil.rmtree(work, ignore_errors=True)  # the workload model, 2.4 GB


if __name__ == "__main__":
    main()
