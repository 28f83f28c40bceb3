"""The critic: values on padded batches, an update that fits the returns, and a checkpoint that resumes exactly."""

from __future__ import annotations

import math

import pytest
import torch

from backend.engine.critic import CriticWorker, load_value_model
from backend.engine.distributed import local_meeting_point

from .test_workers import full_params, padded_batch

METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
           "critic/skipped_steps")


def critic_cfg(**extra) -> dict:
    cfg = {"model_path": "tiny-qwen3", "tokenizer_path": "", "enable_gradient_checkpointing": False, "lr": 1e-3,
           "betas": [0.9, 0.999], "weight_decay": 0.0, "grad_clip": 1.0, "cliprange_value": 0.5,
           "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 1, "loss_agg_mode": "token-mean", "param_dtype": "fp32",
           "offload_policy": False, "use_torch_compile": False, "seed": 0}
    cfg.update(extra)
    return cfg


def one_rank_critic(**extra) -> CriticWorker:
    """A critic in this process, as rank 0 of a one-process gloo group (the path a one-worker run takes)."""
    return CriticWorker(critic_cfg(**extra), 0, 1, *local_meeting_point(), "cpu", total_steps=4)


def fitting_batch(worker: CriticWorker, tokenizer) -> dict[str, torch.Tensor]:
    """The padded batch with its current values and returns 0.3 away from them (inside the value clip of
    0.5, so the clipped loss keeps a gradient all the way to the returns), garbage on the padding."""
    _, batch = padded_batch(tokenizer)
    batch["values"] = worker.compute_values(batch)
    offset = torch.tensor([[0.3, -0.3, 0.3, 100.0], [-0.3, 0.3, -0.3, 0.3]])
    batch["returns"] = batch["values"] + offset
    return batch


def value_error(worker: CriticWorker, batch: dict[str, torch.Tensor]) -> float:
    mask = batch["response_mask"].bool()
    return ((worker.compute_values(batch) - batch["returns"])[mask] ** 2).mean().item()


def test_values_of_a_left_padded_row_are_those_of_the_state_before_each_token_of_the_row_alone(tiny_tokenizer):
    worker = one_rank_critic()
    prompts, batch = padded_batch(tiny_tokenizer)
    values = worker.compute_values(batch)
    assert values.shape == (2, 4) and values.dtype == torch.float32
    # The same head, unsharded, on the row without padding: V(s_t) is read where token t is predicted.
    plain = load_value_model("tiny-qwen3", seed=0).eval()
    alone = torch.tensor([prompts[0] + [30, 31, 32]])
    expected = plain(alone).logits[0, len(prompts[0]) - 1:-1, 0]
    torch.testing.assert_close(values[0, :3], expected, atol=1e-5, rtol=1e-5)
    assert values[0, 3] == 0.0  # padding, where the head gives something else
    assert bool((values[1] != 0).all())


def test_the_new_value_head_is_drawn_from_the_seed_and_nothing_else():
    torch.manual_seed(123)  # whatever the global RNG has done before must not matter
    a = load_value_model("tiny-qwen3", seed=0).score.weight
    torch.manual_seed(456)
    b = load_value_model("tiny-qwen3", seed=0).score.weight
    c = load_value_model("tiny-qwen3", seed=1).score.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_updates_fit_the_returns_and_move_every_trainable_parameter(tiny_tokenizer):
    worker = one_rank_critic()
    batch = fitting_batch(worker, tiny_tokenizer)
    before = full_params(worker.critic)
    error_before = value_error(worker, batch)
    # Two mini-batches of one row each, then one of both rows with two micro-batches accumulated.
    history = [worker.update_critic(batch, mini_rows=1)] + [worker.update_critic(batch, mini_rows=2) for _ in range(4)]
    assert value_error(worker, batch) < 0.25 * error_before
    assert history[-1]["critic/vf_loss"] < history[0]["critic/vf_loss"]
    after = full_params(worker.critic)
    assert [k for k in after if torch.equal(after[k], before[k])] == []
    for metrics in history:
        assert set(METRICS) <= set(metrics)
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["critic/skipped_steps"] == 0.0 and metrics["critic/grad_norm"] > 0
    assert history[0]["critic/lr"] == pytest.approx(1e-3)


def test_micro_batches_accumulate_to_the_gradient_of_the_whole_mini_batch(tiny_tokenizer):
    # seq-mean-token-mean: each row counts once, so weighting micro-batches by their rows is exact.
    # The gradient norm is read before the step, where Adam's first step (about lr * sign) would hide a scale.
    metrics = []
    for micro in (2, 1):
        worker = one_rank_critic(ppo_micro_batch_size_per_gpu=micro, loss_agg_mode="seq-mean-token-mean")
        metrics.append(worker.update_critic(fitting_batch(worker, tiny_tokenizer), mini_rows=2))
    whole, accumulated = metrics
    for key in ("critic/vf_loss", "critic/grad_norm"):  # vpred_mean and clipfrac count tokens, not rows
        assert accumulated[key] == pytest.approx(whole[key], rel=1e-5), key


def test_micro_batches_by_tokens_give_the_values_and_update_of_one_whole_micro_batch(tiny_tokenizer):
    """A budget of 30 positions holds one of the two rows (29 and 9 positions), so each row runs alone, cut
    to its own columns: the same values, loss and gradient norm as both rows in one micro-batch."""
    results = []
    for extra in ({"ppo_micro_batch_size_per_gpu": 2}, {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 30}):
        worker = one_rank_critic(loss_agg_mode="seq-mean-token-mean", **extra)
        batch = fitting_batch(worker, tiny_tokenizer)
        results.append((batch["values"], worker.update_critic(batch, mini_rows=2)))
    (whole_values, whole), (values, by_tokens) = results
    torch.testing.assert_close(values, whole_values, atol=1e-5, rtol=1e-5)
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert by_tokens[key] == pytest.approx(whole[key], rel=1e-5), key


def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted(tiny_tokenizer):
    worker = one_rank_critic()
    batch = fitting_batch(worker, tiny_tokenizer)
    batch["returns"][1, 0] = float("nan")
    before = full_params(worker.critic)
    metrics = worker.update_critic(batch, mini_rows=1)  # row 0 is fine, row 1 is not
    assert metrics["critic/skipped_steps"] == 1.0
    after = full_params(worker.critic)
    assert [k for k in after if not torch.equal(after[k], before[k])] != []  # row 0's step was taken
    worker.update_critic({k: v[1:] for k, v in batch.items()}, mini_rows=1)
    assert all(torch.equal(v, after[k]) for k, v in full_params(worker.critic).items())


def test_a_saved_critic_loads_into_a_fresh_worker_with_the_same_values_and_next_update(tiny_tokenizer, tmp_path):
    worker = one_rank_critic()
    batch = fitting_batch(worker, tiny_tokenizer)
    worker.update_critic(batch, mini_rows=2)  # Adam moments and the schedule have moved on from their start
    worker.save_checkpoint(str(tmp_path / "critic"))
    saved_values = worker.compute_values(batch)
    next_metrics = worker.update_critic(batch, mini_rows=2)
    next_values = worker.compute_values(batch)

    fresh = one_rank_critic(seed=1)  # another head, so only the checkpoint can make the values agree
    assert not torch.allclose(fresh.compute_values(batch), saved_values)
    fresh.load_checkpoint(str(tmp_path / "critic"))
    torch.testing.assert_close(fresh.compute_values(batch), saved_values, rtol=0, atol=0)
    assert fresh.update_critic(batch, mini_rows=2) == pytest.approx(next_metrics, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(fresh.compute_values(batch), next_values, rtol=1e-6, atol=1e-7)
