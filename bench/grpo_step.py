"""The performance workload, our engine against TRL's GRPOTrainer in one call, on one GPU.

Workload: Qwen3-0.6B's architecture with random weights (bf16 compute), the SmolLM2 tokenizer, 64 distinct
plain-text prompts of about 8 tokens x 8 samples = 512 responses, each exactly 256 new tokens (EOS
ignored), KL loss (k3, coefficient 0.04) against a reference model, one optimizer step per batch, lr 1e-6.
The first step of each is a warm-up and is not counted.

    python bench/grpo_step.py --tokenizer .tok --steps 4            # GPU machine; TRL wheels installed
    python bench/grpo_step.py --tokenizer ../shared/models/smollm2-tokenizer --small --skip-trl   # CPU check
    python bench/grpo_step.py --realistic --steps 4                 # SmolLM2-135M-Instruct on arithmetic
    python bench/grpo_step.py --tokenizer .tok --steps 4 --rollout vllm   # the same workload, vLLM generating
    python bench/grpo_step.py --tokenizer .tok --arch qwen3-8b --lora-rank 16 --steps 2 --micro-batch 16 \
        --trl-micro-batch 32                                         # ten times larger, LoRA on both sides

--arch qwen3-8b: the same workload on Qwen3-8B's architecture (random bf16 weights, made on the GPU). Full
fine-tuning does not fit one H200 (`python -m backend plan` says what does); --lora-rank gives both engines
adapters of that rank on every linear layer but the head (TRL through PEFT, which the workbench installs for
its own LoRA).

--realistic: the realistic row: SmolLM2-135M-Instruct with its real weights on the arithmetic
sample set (chat-templated prompts), responses end at EOS (at most 256 tokens), same algorithm settings.

--rollout: our rollout engine (actor_rollout_ref.rollout.name): auto (the default: the workbench engine here),
workbench, hf, or vllm (pip install 'grpo-workbench[vllm]'; vLLM takes rollout.gpu_memory_utilization of the GPU,
0.5 unless overridden). The table's column and the JSON row are labelled with it.

Prints one table (ours, TRL, ratio) and appends both rows to bench/results/<date>-<gpu>.json.
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
import trl_grpo  # noqa: E402

PROMPTS, SAMPLES, RESPONSE = 64, 8, 256
ARCHITECTURES = {
    "qwen3-0.6b": engine_step.QWEN3_06B,
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1e6, max_position_embeddings=40960),
}
KL_COEF, LR = 0.04, 1e-6
H200_BF16_FLOPS = 989e12  # dense bf16 peak of the spec sheet; MFU is quoted against it


def build_model(tokenizer_dir: str, out: Path, small: bool, chat_template: bool = False,
                arch: str = "qwen3-0.6b") -> Path:
    """The random Qwen3 model, saved with a tokenizer whose chat template is removed: both engines then
    see the same plain-text prompts of about 8 tokens, as the workload says. `chat_template` keeps it (the
    multi-turn benchmark renders episodes with it). The 8B one is made in bf16 on the GPU where there is one
    (fp32 on the host would take 33 GB and minutes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not chat_template:
        tokenizer.chat_template = None
    dims = dict(ARCHITECTURES[arch])
    if small:
        dims.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=len(tokenizer))
    config = Qwen3Config(**dims, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    large = arch != "qwen3-0.6b" and not small
    with torch.device("cuda" if large and torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if large else torch.float32)
    model.save_pretrained(out)
    del model
    tokenizer.save_pretrained(out)
    if not chat_template:
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def write_prompts(prompts: list[str], out: Path) -> Path:
    """The prompts as verl rows (one user message each; the reward below ignores the ground truth)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "bench", "prompt": [{"role": "user", "content": p}], "ability": "bench",
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def update_flops(params: int, embedding: int, rows: int, tokens_per_row: int, response: int) -> float:
    """Matmul FLOPs of the update: 6 per parameter per token through the decoder (forward and backward),
    and 6 per output-layer weight for each position that gets logits (the response's)."""
    return 6.0 * (params - embedding) * rows * tokens_per_row + 6.0 * embedding * rows * (response + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="tokenizer folder for the random workload model")
    p.add_argument("--realistic", action="store_true", help="SmolLM2-135M-Instruct on the arithmetic set")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=64,
                   help="our responses per forward/backward (at most a step's responses)")
    p.add_argument("--activation-memory-budget", type=float, default=0.7,
                   help="our actor.activation_memory_budget: what keeps micro-batches of 64 within 40 GiB")
    p.add_argument("--trl-micro-batch", type=int, default=64)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--rollout", default="auto", choices=("auto", "workbench", "hf", "vllm"),
                   help="our rollout engine (actor_rollout_ref.rollout.name)")
    p.add_argument("--arch", default="qwen3-0.6b", choices=sorted(ARCHITECTURES),
                   help="the random model's architecture (not with --realistic)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank for both engines")
    p.add_argument("--small", action="store_true", help="a 2-layer model and 4 x 4 x 16: checks the script on CPU")
    p.add_argument("--out", default=None)
    p.add_argument("--write-workload", metavar="DIR", default=None,
                   help="only write the workload model (DIR/model) and prompts (DIR/prompts.parquet)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for our engine")
    args = p.parse_intermixed_args()
    if args.write_workload:
        folder = Path(args.write_workload)
        build_model(args.tokenizer, folder / "model", args.small)
        write_prompts(trl_grpo.random_prompts(PROMPTS), folder / "prompts.parquet")
        return

    prompts_n, samples, response = (4, 4, 16) if args.small else (PROMPTS, SAMPLES, RESPONSE)
    work = Path(tempfile.mkdtemp(prefix="grpo-step-"))
    rows = prompts_n * samples
    if args.realistic:
        from backend.core.models import resolve_model

        model_dir = Path(resolve_model("smollm2-135m-instruct"))
        data = REPO / "sample_data/arithmetic_train.parquet"
        prompts = trl_grpo.parquet_prompts(data, prompts_n)
        task = ["data.max_prompt_length=128"]
        label = "SmolLM2-135M-Instruct, arithmetic, EOS allowed"
    else:
        model_dir = build_model(args.tokenizer, work / "model", args.small, arch=args.arch)
        prompts = trl_grpo.random_prompts(prompts_n)
        data = write_prompts(prompts, work / "prompts.parquet")
        task = ["data.max_prompt_length=16", "actor_rollout_ref.rollout.ignore_eos=true",
                f"custom_reward_function.path={BENCH / 'bench_reward.py'}",
                "custom_reward_function.name=distinct_words"]
        label = f"{args.arch} architecture (random)" if not args.small else "2-layer qwen3 (random)"
    if args.lora_rank:
        label += f", LoRA rank {args.lora_rank}"
    ours_overrides = task + [
        f"data.train_files=[{data}]", f"data.train_batch_size={prompts_n}",
        f"data.max_response_length={response}", f"actor_rollout_ref.rollout.n={samples}",
        f"actor_rollout_ref.rollout.generation_batch_size={rows}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_n}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(args.micro_batch, rows)}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={min(args.micro_batch * 2, rows)}",
        f"actor_rollout_ref.actor.activation_memory_budget={args.activation_memory_budget}",
        "actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "trainer.logger=[console]", f"actor_rollout_ref.rollout.name={args.rollout}",
        f"actor_rollout_ref.model.lora_rank={args.lora_rank}",
    ] + list(args.overrides)
    engine = f"ours ({args.rollout})"
    ours = engine_step.measure("configs/default.yaml", ours_overrides, args.steps, engine, model_dir, label)
    trl = None
    if not args.skip_trl:
        trl = trl_grpo.run_trl(str(model_dir), prompts, steps=args.steps, num_generations=samples,
                               max_completion_length=response, force_length=not args.realistic, beta=KL_COEF, lr=LR,
                               micro_batch=args.trl_micro_batch, lora_rank=args.lora_rank)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    # With EOS allowed the lengths vary, and LoRA skips most weight gradients: MFU is only given for full
    # fine-tuning on the fixed-length workload. An untied model's input embedding is a lookup, not a product.
    head = config.vocab_size * config.hidden_size
    flops = None if args.realistic or args.lora_rank else update_flops(
        n_params - (0 if config.tie_word_embeddings else head), head, rows, 8 + response, response)
    table = {
        "median step (s)": (ours["median_step_s"], trl and trl["median"]["step"]),
        "generate (s)": (ours["median_gen_s"], trl and trl["median"]["gen"]),
        "reference log-prob (s)": (ours["median_ref_s"], trl and trl["median"]["ref"]),
        "old log-prob (s)": (ours["median_old_log_prob_s"], trl and trl["median"]["old_log_prob"]),
        "update (s)": (ours["median_update_actor_s"], trl and trl["median"]["update"]),
        "other (s)": (round(ours["median_step_s"] - sum(ours[f"median_{k}_s"] or 0 for k in
                                                        ("gen", "ref", "old_log_prob", "update_actor")), 3),
                      trl and trl["median"]["other"]),
        "generated tokens/s": (ours["gen_tokens_per_s"], trl and trl["tokens_per_s"]),
        "update MFU (%)": (flops and round(100 * flops / ours["median_update_actor_s"] / H200_BF16_FLOPS, 1),
                           flops and trl and round(100 * flops / trl["median"]["update"] / H200_BF16_FLOPS, 1)),
        "peak allocated (GiB)": (ours.get("peak_allocated_gib"), trl and trl["peak_allocated_gb"]),
        "peak reserved (GiB)": (ours.get("peak_reserved_gib"), trl and trl["peak_reserved_gb"]),
    }
    w = max(10, len(engine))  # our column, headed by the engine
    print(f"\n| {'':<24} | {engine:>{w}} | {'TRL':>10} | {'TRL / ours':>10} |")
    print(f"|{'-' * 26}|{'-' * (w + 2)}|{'-' * 12}|{'-' * 12}|")
    for name, (a, b) in table.items():
        ratio = round(b / a, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
        print(f"| {name:<24} | {a!s:>{w}} | {b!s:>10} | {ratio!s:>10} |")
    print(f"our per-phase peaks: { {k: v for k, v in ours.items() if k.startswith('peak_')} }")

    device = torch.cuda.get_device_name().replace(" ", "-").lower() if torch.cuda.is_available() else "cpu"
    kind = "smollm2" if args.realistic else "grpo-step" + ("" if args.arch == "qwen3-0.6b" else f"-{args.arch}")
    out = Path(args.out) if args.out else BENCH / "results" / f"{time.strftime('%Y-%m-%d')}-{device}-{kind}.json"
    workload = {"label": label, "lora_rank": args.lora_rank, "prompts": prompts_n, "samples": samples,
                "response_tokens": response,
                "kl_coef": KL_COEF, "lr": LR, "our_micro_batch": min(args.micro_batch, rows),
                "our_activation_memory_budget": args.activation_memory_budget,
                "trl_micro_batch": args.trl_micro_batch, "update_flops": flops}
    engine_step.append_record(out, {"engine": engine, "workload": workload,
                                    "table": {k: list(v) for k, v in table.items()}, "ours": ours, "trl": trl})
    shutil.rmtree(work, ignore_errors=True)  # the workload model, 2.4 GB


if __name__ == "__main__":
    main()
