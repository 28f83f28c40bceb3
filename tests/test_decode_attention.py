"""The decode-attention kernel computes PyTorch's masked attention, and the engine built on it samples
what Hugging Face generate samples. Triton's interpreter runs the GPU kernel here on the CPU (conftest sets
TRITON_INTERPRET); it has no bfloat16, so these run in fp32 and fp16, and bench/decode_attention_check.py
covers bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.core.models import load_model, load_tokenizer
from backend.envs.environment import Environment, Step
from backend.kernels import decode_attention
from backend.rollout.base import HFGenerateEngine, SamplingParams
from backend.rollout.episodes import ChatRenderer, TurnLimits, play_episodes, run_episodes
from backend.rollout.static_cache import StaticCacheEngine

pytest.importorskip("triton", reason="the kernel is written in Triton (installed with the dev extra)")
if torch.cuda.is_available():
    pytest.skip("these run the kernel on CPU tensors in Triton's interpreter, which conftest turns on only where "
                "there is no GPU; on a GPU, bench/decode_attention_check.py checks it", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_the_kernel_attends_to_the_valid_written_slots_only(dtype, group):
    torch.manual_seed(0)
    rows, b, n_kv, d, slots = 5, 3, 2, 32, 150
    q = torch.randn(b, n_kv, group, d, dtype=dtype)
    k_cache, v_cache = (torch.randn(rows, n_kv, slots, d, dtype=dtype) for _ in range(2))
    valid = torch.ones(rows, slots, dtype=torch.bool)
    valid[0, :70] = False  # left padding longer than a whole block of slots
    valid[1, :3] = False
    newest = 100  # slots past it hold stale values from a longer earlier batch: never read
    k_new, v_new = (torch.randn(b, n_kv, d, dtype=dtype) for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    out = decode_attention.decode_attention(q, k_cache, v_cache, k_new, v_new, valid, torch.tensor([newest]))
    # The kernel wrote the new key and value into the newest slot of the first b rows, and nothing else.
    for cache, new, old in ((k_cache, k_new, before[0]), (v_cache, v_new, before[1])):
        assert torch.equal(cache[:b, :, newest], new)
        old[:b, :, newest] = new
        assert torch.equal(cache, old)
    expected = F.scaled_dot_product_attention(q.float(), k_cache[:b, :, :newest + 1].float(),
                                              v_cache[:b, :, :newest + 1].float(),
                                              attn_mask=valid[:b, None, None, :newest + 1])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_fp8_cache_is_read_widened_to_the_queries_dtype_and_the_new_slot_written_as_given(dtype):
    torch.manual_seed(1)
    b, n_kv, group, d, slots, newest = 2, 2, 2, 32, 200, 150
    q = torch.randn(b, n_kv, group, d, dtype=dtype)
    k_cache, v_cache, k_new, v_new = (torch.randn(*shape).to(decode_attention.FP8) for shape in (
        (b, n_kv, slots, d), (b, n_kv, slots, d), (b, n_kv, d), (b, n_kv, d)))
    valid = torch.ones(b, slots, dtype=torch.bool)
    valid[1, :40] = False
    out = decode_attention.decode_attention(q, k_cache, v_cache, k_new, v_new, valid, torch.tensor([newest]))
    assert torch.equal(k_cache[:, :, newest].float(), k_new.float())
    assert torch.equal(v_cache[:, :, newest].float(), v_new.float())
    expected = F.scaled_dot_product_attention(q.float(), k_cache[:, :, :newest + 1].float(),
                                              v_cache[:, :, :newest + 1].float(),
                                              attn_mask=valid[:, None, None, :newest + 1])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert out.dtype == dtype


def test_caches_and_new_values_of_mixed_dtypes_are_refused():
    q, cache = torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 4, 16).to(decode_attention.FP8)
    for new in (torch.zeros(1, 1, 16), torch.zeros(1, 1, 16, dtype=torch.float16)):  # q's dtype, another
        with pytest.raises(ValueError, match="the caches and the new key and value"):
            decode_attention.decode_attention(q, cache, cache.clone(), new, new, torch.ones(1, 4, dtype=torch.bool),
                                              torch.tensor([1]))


def test_a_head_dim_the_kernel_cannot_tile_is_refused():
    q = torch.zeros(1, 1, 1, 24)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention.decode_attention(q, torch.zeros(1, 1, 4, 24), torch.zeros(1, 1, 4, 24), torch.zeros(1, 1, 24),
                                          torch.zeros(1, 1, 24), torch.ones(1, 4, dtype=torch.bool), torch.tensor([1]))


def test_the_engine_on_the_kernel_samples_what_hugging_face_generate_does():
    model = load_model("tiny-qwen3", torch.device("cpu")).eval()
    tokenizer = load_tokenizer("tiny-qwen3")
    engine = StaticCacheEngine(model, tokenizer, 5, torch.device("cpu"), torch.float32, max_len=64)
    engine.kernel_attention = True  # what a GPU gets; on the CPU only through the interpreter
    engine.load_weights(model)
    prompts = [tokenizer(p)["input_ids"] for p in ("2 + 3 =", "what is 7 - 4? Think first.", "9 - 1 = ?")]
    params = SamplingParams(n=3, max_new_tokens=16, seed=4)
    got = engine.generate(prompts, params, first_row=2)
    expected = HFGenerateEngine(model, tokenizer, batch_size=5).generate(prompts, params, first_row=2)
    assert torch.equal(got.responses, expected.responses)
    assert got.finish_reasons == expected.finish_reasons


def test_an_fp8_cache_samples_the_same_tokens_through_the_kernel_and_through_pytorchs_attention():
    # Both paths store the same rounded values and read them back, so they agree token for token; the cache
    # holds one byte a value, and a key past e4m3's range is stored clamped to it, not as NaN.
    model = load_model("tiny-qwen3", torch.device("cpu")).eval()
    tokenizer = load_tokenizer("tiny-qwen3")
    prompts = [tokenizer(p)["input_ids"] for p in ("2 + 3 =", "what is 7 - 4? Think first.", "9 - 1 = ?")]
    params = SamplingParams(n=3, max_new_tokens=24, seed=7)
    got = {}
    for kernel in (True, False):
        engine = StaticCacheEngine(model, tokenizer, 9, torch.device("cpu"), torch.float32, max_len=64,
                                   free_after_generate=False, kv_dtype=decode_attention.FP8)
        engine.kernel_attention = kernel
        engine.load_weights(model)
        got[kernel] = engine.generate(prompts, params, first_row=5)
        assert engine.cache[0][0].dtype == decode_attention.FP8 and engine.cache[0][0].element_size() == 1
    assert torch.equal(got[True].responses, got[False].responses)
    assert got[True].finish_reasons == got[False].finish_reasons
    stored = engine._storable(torch.tensor([1000.0, -1e9, 0.3]))
    assert stored.dtype == decode_attention.FP8 and stored.float().tolist() == [448.0, -448.0, 0.3125]


class _Replies(Environment):
    def step(self, assistant_text):
        return Step(observation=[{"role": "user", "content": "Go on, please."}])


def test_episodes_on_the_kernel_append_each_turn_to_the_cache_as_a_whole_prefill_would_give():
    # Each row's slot is its own: rows of different lengths decode side by side, and a finished episode's
    # row starts the next one from slot 0.
    model = load_model("tiny-qwen3", torch.device("cpu")).eval()
    tokenizer = load_tokenizer("tiny-qwen3")
    engine = StaticCacheEngine(model, tokenizer, 2, torch.device("cpu"), torch.float32, max_len=64,
                               free_after_generate=False)
    engine.kernel_attention = True
    engine.load_weights(model)
    renderer = ChatRenderer(tokenizer, [], [tokenizer.eos_token_id])
    rows = [{"messages": [{"role": "user", "content": q}]} for q in ("2 + 3 =", "what is 7 - 4? Think first.", "9?")]
    params = SamplingParams(n=1, max_new_tokens=120, ignore_eos=True, seed=2)
    limits = TurnLimits(120, 3, 3, 5.0, max_tokens_per_turn=7)
    kept = play_episodes(engine, tokenizer, renderer, [_Replies() for _ in rows], rows, params, limits)
    whole = run_episodes(HFGenerateEngine(model, tokenizer).generate, tokenizer, renderer,
                         [_Replies() for _ in rows], rows, params, limits)
    assert [e.ids for e in kept] == [e.ids for e in whole]
    assert [e.assistant_turns for e in kept] == [3, 3, 3]
