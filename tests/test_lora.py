"""LoRA: only the adapters train, the reference is the base with adapters off, the rollout engine samples
with the merged weights, and checkpoints and exports fold the adapters into a plain model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from backend.core import checkpoint, lora
from backend.core.config import load_config, to_dict
from backend.core.models import load_model, load_tokenizer
from backend.core.runs import latest_checkpoint
from backend.engine.distributed import local_meeting_point
from backend.engine.trainer import Trainer
from backend.engine.workers import ActorRolloutRefWorker
from backend.rollout.base import HFGenerateEngine, SamplingParams
from backend.rollout.static_cache import StaticCacheEngine

from .conftest import tiny_overrides
from .test_workers import padded_batch

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow


def test_merging_adds_scaled_b_times_a_and_drops_peft_names():
    a, b = torch.randn(2, 3), torch.randn(4, 2)
    w = torch.randn(4, 3)
    state = {"base_model.model.model.layers.0.mlp.up_proj.base_layer.weight": w,
             "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight": a,
             "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight": b,
             "base_model.model.model.norm.weight": torch.ones(3)}
    merged = lora.merge_state_dict(state, rank=2, alpha=8.0)
    assert set(merged) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    torch.testing.assert_close(merged["model.layers.0.mlp.up_proj.weight"], w + 4.0 * b @ a)


def lora_worker(sample_sets, **extra) -> ActorRolloutRefWorker:
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.model.lora_rank": 4, **extra}))
    return ActorRolloutRefWorker(to_dict(cfg), 0, 1, *local_meeting_point(), "cpu", total_steps=2)


def test_an_update_moves_only_the_adapters_and_the_reference_stays_the_base(sample_sets, tiny_tokenizer):
    worker = lora_worker(sample_sets, **{"actor_rollout_ref.actor.optim.lr": 1e-2})
    assert worker.ref is None  # no second copy of the model
    _, batch = padded_batch(tiny_tokenizer)
    before = {k: v.full_tensor().clone() for k, v in worker.actor.named_parameters()}
    ref_before = worker.compute_ref_log_prob(batch)
    torch.testing.assert_close(worker.compute_log_prob(batch)[0], ref_before)  # B = 0: the base, unchanged
    batch["advantages"] = torch.tensor([[1.0] * 4, [-1.0] * 4]) * batch["response_mask"]
    batch["ref_log_probs"] = ref_before
    worker.update_actor(batch, mini_rows=2)
    after = {k: v.full_tensor() for k, v in worker.actor.named_parameters()}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    torch.testing.assert_close(worker.compute_ref_log_prob(batch), ref_before)
    assert not torch.allclose(worker.compute_log_prob(batch)[0], ref_before)
    worker.shutdown()


def test_the_rollout_engine_samples_with_the_adapters_merged_in(tiny_tokenizer):
    model = lora.wrap(load_model("tiny-qwen3", torch.device("cpu")), 4, 16.0, ["all-linear"]).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    engine = StaticCacheEngine(lora.unwrap(model), tiny_tokenizer, 8, torch.device("cpu"), torch.float32, max_len=64)
    engine.load_weights(lora.unwrap(model))
    prompts = [tiny_tokenizer(p)["input_ids"] for p in ("2 + 3 =", "what is 7 - 4?")]
    params = SamplingParams(n=2, max_new_tokens=12, seed=3)
    expected = HFGenerateEngine(model, tiny_tokenizer, batch_size=8).generate(prompts, params)
    assert torch.equal(engine.generate(prompts, params).responses, expected.responses)
    with lora.reference_mode(model):
        base = HFGenerateEngine(model, tiny_tokenizer, batch_size=8).generate(prompts, params)
        # FSDP2 decides at its first forward, perhaps this one, which parameters train
        assert all(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)
    assert not torch.equal(base.responses, expected.responses)  # the adapters do change what is sampled
    plain = load_model("tiny-qwen3", torch.device("cpu")).eval()
    with lora.reference_mode(model):
        expected_base = HFGenerateEngine(plain, tiny_tokenizer, batch_size=8).generate(prompts, params)
    assert torch.equal(base.responses, expected_base.responses)  # reference mode is the base model


def test_a_lora_run_exports_and_merges_a_plain_model_that_loads_without_peft(tmp_path, sample_sets):
    cfg = load_config(None, tiny_overrides(sample_sets, **{
        "actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.actor.optim.lr": 1e-2, "data.val_files": "[]"}))
    Trainer(cfg, tmp_path / "run", show_progress=False).train()
    exported = load_file(tmp_path / "run" / "export" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in exported)
    base = load_model("tiny-qwen3", torch.device("cpu")).state_dict()
    assert any(not torch.equal(exported[k], base[k]) for k in exported if k in base)
    merged = checkpoint.merged_state_dict(latest_checkpoint(tmp_path / "run"))
    for k, v in exported.items():
        torch.testing.assert_close(merged[k], v)
    plain = load_model(str(tmp_path / "run" / "export"), torch.device("cpu"))
    assert type(plain).__name__ == "Qwen3ForCausalLM"
    load_tokenizer(str(tmp_path / "run" / "export"))
