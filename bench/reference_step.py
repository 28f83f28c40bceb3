"""Our first GRPO step against a straightforward fp32 implementation of the same step.

The worker (FSDP2, chunked log-probs, bf16 compute on a GPU, compiled layers) generates a batch and takes
its first update; the reference recomputes that update on the same batch with a plain Hugging Face model
in fp32: full log-softmax, ratio, token-mean policy loss, k3 KL to a frozen copy, one backward, the total
gradient norm. Policy loss, KL and gradient norm must agree (fp32: 1e-4 relative; bf16: 5e-2).

    python bench/reference_step.py configs/default.yaml [key=value ...] --device cuda --json out.json

Responses run to full length (rollout.ignore_eos), so every row has as many tokens and the worker's
micro-batch means equal the reference's mean over the whole batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.algos.losses import kl_penalty
from backend.core.config import Config, load_config, to_dict  # noqa: E402
from backend.core.data import PromptDataset, load_many  # noqa: E402
from backend.core.models import load_model  # noqa: E402
from backend.engine import distributed  # noqa: E402
from backend.engine.workers import ActorRolloutRefWorker  # noqa: E402
from backend.rollout.base import SamplingParams, left_pad  # noqa: E402


def rollout_batch(worker: ActorRolloutRefWorker, cfg: Config, ignore_eos: bool = True) -> dict[str, torch.Tensor]:
    """The first train_batch_size prompts of the train file, rollout.n responses each (to full length, or
    to EOS without `ignore_eos`), with fixed random advantages (one per response) and the reference's
    log-probs."""
    arr = cfg.actor_rollout_ref
    data = PromptDataset(load_many(cfg.data.train_files), worker.tokenizer, cfg.data.max_prompt_length,
                         filter_overlong_prompts=True)
    prompts = [data[i]["prompt_ids"] for i in range(cfg.data.train_batch_size)]
    params = SamplingParams(n=arr.rollout.n, temperature=arr.rollout.temperature,
                            max_new_tokens=cfg.data.max_response_length, seed=cfg.trainer.seed, ignore_eos=ignore_eos)
    out = worker.generate(prompts, params, first_row=0)
    rows = [p for p in prompts for _ in range(arr.rollout.n)]
    prompt_ids, prompt_mask = left_pad(rows, worker.tokenizer.pad_token_id)
    batch = {"input_ids": torch.cat([prompt_ids, out["responses"]], 1),
             "attention_mask": torch.cat([prompt_mask, out["response_mask"]], 1),
             "responses": out["responses"], "response_mask": out["response_mask"]}
    generator = torch.Generator().manual_seed(0)
    rows = batch["responses"].shape[0]
    batch["advantages"] = torch.randn(rows, 1, generator=generator) * batch["response_mask"]
    batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
    return batch


def reference_step(model_path: str, batch: dict[str, torch.Tensor], cfg: Config, device: torch.device,
                   micro: int = 16) -> dict[str, float]:
    """pg_loss, kl_loss and the gradient norm of one GRPO step, the plain way, in fp32."""
    a = cfg.actor_rollout_ref.actor
    policy = load_model(model_path, device).train()
    frozen = load_model(model_path, device).eval().requires_grad_(False)
    r = batch["responses"].shape[1]
    tokens = batch["response_mask"].sum()
    pg_total = kl_total = 0.0
    temperature = cfg.actor_rollout_ref.rollout.temperature

    def log_probs(model, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        positions = (mb["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                       position_ids=positions).logits[:, -r - 1:-1].float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)

    for start in range(0, batch["responses"].shape[0], micro):
        mb = {k: v[start:start + micro].to(device) for k, v in batch.items()}
        mask = mb["response_mask"].float()
        lp = log_probs(policy, mb)
        with torch.no_grad():
            ref = log_probs(frozen, mb)
        ratio = torch.exp(lp - lp.detach())
        pg = (-mb["advantages"] * ratio * mask).sum() / tokens
        kl = kl_penalty(lp, ref, a.kl_loss_type)
        kl_loss = (kl * mask).sum() / tokens
        (pg + a.kl_loss_coef * kl_loss).backward()
        pg_total += pg.item()
        kl_total += kl_loss.item()
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in policy.parameters() if p.grad is not None))
    return {"actor/pg_loss": pg_total, "actor/kl_loss": kl_total, "actor/grad_norm": grad_norm.item()}


def compare_first_step(cfg: Config, device: str) -> dict:
    """Run our worker's first update and the fp32 reference on the same batch; return both and whether
    they agree within the tolerance of the worker's compute dtype."""
    worker = ActorRolloutRefWorker(to_dict(cfg), 0, 1, *distributed.local_meeting_point(), device, total_steps=1)
    try:
        batch = rollout_batch(worker, cfg)
        rows = batch["responses"].shape[0]
        ours, _ = worker.update_actor(batch, mini_rows=rows)
        compute_dtype = str(worker.ref.model.embed_tokens.weight.dtype)  # the reference is stored in it
    finally:
        worker.shutdown()
    ref = reference_step(cfg.actor_rollout_ref.model.path, batch, cfg, worker.device)
    rel = 5e-2 if "bfloat16" in compute_dtype else 1e-4
    rows_out = {}
    ok = True
    for key, expected in ref.items():
        got = ours[key]
        agree = abs(got - expected) <= rel * max(abs(expected), 1e-3)
        ok &= agree
        rows_out[key] = {"ours": got, "fp32 reference": expected, "agree": agree}
    return {"compute_dtype": compute_dtype, "relative_tolerance": rel, "metrics": rows_out, "agree": ok}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_intermixed_args()
    result = compare_first_step(load_config(args.config, args.overrides), args.device)
    print(f"| {'metric':<16} | {'ours':>14} | {'fp32 reference':>14} | agree |")
    for key, row in result["metrics"].items():
        print(f"| {key:<16} | {row['ours']:>14.6g} | {row['fp32 reference']:>14.6g} | {row['agree']!s:>5} |")
    print(f"compute dtype {result['compute_dtype']}, relative tolerance {result['relative_tolerance']}: "
          f"{'agree' if result['agree'] else 'DISAGREE'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["agree"] else 1)


if __name__ == "__main__":
    main()
