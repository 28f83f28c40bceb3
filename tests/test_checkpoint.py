"""Loading a sharded checkpoint keeps the optimizer settings of the config it is loaded under: a fork with an
edited learning rate, betas or weight decay trains with them, and a plain resume changes nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backend.core import checkpoint
from backend.engine.rank import lr_lambda

CONFIG = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2)


def built(lr: float, betas: tuple[float, float], weight_decay: float) -> tuple:
    """A model, its AdamW and warm-up schedule (10 steps of 100) as a worker builds them from a config."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(10, 100, "constant", 0.0))
    return model, optimizer, scheduler


def step(model: LlamaForCausalLM, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


@pytest.mark.parametrize(("lr", "betas", "weight_decay"), [(1e-3, (0.9, 0.999), 0.01), (1e-6, (0.8, 0.9), 0.1)])
def test_a_checkpoint_loads_under_the_optimizer_settings_of_the_current_config(tmp_path, lr, betas, weight_decay):
    model, optimizer, scheduler = built(1e-3, (0.9, 0.999), 0.01)
    step(model, optimizer, scheduler, 4)
    checkpoint.save_sharded(tmp_path, model, optimizer, scheduler, rank=0)
    saved = optimizer.param_groups[0]["lr"]

    model, optimizer, scheduler = built(lr, betas, weight_decay)
    checkpoint.load_sharded(tmp_path, model, optimizer, scheduler, rank=0)
    group = optimizer.param_groups[0]
    assert scheduler.last_epoch == 4  # the schedule's position is the checkpoint's
    assert group["lr"] == pytest.approx(lr * 5 / 10)  # the warm-up's factor at step 4, on the configured rate
    assert (group["betas"], group["weight_decay"]) == (betas, weight_decay)
    if lr == 1e-3:
        assert group["lr"] == saved  # a plain resume
    step(model, optimizer, scheduler, 1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr * 6 / 10)
