"""Supervised warm-start: a few hundred steps of next-token loss on demonstrations, before RL, for a model
that never does what the RL task needs on its own (a 135M model writes no tool call, so GRPO has no
episode with a call to reinforce).

A conversation is laid out token for token as an episode of the run is: the first messages as the run's
prompt (the tools offered as the run offers them), each assistant message as the ids of its text and the
end-of-turn token (the loss), each run of tool or user messages as the chat template's rendering of them
(no loss). The run directory is an ordinary one (config.yaml, status.json, metrics.jsonl with `sft/loss`,
export/), so the workbench shows it like any run, and its export/ is the model.path of the RL run.
"""

from __future__ import annotations

import random
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from backend.core import data
from backend.core.config import Config, ConfigError, to_yaml
from backend.core.models import amp_context, load_model, load_tokenizer, pick_device
from backend.core.runs import RunDir
from backend.envs.tools import resolve_tools
from backend.rollout.episodes import ChatRenderer, end_of_turn_ids

IGNORE = -100  # label of a token without loss (Hugging Face's ignore index)


def conversation_tokens(messages: list[dict], tokenizer, renderer: ChatRenderer, max_length: int
                        ) -> tuple[list[int], list[int]]:
    """(ids, labels) of one conversation: labels are the ids on assistant messages (their end-of-turn token
    included) and IGNORE elsewhere; cut to max_length."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise data.DataError("a conversation must start with at least one prompt message and hold an assistant "
                             f"message: got roles {[m['role'] for m in messages]}")
    ids, _ = renderer.prompt(messages[:first])
    labels = [IGNORE] * len(ids)
    pending: list[dict] = []
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            observation = renderer.observation(pending)
            ids, labels, pending = ids + observation, labels + [IGNORE] * len(observation), []
        turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [renderer.end_ids[0]]
        ids, labels = ids + turn, labels + turn
    return ids[:max_length], labels[:max_length]


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """The examples padded on the right: input_ids, labels (IGNORE at padding), attention_mask."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(examples):
        ids[i, :len(row_ids)], labels[i, :len(row_ids)], mask[i, :len(row_ids)] = (
            torch.tensor(row_ids), torch.tensor(row_labels), 1)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_sft(cfg: Config, run_dir: str | Path, *, show_progress: bool = True) -> Path:
    """Fine-tune actor_rollout_ref.model.path on sft.train_files for sft.steps steps; returns the export folder.
    A failure is recorded in the run's status.json, as a training run's is."""
    s = cfg.sft
    if not s.train_files:
        raise ConfigError(["sft.train_files is empty: name parquet files with a messages column (python -m backend "
                           "data make-calculator writes one)"])
    run = RunDir(Path(run_dir))
    run.create()
    run.config.write_text(to_yaml(cfg))
    run.write_status("running", stage="loading demonstrations and the model", step=0, total_steps=s.steps,
                     started=time.time(), error=None)
    try:
        export = _train(cfg, run, show_progress)
    except BaseException as e:
        run.write_status("failed" if not isinstance(e, KeyboardInterrupt) else "stopped", stage="failed",
                         finished=time.time(), error=f"{type(e).__name__}: {e}",
                         traceback="".join(traceback.format_exc().splitlines(True)[-30:]))
        raise
    run.write_status("succeeded", stage="done", step=s.steps, finished=time.time())
    return export


def _train(cfg: Config, run: RunDir, show_progress: bool) -> Path:
    s, arr = cfg.sft, cfg.actor_rollout_ref
    device = pick_device(cfg.trainer.device)
    tokenizer = load_tokenizer(arr.model.path, arr.model.tokenizer_path)
    mt = arr.rollout.multi_turn
    renderer = ChatRenderer(tokenizer, resolve_tools(mt.tools, mt.tool_config_path),
                            end_of_turn_ids(tokenizer, arr.model.path))
    examples = []
    for path in s.train_files:
        for i, messages in enumerate(data.load_messages(path)):
            try:
                examples.append(conversation_tokens(messages, tokenizer, renderer, s.max_length))
            except data.DataError as e:
                raise data.DataError(f"{path} row {i}: {e}") from None
    torch.manual_seed(cfg.trainer.seed)
    model = load_model(arr.model.path, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    order = random.Random(cfg.trainer.seed)
    queue: list[int] = []
    bar = tqdm(total=s.steps, desc="sft", unit="step", disable=not show_progress, dynamic_ncols=True)
    for step in range(1, s.steps + 1):
        start = time.perf_counter()
        while len(queue) < s.batch_size:  # epochs in a fresh order each
            more = list(range(len(examples)))
            order.shuffle(more)
            queue += more
        picked, queue = queue[:s.batch_size], queue[s.batch_size:]
        batch = {k: v.to(device) for k, v in _batch([examples[i] for i in picked], tokenizer.pad_token_id).items()}
        lr = s.lr * min(1.0, step / 10)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with amp_context(device):
            loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        metrics = {"step": step, "sft/loss": loss.item(), "sft/lr": lr, "sft/grad_norm": grad_norm.item(),
                   "sft/tokens": int((batch["labels"] != IGNORE).sum()), "timing_s/step": time.perf_counter() - start}
        run.append_metrics(metrics)
        run.write_status("running", step=step, stage=f"supervised step {step}/{s.steps}", stage_started=time.time())
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['sft/loss']:.4f}")
    bar.close()
    run.write_status("running", stage="exporting", stage_started=time.time())
    tmp = run.export.with_name(f".{run.export.name}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(run.export)
    return run.export
