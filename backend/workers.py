"""The actor (policy being trained) and the reference (frozen start point), as workers.

The trainer talks to them only through methods that take and return dicts of tensors
(`compute_log_prob`, `compute_ref_log_prob`, `update_actor`, `save_checkpoint`, ...), so moving
them into separate processes changes how they are called, not what they do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from backend import algos
from backend.config import Config
from backend.models import amp_context, load_model

Batch = dict[str, torch.Tensor]


def response_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                       temperature: float = 1.0, with_entropy: bool = False,
                       entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under `model`, and optionally the entropy of each position.

    input_ids, attention_mask: (b, P + R), the last R positions are the response.
    Returns log_probs (b, R) and entropy (b, R) or None; the entropy carries a gradient only when
    entropy_grad is set (an entropy bonus), since its graph is as large as the logits'.
    Only the R positions that predict response tokens get vocabulary-sized logits (`logits_to_keep`),
    and logits are divided by the sampling temperature so the ratio matches the sampling distribution.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=response_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :].float() / temperature  # (b, R, V): position t predicts token t+1
    targets = input_ids[:, -response_len:]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = algos.entropy_from_logits(logits)
    return log_probs, entropy


def _micro_batches(batch: Batch, size: int):
    n = next(iter(batch.values())).shape[0]
    for start in range(0, n, size):
        yield {k: v[start:start + size] for k, v in batch.items()}


def _lr_lambda(warmup: int, total: int, style: str, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if style == "cosine" and total > warmup:
            progress = min((step - warmup) / (total - warmup), 1.0)
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return f


class RefWorker:
    """A frozen copy of the starting policy; its log-probs anchor the KL term."""

    def __init__(self, cfg: Config, device: torch.device):
        # Same weights and precision as the actor, so the KL is exactly 0 before the first update.
        self.model = load_model(cfg.actor_rollout_ref.model.path, device).eval().requires_grad_(False)
        self.micro = cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        self.temperature = cfg.actor_rollout_ref.rollout.temperature
        self.device = device

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        """(B, R) log-probs of the responses under the reference model."""
        response_len = batch["responses"].shape[1]
        with amp_context(self.device):
            parts = [response_log_probs(self.model, mb["input_ids"].to(self.device),
                                        mb["attention_mask"].to(self.device), response_len, self.temperature)[0]
                     for mb in _micro_batches(batch, self.micro)]
        return torch.cat(parts).cpu()


class ActorWorker:
    """The policy: computes log-probs, runs the PPO-clip update, saves and restores itself."""

    def __init__(self, cfg: Config, device: torch.device, total_steps: int):
        arr = cfg.actor_rollout_ref
        self.cfg = cfg
        self.device = device
        self.model = load_model(arr.model.path, device)  # fp32 master weights; bf16 compute on GPU
        if arr.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        opt = arr.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                           weight_decay=opt.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(opt.lr_warmup_steps, total_steps, opt.warmup_style, opt.min_lr_ratio))
        self.temperature = arr.rollout.temperature
        a = arr.actor
        self.clip_low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
        self.clip_high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, R) log-probs of the responses under the current policy, and the entropy per position."""
        self.model.eval()
        response_len = batch["responses"].shape[1]
        micro = self.cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        lps, ents = [], []
        for mb in _micro_batches(batch, micro):
            with amp_context(self.device):
                lp, ent = response_log_probs(self.model, mb["input_ids"].to(self.device),
                                             mb["attention_mask"].to(self.device), response_len,
                                             self.temperature, with_entropy=True)
            lps.append(lp.cpu())
            ents.append(ent.cpu())
        self.model.train()
        return torch.cat(lps), torch.cat(ents)

    def update_actor(self, batch: Batch, generator: torch.Generator | None = None, progress=None) -> dict[str, float]:
        """PPO-clip update over mini-batches and micro-batches; returns the actor/* metrics.

        batch holds input_ids, attention_mask, responses, response_mask, advantages and, when the
        step takes more than one optimizer step, old_log_probs; ref_log_probs when the KL loss is on.
        Without old_log_probs the update is on-policy: the ratio is exactly 1 and only its gradient counts.
        """
        a = self.cfg.actor_rollout_ref.actor
        n = self.cfg.actor_rollout_ref.rollout.n
        mini_size = a.ppo_mini_batch_size * n
        micro_size = a.ppo_micro_batch_size_per_gpu
        total = batch["responses"].shape[0]
        response_len = batch["responses"].shape[1]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def add(name: str, value: float) -> None:
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1

        n_minis = total // mini_size
        n_micro_total = a.ppo_epochs * n_minis * (mini_size // micro_size)
        done = 0
        skipped = 0
        for _ in range(a.ppo_epochs):
            order = torch.randperm(total, generator=generator) if a.shuffle else torch.arange(total)
            for m in range(n_minis):
                mini = {k: v[order[m * mini_size:(m + 1) * mini_size]] for k, v in batch.items()}
                self.optimizer.zero_grad(set_to_none=True)
                for mb in _micro_batches(mini, micro_size):
                    mb = {k: v.to(self.device) for k, v in mb.items()}
                    mask = mb["response_mask"].float()
                    with amp_context(self.device):
                        log_probs, entropy = response_log_probs(
                            self.model, mb["input_ids"], mb["attention_mask"], response_len, self.temperature,
                            with_entropy=True, entropy_grad=a.entropy_coeff > 0)
                    old = mb.get("old_log_probs", log_probs.detach())
                    pg_loss, pg_metrics = algos.compute_policy_loss(
                        old, log_probs, mb["advantages"], mask, clip_ratio_low=self.clip_low,
                        clip_ratio_high=self.clip_high, clip_ratio_c=a.clip_ratio_c,
                        loss_agg_mode=a.loss_agg_mode)
                    loss = pg_loss
                    entropy_loss = algos.agg_loss(entropy, mask, a.loss_agg_mode)
                    if a.entropy_coeff:
                        loss = loss - a.entropy_coeff * entropy_loss
                    if a.use_kl_loss:
                        kl = algos.kl_penalty(log_probs, mb["ref_log_probs"], a.kl_loss_type)
                        kl_loss = algos.agg_loss(kl, mask, a.loss_agg_mode)
                        loss = loss + a.kl_loss_coef * kl_loss
                        add("actor/kl_loss", kl_loss.item())
                        add("actor/kl_coef", a.kl_loss_coef)
                    # Each micro-batch's mean is weighted by its share of the mini-batch, so the
                    # accumulated gradient is that of the mini-batch's mean loss.
                    (loss * mb["responses"].shape[0] / mini_size).backward()
                    add("actor/pg_loss", pg_loss.item())
                    add("actor/entropy", entropy_loss.item())
                    for k, v in pg_metrics.items():
                        add(k, v)
                    done += 1
                    if progress is not None:
                        progress(done, n_micro_total)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                add("actor/grad_norm", grad_norm.item())
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        metrics = {k: sums[k] / counts[k] for k in sums}
        metrics["actor/lr"] = lr
        metrics["actor/skipped_steps"] = float(skipped)
        return metrics

    # ---- checkpoints ----

    def save_checkpoint(self, folder: Path) -> None:
        """Weights as a Hugging Face folder (loadable as a model on its own), plus optimizer and scheduler."""
        self.model.save_pretrained(folder)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   folder / "optim.pt")

    def load_checkpoint(self, folder: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for shard in sorted(folder.glob("*.safetensors")):
            state.update(load_file(shard, device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or any(k not in tied and "lm_head" not in k for k in missing):
            raise RuntimeError(f"checkpoint {folder} does not match the model: missing {missing}, "
                               f"unexpected {unexpected}")
        self.model.tie_weights()
        opt = torch.load(folder / "optim.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])

    def export(self, folder: Path, tokenizer) -> None:
        """A plain Hugging Face folder: `AutoModelForCausalLM.from_pretrained(folder)` loads it."""
        self.model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "grpo_workbench.json").write_text(json.dumps({"base_model": self.cfg.actor_rollout_ref.model.path}))
