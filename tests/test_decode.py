"""The workbench rollout engine samples what Hugging Face generate samples, follows the actor's weights,
and is refused, with the reason, for models it cannot run."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import GPT2Config

from backend.core.config import load_config
from backend.core.models import load_model, load_tokenizer, model_config
from backend.engine import checks
from backend.rollout import static_cache
from backend.rollout.base import HFGenerateEngine, SamplingParams
from backend.rollout.static_cache import StaticCacheEngine
from tests.conftest import tiny_overrides

PROMPTS = ("2 + 3 =", "what is 7 - 4?", "9 - 1 = ?", "Tom has 3 apples and buys 4 more. How many apples?")
SETTINGS = [
    SamplingParams(n=2, max_new_tokens=24, greedy=True),
    SamplingParams(n=3, max_new_tokens=24, seed=5),
    SamplingParams(n=2, max_new_tokens=24, seed=9, temperature=0.7, top_k=40, top_p=0.9),
    SamplingParams(n=2, max_new_tokens=24, seed=9, ignore_eos=True),
]


def _engines(name: str, batch_size: int, free_after_generate: bool = True):
    model = load_model(name, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(name)
    ours = StaticCacheEngine(model, tokenizer, batch_size, torch.device("cpu"), torch.float32, max_len=64,
                             free_after_generate=free_after_generate)
    ours.load_weights(model)
    return model, tokenizer, ours, HFGenerateEngine(model, tokenizer, batch_size=batch_size)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
@pytest.mark.parametrize("params", SETTINGS, ids=["greedy", "sampled", "top-k-top-p", "ignore-eos"])
def test_the_engine_generates_what_hugging_face_generate_does(name, params):
    # batch_size 5 splits the rows into uneven chunks, so state carried between chunks would show.
    _, tokenizer, ours, hf = _engines(name, batch_size=5)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected, got = hf.generate(prompts, params, first_row=3), ours.generate(prompts, params, first_row=3)
    assert torch.equal(got.responses, expected.responses)
    assert torch.equal(got.input_ids, expected.input_ids)
    assert torch.equal(got.response_mask, expected.response_mask)
    assert got.finish_reasons == expected.finish_reasons
    if params.ignore_eos:
        assert got.responses.shape[1] == params.max_new_tokens and set(got.finish_reasons) == {"length"}


def test_the_engine_follows_the_weights_it_is_given():
    model, tokenizer, ours, _ = _engines("tiny-llama", batch_size=8, free_after_generate=False)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=1, max_new_tokens=12, greedy=True)
    before = ours.generate(prompts, params).responses
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert torch.equal(ours.generate(prompts, params).responses, before)  # still its own copy
    ours.load_weights(model)
    after = ours.generate(prompts, params).responses
    assert not torch.equal(after, before)
    assert torch.equal(after, HFGenerateEngine(model, tokenizer, batch_size=8).generate(prompts, params).responses)


def test_models_the_engine_cannot_run_are_named_with_the_reason(tmp_path, sample_sets):
    assert static_cache.unsupported_reason(model_config("tiny-qwen3")) is None
    gpt2 = tmp_path / "gpt2"
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=512, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(gpt2)
    load_tokenizer("tiny-qwen3").save_pretrained(gpt2)
    assert "GPT2LMHeadModel" in static_cache.unsupported_reason(model_config(str(gpt2)))
    cfg = load_config("configs/default.yaml", tiny_overrides(sample_sets) + [
        f"actor_rollout_ref.model.path={gpt2}", "actor_rollout_ref.rollout.name=workbench"])
    problems = checks.preflight(cfg)
    assert any("rollout.name=workbench cannot run" in p and "GPT2LMHeadModel" in p for p in problems), problems
    auto = load_config("configs/default.yaml", tiny_overrides(sample_sets) + [f"actor_rollout_ref.model.path={gpt2}"])
    assert not any("rollout.name" in p for p in checks.preflight(auto))


def test_an_engine_that_frees_after_generating_drops_its_stale_weights_until_it_is_given_new_ones():
    model, tokenizer, ours, hf = _engines("tiny-qwen3", batch_size=8)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=2, max_new_tokens=12, seed=2)
    first = ours.generate(prompts, params).responses
    assert ours.layers == [] and ours.embed is None and ours.lm_head is None and ours.cache == []
    with pytest.raises(RuntimeError, match="before load_weights"):
        ours.generate(prompts, params)
    ours.load_weights(model)
    assert torch.equal(ours.generate(prompts, params).responses, first)
    assert torch.equal(first, hf.generate(prompts, params).responses)


def test_after_a_sync_that_left_a_layer_behind_the_engine_names_that_layers_tensors():
    model, _, ours, _ = _engines("tiny-qwen3", batch_size=4, free_after_generate=False)
    assert ours.stale_tensors(model) == []
    before = {k: v.clone() for k, v in vars(ours.layers[1]).items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():  # an update, smaller than a typical step's
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-4)
    ours.load_weights(model)
    assert ours.stale_tensors(model) == []
    for k, v in before.items():  # the sync as if it had skipped layer 1
        getattr(ours.layers[1], k).copy_(v)
    stale = ours.stale_tensors(model)
    assert stale == [f"model.layers.1.{name}" for name in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]


def test_the_compiled_decode_step_samples_what_the_eager_one_does_and_makes_no_addmm_in_bf16(monkeypatch):
    # On a GPU the pieces of each decode layer are compiled (StaticCacheEngine.__init__); here the same pieces
    # are compiled for the CPU. Inductor makes `x + matmul` an addmm where it may (on the CPU wherever the shapes
    # allow), and an addmm first copies x into its output: on a GPU, in bf16, two copies a layer a step.
    model, tokenizer, eager, _ = _engines("tiny-qwen3", batch_size=4)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    params = SamplingParams(n=2, max_new_tokens=6, seed=4)
    for dtype in (torch.float32, torch.bfloat16):
        compiled = StaticCacheEngine(model, tokenizer, 4, torch.device("cpu"), dtype, max_len=32)
        monkeypatch.setattr(compiled, "_decode_qkv", torch.compile(compiled._stored_qkv))
        monkeypatch.setattr(compiled, "_decode_finish", torch.compile(compiled._finish_apart))
        monkeypatch.setattr(compiled, "_decode_sample", torch.compile(compiled._sample))
        compiled.load_weights(model)
        got, code = run_and_get_code(compiled.generate, prompts, params)
        if dtype == torch.float32:  # bf16's rounding differs between eager and fused kernels
            assert torch.equal(got.responses, eager.generate(prompts, params).responses)
        else:
            assert len(code) >= 3 and not any("addmm" in c for c in code)
