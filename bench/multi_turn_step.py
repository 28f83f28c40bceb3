"""What multi-turn episodes cost: the same total tokens after the prompt, in one turn or in several turns with
an environment's message between them, timed through `Trainer` in one call.

Workload: Qwen3-0.6B's architecture with random weights (bf16 compute), the SmolLM2 tokenizer with its chat
template, 64 prompts x 8 samples = 512 episodes, KL loss (k3, 0.04), one optimizer step per batch, EOS ignored.
Single-turn: each response is R tokens. Multi-turn: `--turns` assistant turns of T tokens with a fixed user
message (L tokens as the template renders it) after each but the last, T chosen so that turns x T +
(turns - 1) x L <= R, and the single-turn response is made exactly as long. The first step of each is a warm-up.

    python bench/multi_turn_step.py --tokenizer .tok --turns 4               # GPU machine
    python bench/multi_turn_step.py --tokenizer ../shared/models/smollm2-tokenizer --small --turns 2   # CPU check

Prints one table (single-turn, multi-turn, ratio) and appends the rows to
bench/results/<date>-<device>-multi-turn.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

import engine_step  # noqa: E402
import grpo_step  # noqa: E402
import trl_grpo  # noqa: E402
from bench_environment import REPLY  # noqa: E402

from backend.core.models import load_tokenizer  # noqa: E402
from backend.rollout.episodes import ChatRenderer  # noqa: E402

PROMPTS, SAMPLES, RESPONSE = 64, 8, 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (with a chat template)")
    p.add_argument("--turns", type=int, default=4, help="assistant turns of an episode (2-4)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--rollout", default="auto", choices=("auto", "workbench", "hf", "vllm"))
    p.add_argument("--small", action="store_true", help="a 2-layer model and 4 x 4 x 32: checks the script on CPU")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for both workloads")
    args = p.parse_intermixed_args()

    prompts_n, samples, response = (4, 4, 32) if args.small else (PROMPTS, SAMPLES, RESPONSE)
    work = Path(tempfile.mkdtemp(prefix="multi-turn-step-"))
    model_dir = grpo_step.build_model(args.tokenizer, work / "model", args.small, chat_template=True)
    data = grpo_step.write_prompts(trl_grpo.random_prompts(prompts_n), work / "prompts.parquet")
    tokenizer = load_tokenizer(str(model_dir))
    observation = len(ChatRenderer(tokenizer, [], [tokenizer.eos_token_id]).observation(REPLY))
    per_turn = (response - (args.turns - 1) * observation) // args.turns
    total = args.turns * per_turn + (args.turns - 1) * observation
    rows = prompts_n * samples
    common = [
        f"data.train_files=[{data}]", f"data.train_batch_size={prompts_n}", "data.max_prompt_length=64",
        f"data.max_response_length={total}", f"actor_rollout_ref.rollout.n={samples}",
        "actor_rollout_ref.rollout.ignore_eos=true", f"actor_rollout_ref.rollout.generation_batch_size={rows}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_n}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(args.micro_batch, rows)}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={min(args.micro_batch * 2, rows)}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.04",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"custom_reward_function.path={BENCH / 'bench_reward.py'}", "custom_reward_function.name=distinct_words",
        "trainer.logger=[console]", f"actor_rollout_ref.rollout.name={args.rollout}", *args.overrides]
    multi = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.environment={BENCH / 'bench_environment.py'}:FixedReply",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={args.turns}",
        f"actor_rollout_ref.rollout.multi_turn.max_user_turns={args.turns - 1}",
        f"actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn={per_turn}"]
    label = "qwen3-0.6b architecture (random)" if not args.small else "2-layer qwen3 (random)"
    single_row = engine_step.measure("configs/default.yaml", common, args.steps, "single-turn", model_dir, label)
    rows_out = {"single-turn": single_row, f"{args.turns} turns": engine_step.measure(
        "configs/default.yaml", common + multi, args.steps, f"{args.turns} turns", model_dir, label)}
    table = {}
    for name, key in (("median step (s)", "median_step_s"), ("generate (s)", "median_gen_s"),
                      ("reference log-prob (s)", "median_ref_s"), ("old log-prob (s)", "median_old_log_prob_s"),
                      ("update (s)", "median_update_actor_s")):
        table[name] = [r[key] for r in rows_out.values()]
    tokens = rows * total
    table["tokens after the prompt / s"] = [round(tokens / r["median_step_s"], 1) for r in rows_out.values()]
    print(f"\n{args.turns} turns of {per_turn} tokens with {args.turns - 1} messages of {observation} tokens = "
          f"{total} tokens after the prompt, against one turn of {total}; {rows} episodes a step")
    w = max(len(n) for n in rows_out)
    print("| " + " | ".join([f"{'':<28}", *(f"{n:>{w}}" for n in rows_out)]) + " |")
    for name, values in table.items():
        print("| " + " | ".join([f"{name:<28}", *(f"{v!s:>{w}}" for v in values)]) + " |")
    overhead = {n: round(r["median_step_s"] / single_row["median_step_s"] - 1, 3) for n, r in rows_out.items()
                if n != "single-turn"}
    for name, value in overhead.items():
        print(f"overhead of {name} on the single-turn step: {100 * value:.1f}%")

    device = torch.cuda.get_device_name().replace(" ", "-").lower() if torch.cuda.is_available() else "cpu"
    out = Path(args.out) if args.out else BENCH / "results" / f"{time.strftime('%Y-%m-%d')}-{device}-multi-turn.json"
    workload = {"label": label, "prompts": prompts_n, "samples": samples, "turns": args.turns,
                "tokens_per_turn": per_turn, "observation_tokens": observation, "tokens_after_prompt": total,
                "rollout": args.rollout}
    engine_step.append_record(out, {"workload": workload, "columns": list(rows_out), "table": table,
                                    "overhead": overhead, "rows": rows_out})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
