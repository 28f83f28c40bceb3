"""Time training steps of our engine for a config: median step and phase times, generation tokens/s,
peak GPU memory. Prints a table and writes the numbers to bench/results/<date>-<device>.json.

    python bench/engine_step.py configs/default.yaml --steps 4                      # CPU default config
    python bench/engine_step.py configs/default.yaml --steps 4 \\
        --random-model qwen3-0.6b --tokenizer ../shared/models/smollm2-tokenizer     # GPU, random Qwen3-0.6B

The first step is a warm-up and is not counted. Runs go through `Trainer`, as the CLI's do.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backend.core.config import load_config  # noqa: E402
from backend.core.runs import read_metrics  # noqa: E402
from backend.engine.trainer import Trainer  # noqa: E402

PHASES = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "weight_push", "step"]

# Qwen3-0.6B's architecture (the performance workload), with random weights.
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                 max_position_embeddings=40960)


def build_random_model(name: str, tokenizer_dir: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    assert name == "qwen3-0.6b", name
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(**QWEN3_06B, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def append_record(out: Path, record: dict) -> None:
    """Add one record to the JSON list in `out` (made, with its folder, when missing) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    records = json.loads(out.read_text()) if out.exists() else []
    records.append(record)
    out.write_text(json.dumps(records, indent=1))
    print(f"written to {out}")


def measure(config: str, overrides: list[str], steps: int, label: str = "", model_dir: Path | None = None,
            model_label: str = "") -> dict:
    """Train `steps` steps of `config` + overrides through `Trainer` and return the row of numbers:
    medians over the steps after the first, per-phase peak GPU memory, the first step's losses."""
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    full = list(overrides) + [f"trainer.total_training_steps={steps}", "trainer.save_freq=0", "trainer.test_freq=0",
                              "data.val_files=[]", "trainer.export_at_end=false", "trainer.max_checkpoints_to_keep=1"]
    if model_dir is not None:
        full.append(f"actor_rollout_ref.model.path={model_dir}")
    cfg = load_config(config, full)
    start = time.time()
    Trainer(cfg, work / "run", show_progress=True).train()
    wall = time.time() - start
    metrics = read_metrics(work / "run")
    # The run's last checkpoint (about 7 GB for the Qwen3-0.6B workload) is not needed: on the GPU machine's
    # 64 GB disk, nine benchmark runs left behind filled it.
    shutil.rmtree(work, ignore_errors=True)
    counted = metrics[1:]  # the first step is the warm-up
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}"
    row: dict = {
        "label": label or Path(config).stem,
        "model": model_label or cfg.actor_rollout_ref.model.path,
        "overrides": list(overrides), "device": device, "workers": cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes,
        "counted_steps": len(counted), "wall_s": round(wall, 1),
        "torch": torch.__version__, "python": platform.python_version(),
    }
    for phase in PHASES:
        values = [m.get(f"timing_s/{phase}", 0.0) for m in counted]
        row[f"median_{phase}_s"] = round(statistics.median(values), 3) if values else None
    gen_tokens = [m["response_length/mean"] * cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
                  for m in counted]
    row["gen_tokens_per_step"] = round(statistics.median(gen_tokens))
    # With trainer.rollout_mode=async, timing_s/gen is what the step waited for a batch generated meanwhile.
    row["gen_tokens_per_s"] = round(statistics.median(t / m["timing_s/gen"] for t, m in zip(gen_tokens, counted,
                                                                                          strict=True)), 1) \
        if cfg.trainer.rollout_mode == "colocated" else None
    row["step_times_s"] = [round(m["timing_s/step"], 2) for m in counted]
    # Each counted step's phases: which phase a slow step lost its time in (the medians cannot say).
    row["step_phases_s"] = [{p: round(m[f"timing_s/{p}"], 3) for p in PHASES if f"timing_s/{p}" in m} for m in counted]
    # Each worker reports its own peak per phase and step; the busiest GPU of the busiest step is what must fit.
    peak_keys = sorted({k for m in metrics for k in m if k.startswith("perf/max_memory_")})
    for key in peak_keys:
        name = key.removeprefix("perf/max_memory_").replace("_gb", "_gib")
        row[f"peak_{name}"] = round(max(m[key] for m in metrics if key in m), 2)
    # The first step (warm-up included) from the same seed: what runs on 1 and N GPUs should agree on.
    row["first_step"] = {k: metrics[0].get(k) for k in ("critic/score/mean", "response_length/mean", "actor/pg_loss",
                                                         "actor/kl_loss", "actor/entropy", "actor/grad_norm")}
    # A rollout engine with its own log-probs (vllm): how far they are from the trainer's, each step.
    for key in ("rollout/log_prob_diff_mean", "rollout/is_weight_mean", "rollout/is_weight_max", "rollout/is_clipfrac",
                "rollout/staleness"):
        if any(key in m for m in metrics):
            row[key] = [m.get(key) for m in metrics]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--random-model", default=None, help="qwen3-0.6b: build that architecture with random weights")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for --random-model")
    p.add_argument("--label", default="", help="name of this row in the results file")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/<date>-<device>.json)")
    args = p.parse_intermixed_args()
    model_dir = None
    if args.random_model:
        model_dir = build_random_model(args.random_model, args.tokenizer,
                                       Path(tempfile.mkdtemp(prefix="bench-model-")) / args.random_model)
    row = measure(args.config, args.overrides, args.steps, args.label, model_dir,
                  f"{args.random_model} (random)" if args.random_model else "")
    if model_dir is not None:
        shutil.rmtree(model_dir.parent, ignore_errors=True)
    print()
    print(f"| {'quantity':<24} | {'value':>14} |")
    print(f"|{'-' * 26}|{'-' * 16}|")
    for key, value in row.items():
        if key not in ("overrides", "step_times_s", "step_phases_s", "first_step"):
            print(f"| {key:<24} | {value!s:>14} |")
    print(f"step times (s): {row['step_times_s']}")
    print(f"first step: {row['first_step']}")

    out = Path(args.out) if args.out else REPO / "bench/results" / (
        f"{time.strftime('%Y-%m-%d')}-{'gpu' if torch.cuda.is_available() else 'cpu'}.json")
    append_record(out, row)


if __name__ == "__main__":
    main()
