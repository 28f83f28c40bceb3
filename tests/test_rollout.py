"""The rollout batch layout that every later phase depends on."""

from __future__ import annotations

import torch

from backend.core.models import load_model
from backend.rollout import base
from backend.rollout.base import (
    CounterSampler,
    HFGenerateEngine,
    SamplingParams,
    assemble,
    concat_rows,
    counter_uniform,
    left_pad,
    response_mask_from_eos,
    sample_tokens,
    warp_logits,
)


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


def test_counter_noise_is_uniform_and_keyed_by_seed_row_and_position():
    u = counter_uniform(seed=3, rows=torch.arange(100_000), position=0)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    same = counter_uniform(seed=torch.tensor(3), rows=torch.tensor([7]), position=torch.tensor(0))
    assert torch.equal(same[0], u[7])
    for other in (counter_uniform(4, torch.tensor([7]), 0), counter_uniform(3, torch.tensor([7]), 1)):
        assert not torch.equal(other[0], u[7])


def test_counter_sampling_draws_tokens_with_the_softmax_probabilities():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0]]).repeat(40000, 1)
    params = SamplingParams(temperature=0.7, seed=5)
    tokens = CounterSampler(params, torch.arange(40000))(torch.zeros(40000, 3, dtype=torch.long), logits).argmax(-1)
    freq = torch.bincount(tokens, minlength=5).float() / 40000
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.01, rtol=0)


def test_the_two_level_inversion_picks_the_token_a_whole_cumulative_sum_picks():
    """invert_cdf (block sums, then one block) against a float64 cumulative sum over the whole vocabulary,
    on a vocabulary of two whole blocks and a tail, a third of the tokens at probability 0."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 4000, 2 * base.CDF_BLOCK + 300
    probs = torch.rand(rows, vocab, generator=gen) ** 4
    probs[torch.rand(rows, vocab, generator=gen) < 0.33] = 0.0
    probs[:50, : base.CDF_BLOCK] = 0.0  # whole blocks without mass
    probs[50:100, base.CDF_BLOCK:] = 0.0  # all mass in the first block
    u = torch.rand(rows, generator=gen)
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    picked = base.invert_cdf(probs, u)
    assert torch.equal(picked, expected)
    assert bool((probs.gather(-1, picked.unsqueeze(-1)) > 0).all())
    ends = base.invert_cdf(probs, torch.full((rows,), 1.0 - 2**-24))  # the very end of each row
    assert bool((probs.gather(-1, ends.unsqueeze(-1)) > 0).all())


def test_sampling_never_picks_a_token_that_top_k_cut():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(5000, 1)
    tokens = sample_tokens(logits, SamplingParams(top_k=2, seed=1), 1, torch.arange(5000), 0)
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_and_top_p_cut_the_tail_and_keep_the_likeliest_token():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(warp_logits(scores, 1.0, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(warp_logits(scores, 1.0, top_k=0, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(warp_logits(scores, 1.0, top_k=0, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_a_response_is_the_same_whichever_batch_generates_it(tiny_tokenizer):
    engine = HFGenerateEngine(load_model("tiny-qwen3", torch.device("cpu")), tiny_tokenizer, batch_size=64)
    prompts = [tiny_tokenizer(p)["input_ids"] for p in ("2 + 3 =", "what is 7 - 4?", "9 - 1 = ?")]
    params = SamplingParams(n=2, max_new_tokens=6, seed=11)
    whole = engine.generate(prompts, params)
    tail = engine.generate(prompts[1:], params, first_row=2)  # what a second worker would be given
    assert torch.equal(whole.responses[2:, :tail.responses.shape[1]], tail.responses)
    assert not torch.equal(whole.responses[0], whole.responses[1])  # two samples of one prompt differ


def test_rows_of_several_batches_concatenate_with_fresh_padding_and_renumbered_groups():
    pad = 0
    first = assemble([[5, 6], [7]], 2, [torch.tensor([1, 2, 9]), torch.tensor([3]), torch.tensor([4, 9]),
                                        torch.tensor([8, 8, 8])], eos_ids=[9], pad_id=pad)
    second = assemble([[11, 12, 13]], 2, [torch.tensor([21]), torch.tensor([22, 23, 24, 25])], eos_ids=[9],
                      pad_id=pad, ignore_eos=True)
    # keep the second group of the first batch and the only group of the second
    out = concat_rows([(first, torch.tensor([2, 3])), (second, torch.tensor([0, 1]))], pad)
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.responses.tolist() == [[4, 9, 0, 0], [8, 8, 8, 0], [21, 0, 0, 0], [22, 23, 24, 25]]
    assert out.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert out.input_ids[:, :3].tolist() == [[0, 0, 7], [0, 0, 7], [11, 12, 13], [11, 12, 13]]
    assert out.attention_mask[:, :3].tolist() == [[0, 0, 1], [0, 0, 1], [1, 1, 1], [1, 1, 1]]
    assert out.finish_reasons == ["stop", "length", "length", "length"]
