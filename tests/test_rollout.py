"""The rollout batch layout that every later phase depends on."""

from __future__ import annotations

import torch

from backend.models import load_model
from backend.rollout import HFGenerateEngine, SamplingParams, left_pad, response_mask_from_eos


def test_response_mask_covers_tokens_up_to_and_including_the_first_eos():
    responses = torch.tensor([[5, 6, 2, 2, 9], [5, 2, 7, 2, 0], [5, 6, 7, 8, 9]])
    mask, finish = response_mask_from_eos(responses, eos_ids=[2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert finish == ["stop", "stop", "length"]


def test_left_pad_aligns_prompts_on_the_right():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_engine_returns_n_adjacent_samples_per_prompt_with_consistent_masks(tiny_tokenizer):
    model = load_model("tiny-qwen3", torch.device("cpu"))
    engine = HFGenerateEngine(model, tiny_tokenizer, batch_size=3)
    prompts = [tiny_tokenizer("2 + 3 =")["input_ids"], tiny_tokenizer("what is 7 - 4?")["input_ids"]]
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6))
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.responses.shape[0] == 6 and batch.responses.shape[1] <= 6
    width = batch.input_ids.shape[1]
    assert batch.attention_mask.shape == (6, width)
    assert torch.equal(batch.input_ids[:, batch.prompt_length:], batch.responses)
    assert torch.equal(batch.attention_mask[:, batch.prompt_length:], batch.response_mask)
    assert int(batch.attention_mask[3, : batch.prompt_length].sum()) == len(prompts[1])
    for row, reason in enumerate(batch.finish_reasons):
        assert reason == ("stop" if (batch.responses[row] == tiny_tokenizer.eos_token_id).any() else "length")


def test_greedy_generation_is_deterministic(tiny_tokenizer):
    model = load_model("tiny-llama", torch.device("cpu"))
    engine = HFGenerateEngine(model, tiny_tokenizer)
    prompt = [tiny_tokenizer("Tom has 3 apples")["input_ids"]]
    a = engine.generate(prompt, SamplingParams(n=2, max_new_tokens=5, greedy=True))
    b = engine.generate(prompt, SamplingParams(n=2, max_new_tokens=5, greedy=True))
    assert torch.equal(a.responses, b.responses)
    assert torch.equal(a.responses[0], a.responses[1])
