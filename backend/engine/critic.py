"""The critic: one rank of PPO's value model V(s), FSDP2-sharded with its own optimizer, in a process
group of its own (verl's CriticWorker).

What it is for: an outcome reward arrives once, at the end of a response. GAE (gae_advantage)
spreads it over the tokens with a learned baseline, delta_t = r_t + gamma V(s_{t+1}) - V(s_t) and
A_t = sum_l (gamma lambda)^l delta_{t+l}, so it needs V of the state before every response token;
`compute_values` gives those. The critic then regresses V towards the returns GAE hands back (A + V)
with PPO's clipped value loss (`update_critic`). GRPO, RLOO and REINFORCE++ need none of this: their
baseline is the other responses to the same prompt.

The value model is the policy's transformer with a linear head of one output (`score`) in place of the
LM head: Hugging Face's AutoModelForTokenClassification with num_labels=1, loaded from a causal LM's
folder. The backbone starts from the LM's weights; the head is new, drawn from `seed` so every rank and
every restart agrees on it until a checkpoint restores the trained one.

Memory on each of W ranks, for a backbone of P parameters with L layers (bytes; GPU, bf16 compute):

    phase            at rest                              transient on top
    between calls    4P/W fp32 master shard               -
                     + 8P/W Adam moments (after the first update)
    values           same                                 2P/L per layer being computed, + activations
    update           same + 4P/W fp32 grad shard          2P/L per layer (forward and backward), + activations

Against the actor of the same size it saves the LM head where that is not tied to the embeddings, and
the vocabulary-sized logits: its output is (b, T, 1), so a long response costs activations only. It
generates nothing, so there is no gathered copy of the whole model and no KV cache. Where it shares
GPUs with the actor, its 12P/W at rest adds to the actor's; `offload_policy` keeps its shards, grads
and Adam moments in CPU memory instead (the optimizer then steps on the CPU).

Like the actor worker, it is a plain class that worker_group can run as a Ray actor: tensors in and out
on the CPU, and every method that runs the model is collective (all ranks, same number of rows).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from backend.algos.losses import compute_value_loss
from backend.core import checkpoint
from backend.core.models import ModelError, resolve_model
from backend.engine import distributed
from backend.engine.rank import (
    COMPILED_WIDTH_MULTIPLE,
    MicroBatches,
    PeakMemory,
    RankWorker,
    lr_lambda,
    micro_batches_on_ranks,
    step_counts,
    to_device,
)

Batch = dict[str, torch.Tensor]

REQUIRED_KEYS = ("model_path", "enable_gradient_checkpointing", "lr", "betas", "weight_decay", "grad_clip",
                 "cliprange_value", "ppo_micro_batch_size_per_gpu", "loss_agg_mode", "param_dtype",
                 "offload_policy", "use_torch_compile", "seed")
# The schedule is the actor's: constant after an optional linear warm-up, or cosine.
OPTIONAL_KEYS = {"lr_warmup_steps": 0, "warmup_style": "constant", "min_lr_ratio": 0.0, "loss_scale_factor": None,
                 "use_dynamic_bsz": False, "ppo_max_token_len_per_gpu": 32768}


def load_value_model(name_or_path: str, seed: int) -> torch.nn.Module:
    """A token-classification model with one output (V per position), fp32 on the CPU, from a causal LM
    (shipped name, folder, Hub id or a sharded run checkpoint) or from a value model saved earlier.

    A head the weights do not hold is drawn from `seed` (normal, std = config.initializer_range, bias 0,
    as Hugging Face would), with its own generator: the same head on every rank and every restart,
    whatever else has used the global RNG before.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    source = resolve_model(name_or_path)
    sharded = checkpoint.is_sharded(source)
    config = AutoConfig.from_pretrained(Path(source) / checkpoint.HF if sharded else source, num_labels=1)
    # Dropout in front of the head (0.1 by default) would make V noisy while training, and make the
    # values the update clips against differ from those it predicts for the same input.
    config.classifier_dropout = 0.0
    try:
        if sharded:
            model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
            missing, unexpected = model.load_state_dict(checkpoint.merged_state_dict(source), strict=False)
        else:
            model, info = AutoModelForTokenClassification.from_pretrained(
                source, config=config, dtype=torch.float32, output_loading_info=True)
            missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load critic model '{name_or_path}' ({source}) as a value model: {e}") from None
    # Most architectures call the head `score`; a few (GPT-2, BLOOM) call it `classifier`.
    head_name = next((n for n in ("score", "classifier") if isinstance(getattr(model, n, None), torch.nn.Linear)),
                     None)
    if head_name is None:
        raise ModelError(f"{type(model).__name__} has no linear value head (score or classifier)")
    head = getattr(model, head_name)
    missing_body = [k for k in missing if not k.startswith(f"{head_name}.")]
    if missing_body or any(not k.startswith("lm_head.") for k in unexpected):
        raise ModelError(f"the weights of '{name_or_path}' do not fit a value model of its config: missing "
                         f"{sorted(missing_body)}, unexpected {sorted(unexpected)}")
    if len(missing) > len(missing_body):  # the head is new
        generator = torch.Generator().manual_seed(seed)
        std = getattr(config.get_text_config(), "initializer_range", None) or 0.02
        with torch.no_grad():
            head.weight.normal_(0.0, std, generator=generator)
            if head.bias is not None:
                head.bias.zero_()
    # checkpoint.save_sharded writes the generation config of a model that has one; a value model has
    # none, and Hugging Face leaves the attribute unset rather than None.
    model.generation_config = None
    return model


def response_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_len: int) -> torch.Tensor:
    """V(s_t) for each response token t: the head's output at the position that predicts t (the state
    before it, positions -R-1 .. -2), in fp32.

    input_ids, attention_mask: (b, P + R), the last R positions are the response. Returns (b, R);
    padded positions hold whatever the head gives there (callers mask them).
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits[:, -response_len - 1:-1, 0].float()  # (b, R)


class CriticWorker(RankWorker):
    """Rank `rank` of `world_size` of the critic. `device` is "cuda" (the one GPU Ray gave this process)
    or "cpu". `critic_cfg` holds verl's critic.* settings (REQUIRED_KEYS, and OPTIONAL_KEYS with their
    defaults); `total_steps` sizes a cosine schedule."""

    def __init__(self, critic_cfg: dict, rank: int, world_size: int, master_addr: str, master_port: int,
                 device: str, total_steps: int):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-file bars from every rank would flood the run's log
        missing = [k for k in REQUIRED_KEYS if k not in critic_cfg]
        if missing:
            raise KeyError(f"critic config lacks {', '.join(missing)}")
        self.cfg = {**OPTIONAL_KEYS, **critic_cfg}
        c = self.cfg
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        distributed.init_process_group(rank, world_size, master_addr, master_port, self.device)
        torch.manual_seed(c["seed"])
        dtype = distributed.param_dtype(c["param_dtype"], self.device)

        self.critic = load_value_model(c["model_path"], c["seed"])  # fp32 master weights, sharded below
        if c["enable_gradient_checkpointing"]:
            self.critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        compile_layers = c["use_torch_compile"] and self.device.type == "cuda"
        distributed.shard_model(self.critic, self.device, dtype, offload=c["offload_policy"],
                                compile_layers=compile_layers)
        self.width_multiple = COMPILED_WIDTH_MULTIPLE if compile_layers else 1
        self.critic.train()
        self.optimizer = torch.optim.AdamW(self.critic.parameters(), lr=c["lr"], betas=tuple(c["betas"]),
                                           weight_decay=c["weight_decay"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(c["lr_warmup_steps"], total_steps, c["warmup_style"], c["min_lr_ratio"]))
        self._progress: tuple = ()
        self._peaks = PeakMemory(self.device)
        self._phase = self._peaks.phase

    # ---- values ----

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """(b, R) V of the state before each response token, fp32, 0 on padded response positions."""
        self._progress = ()
        self.critic.eval()
        response_len = batch["responses"].shape[1]
        parts = []
        plan = self._plan(batch["attention_mask"], response_len)
        inputs = to_device({k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}, self.device)
        with self._phase("values"):
            for mb, mb_response_len in plan.split(inputs):
                values = response_values(self.critic, mb["input_ids"], mb["attention_mask"], mb_response_len)
                parts.append(torch.where(mb["response_mask"].bool(), values, 0.0))
            self.critic.reshard()  # FSDP keeps the root's parameters gathered after a forward without backward
        self.critic.train()
        # One copy to the host at the end, so the micro-batches run back to back on the device.
        return plan.join(parts, response_len).cpu()

    def _plan(self, attention_mask: torch.Tensor, response_len: int) -> MicroBatches:
        """The micro-batches of a values pass or an update's mini-batch: by rows, or with use_dynamic_bsz by
        ppo_max_token_len_per_gpu positions (verl's critic keys; the values pass uses the same budget)."""
        c = self.cfg
        return micro_batches_on_ranks(attention_mask, response_len,
                                      c["ppo_micro_batch_size_per_gpu"],
                                      c["ppo_max_token_len_per_gpu"] if c["use_dynamic_bsz"] else None,
                                      self.world_size, self.device, self.width_multiple)

    # ---- the update ----

    def update_critic(self, batch: Batch, mini_rows: int, counts: list[tuple[float, float]] | None = None
                      ) -> dict[str, float]:
        """Clipped value-loss regression of V on the returns; returns this rank's critic/* metrics.

        batch: this rank's rows, already in update order (the controller repeats them for ppo_epochs and
        gives each rank an equal part of every mini-batch, as for the actor), holding input_ids,
        attention_mask, responses, response_mask, values (from compute_values before the update: the
        centre of the value clip) and returns. Every `mini_rows` rows are one optimizer step; `counts` holds
        each step's valid tokens and non-empty responses over all ranks (one rank alone counts its own), so
        each micro-batch's loss is its share of the whole step's, as in the actor's update.
        """
        self._progress = ()
        c = self.cfg
        total = batch["responses"].shape[0]
        response_len = batch["responses"].shape[1]
        counts = counts if counts is not None else step_counts(batch["response_mask"], mini_rows)
        plans = [self._plan(batch["attention_mask"][start:start + mini_rows], response_len)
                 for start in range(0, total, mini_rows)]
        n_micro_total = sum(len(plan) for plan in plans)
        sums: dict[str, float] = {}
        steps = done = skipped = 0
        batch = to_device(batch, self.device)
        with self._phase("update_critic"):
            for step, start in enumerate(range(0, total, mini_rows)):
                mini = {k: v[start:start + mini_rows] for k, v in batch.items()}
                num_tokens, num_seqs = counts[step]
                self.optimizer.zero_grad(set_to_none=True)
                step_metrics: dict[str, torch.Tensor] = {}
                n_micro = 0
                for mb, mb_response_len in plans[step].split(mini):
                    vpreds = response_values(self.critic, mb["input_ids"], mb["attention_mask"], mb_response_len)
                    loss, metrics = compute_value_loss(
                        vpreds, mb["returns"], mb["values"], mb["response_mask"],
                        cliprange_value=c["cliprange_value"], loss_agg_mode=c["loss_agg_mode"],
                        num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=c["loss_scale_factor"])
                    # FSDP averages the ranks' gradients: each rank's share of the step's loss counts
                    # world_size times, so the average is the gradient of the whole step's loss.
                    (loss * self.world_size).backward()
                    for k, v in metrics.items():
                        # The loss adds up over the step's micro-batches; the rates are averaged below.
                        scale = self.world_size if k == "critic/vf_loss" else 1.0
                        step_metrics[k] = step_metrics.get(k, 0.0) + v.float() * scale
                    n_micro += 1
                    done += 1
                    self._report("the critic update", done, n_micro_total)
                step_metrics = {k: v if k == "critic/vf_loss" else v / n_micro for k, v in step_metrics.items()}
                grad_norm = distributed.global_grad_norm(self.critic.parameters(), c["grad_clip"])
                # One wait for the device per optimizer step: the metrics come over with the norm, which
                # the finiteness check has to read anyway.
                names = list(step_metrics)
                floats = torch.stack([*(step_metrics[k] for k in names),
                                      grad_norm.float().to(self.device)]).tolist()
                if math.isfinite(floats[-1]):
                    self.optimizer.step()
                else:
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                for k, v in zip([*names, "critic/grad_norm"], floats, strict=True):
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        metrics = {k: v / steps for k, v in sums.items()}
        metrics["critic/lr"] = lr
        metrics["critic/skipped_steps"] = float(skipped)
        metrics.update(self.memory())
        return metrics


    def memory(self) -> dict[str, float]:
        """Peak GPU memory of this rank in each critic phase since the last call, in GiB:
        perf/max_memory_{allocated,reserved}_gb/<values|update_critic> (nothing on CPU). No overall
        peak: that key is the actor's, and the trainer merges both workers' metrics into one line."""
        return self._peaks.take(overall=False)

    # ---- checkpoints ----

    def save_checkpoint(self, folder: str) -> None:
        """This rank's shards of the weights and Adam state, its schedule and RNG (collective)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        checkpoint.save_sharded(Path(folder), self.critic, self.optimizer, self.scheduler, self.rank)

    def load_checkpoint(self, folder: str) -> None:
        checkpoint.load_sharded(Path(folder), self.critic, self.optimizer, self.scheduler, self.rank)

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
