"""The worker's actor and reference: log-probs on padded batches, and an update that moves every weight."""

from __future__ import annotations

import pytest
import torch

from backend.algos.losses import entropy_from_logits
from backend.core.config import load_config, to_dict
from backend.core.models import load_model
from backend.engine import distributed, log_probs
from backend.engine.distributed import local_meeting_point
from backend.engine.log_probs import (
    _over_positions,
    _plain_head,
    _vocab_backward,
    _vocab_backward_eager,
    _vocab_forward,
    head_token_log_probs,
    response_log_probs,
    token_log_probs,
)
from backend.engine.rank import COMPILED_WIDTH_MULTIPLE, CompileLedger, MicroBatches
from backend.engine.workers import ActorRolloutRefWorker
from backend.rollout.base import SamplingParams, StaleWeightsError, left_pad
from backend.rollout.static_cache import StaticCacheEngine

from .conftest import tiny_overrides


def padded_batch(tokenizer):
    prompts = [tokenizer("1 + 2 =")["input_ids"], tokenizer("a much longer prompt: 7 - 4 =")["input_ids"]]
    responses = torch.tensor([[30, 31, 32, tokenizer.pad_token_id], [40, 41, 42, 43]])
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    return prompts, {"input_ids": torch.cat([prompt_ids, responses], 1),
                     "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                     "responses": responses, "response_mask": response_mask}


def test_response_log_probs_of_a_left_padded_row_equal_those_of_the_row_alone(tiny_tokenizer):
    model = load_model("tiny-qwen3", torch.device("cpu")).eval()
    prompts, batch = padded_batch(tiny_tokenizer)
    padded, _ = response_log_probs(model, batch["input_ids"], batch["attention_mask"], 4)
    alone = torch.tensor([prompts[0] + [30, 31, 32]])
    logits = model(alone).logits[0, len(prompts[0]) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor([[30], [31], [32]])).squeeze(-1)
    torch.testing.assert_close(padded[0, :3], expected, atol=1e-5, rtol=1e-5)


def test_temperature_scales_logits_before_the_softmax(tiny_tokenizer):
    model = load_model("tiny-llama", torch.device("cpu")).eval()
    _, batch = padded_batch(tiny_tokenizer)
    cold, _ = response_log_probs(model, batch["input_ids"], batch["attention_mask"], 4, temperature=0.5)
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits[:, -5:-1]
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(cold, expected, atol=1e-5, rtol=1e-5)


def one_rank_worker(cfg) -> ActorRolloutRefWorker:
    """A worker in this process, as rank 0 of a one-process gloo group (the path a one-worker run takes)."""
    return ActorRolloutRefWorker(to_dict(cfg), 0, 1, *local_meeting_point(), "cpu", total_steps=1)


def full_params(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.named_parameters()}


def test_token_mean_weighs_every_token_alike_whichever_micro_batch_it_falls_in(sample_sets, tiny_tokenizer):
    """Rows of 3 and 4 tokens with advantages +1 and -1, on-policy (ratio 1): the token-mean loss is
    -(3 - 4) / 7 = 1/7 whether the mini-batch runs as one micro-batch or as two, and so is its gradient. A
    mean per micro-batch weighted by its rows would give (-1 + 1) / 2 = 0 for the two. Micro-batches widened
    into the padding (as compiled layers get them) change nothing either."""
    def update(micro: int, widened: bool = False) -> dict[str, float]:
        cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.actor.ppo_mini_batch_size": 1,
                                                              "actor_rollout_ref.rollout.n": 2,
                                                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu":
                                                                  micro}))
        worker = one_rank_worker(cfg)
        worker.width_multiple = COMPILED_WIDTH_MULTIPLE if widened else 1
        _, batch = padded_batch(tiny_tokenizer)
        batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
        batch["advantages"] = torch.tensor([[1.0] * 4, [-1.0] * 4])
        metrics, _ = worker.update_actor(batch, mini_rows=2)
        worker.shutdown()
        return metrics

    whole, split, widened = update(2), update(1), update(1, widened=True)
    for metrics in (whole, split, widened):
        assert metrics["actor/pg_loss"] == pytest.approx(1 / 7, abs=1e-6)
    assert split["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-5)
    assert widened["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-5)


def test_one_update_changes_every_trainable_parameter_and_not_the_reference(sample_sets, tiny_tokenizer):
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.actor.ppo_mini_batch_size": 1,
                                                          "actor_rollout_ref.rollout.n": 2,
                                                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}))
    worker = one_rank_worker(cfg)
    before, ref_before = full_params(worker.actor), full_params(worker.ref)
    _, batch = padded_batch(tiny_tokenizer)
    batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
    batch["advantages"] = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    metrics, _ = worker.update_actor(batch, mini_rows=2)
    after = full_params(worker.actor)
    assert [k for k in after if torch.equal(after[k], before[k])] == []
    assert all(torch.equal(v, ref_before[k]) for k, v in full_params(worker.ref).items())
    assert metrics["actor/pg_clipfrac"] == 0.0  # on-policy: the ratio is exactly 1
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


@pytest.mark.parametrize("micro", [1, 4])
def test_the_update_hands_back_log_probs_of_marked_rows_before_and_after_it_as_passes_of_their_own(
        sample_sets, tiny_tokenizer, micro):
    """What the token view reads when a step takes one optimizer step: as "before", the update's own first
    forward of the rows marked with token_row (in mark order, whatever order the rows came in), equal to
    a log-prob pass before the update; as "after", a pass at the update's end, equal to one after it. With
    4 rows a micro-batch, a 3-token response shares it with 4-token ones: 0 past its end, as a pass gives."""
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.actor.ppo_mini_batch_size": 2,
                                                          "actor_rollout_ref.rollout.n": 2,
                                                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu":
                                                              micro}))
    worker = one_rank_worker(cfg)
    _, batch = padded_batch(tiny_tokenizer)
    batch = {k: torch.cat([v, v.flip(0)]) for k, v in batch.items()}  # 4 rows, one optimizer step
    batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
    batch["advantages"] = torch.tensor([[1.0] * 4, [-1.0] * 4, [0.5] * 4, [-2.0] * 4])
    expected_lp, expected_ent = worker.compute_log_prob(batch)
    batch["token_row"] = torch.tensor([-1, 1, -1, 0])  # the token view's rows 0 and 1 are rows 3 and 1
    _, marked = worker.update_actor(dict(batch), mini_rows=4)
    assert marked.rows.tolist() == [0, 1]
    torch.testing.assert_close(marked.before, expected_lp[[3, 1]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(marked.entropy, expected_ent[[3, 1]], atol=1e-5, rtol=1e-5)
    # "after" is under the updated weights: what a pass of its own gives now, and not what was before.
    updated, _ = worker.compute_log_prob(batch)
    torch.testing.assert_close(marked.after, updated[[3, 1]], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(marked.after, expected_lp[[3, 1]])


def test_gathering_once_per_phase_on_one_rank_updates_exactly_as_gathering_layer_by_layer(sample_sets, tiny_tokenizer,
                                                                                          monkeypatch):
    """One rank keeps the model, one FSDP unit, gathered through a mini-batch and reduces gradients at its
    last micro-batch only; the weights, metrics and the log-probs after the optimizer step (which must see
    the new weights, not a stale gathered copy) are those of FSDP's usual unit per layer, each gathered
    and freed around its own forward and backward."""
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.actor.ppo_mini_batch_size": 1,
                                                          "actor_rollout_ref.rollout.n": 2,
                                                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}))
    once = one_rank_worker(cfg)
    monkeypatch.setattr(distributed, "gathers_once", lambda world_size, offload: False)
    layerwise = one_rank_worker(cfg)
    assert once.gather_once and not layerwise.gather_once
    assert len(distributed.fsdp_modules(once.actor)) == 1
    assert len(distributed.fsdp_modules(layerwise.actor)) == 1 + len(layerwise.actor.model.layers)
    _, batch = padded_batch(tiny_tokenizer)
    batch = {k: torch.cat([v, v.flip(0)]) for k, v in batch.items()}  # 4 rows: 2 optimizer steps of 2 micro-batches
    batch["advantages"] = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, -1.0],
                                        [0.5, 0.5, 0.5, 0.5], [-2.0, -2.0, -2.0, 0.0]])
    results = []
    for worker in (once, layerwise):
        batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
        metrics, _ = worker.update_actor(dict(batch), mini_rows=2)
        results.append((full_params(worker.actor), metrics, worker.compute_log_prob(batch)[0]))
    (params_a, metrics_a, lp_a), (params_b, metrics_b, lp_b) = results
    for k in params_a:
        torch.testing.assert_close(params_a[k], params_b[k], atol=1e-6, rtol=1e-5)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert abs(metrics_a[k] - metrics_b[k]) <= 1e-5 * max(1.0, abs(metrics_b[k])), k
    torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lp_a, batch["ref_log_probs"])  # the update moved them


def test_actor_log_probs_match_the_reference_before_any_update(sample_sets, tiny_tokenizer):
    worker = one_rank_worker(load_config(None, tiny_overrides(sample_sets)))
    _, batch = padded_batch(tiny_tokenizer)
    log_probs, entropy = worker.compute_log_prob(batch)
    torch.testing.assert_close(log_probs, worker.compute_ref_log_prob(batch))
    inside = batch["response_mask"].bool()
    assert entropy.shape == log_probs.shape
    assert bool((entropy[inside] > 0).all()) and bool((entropy[~inside] == 0).all())


@pytest.mark.parametrize("cut", ["rows", "tokens", "widened"])
def test_log_probs_by_micro_batches_of_single_rows_are_the_whole_batchs_on_every_response_token(
        sample_sets, tiny_tokenizer, cut):
    """Each row alone, cut to its own columns (by rows, by a budget only one row fits in, or widened to 8
    columns as for compiled layers), gives the log-probs the whole padded batch gives; positions past a
    row's response are 0."""
    one = {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1}
    if cut == "tokens":
        one = {"actor_rollout_ref.actor.use_dynamic_bsz": "true", "data.max_prompt_length": 28,
               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 36}
    worker = one_rank_worker(load_config(None, tiny_overrides(sample_sets, **one)))
    if cut == "widened":
        worker.width_multiple = COMPILED_WIDTH_MULTIPLE
    _, batch = padded_batch(tiny_tokenizer)
    plain = load_model("tiny-qwen3", torch.device("cpu")).eval()
    expected, _ = response_log_probs(plain, batch["input_ids"], batch["attention_mask"], 4)
    expected = expected * batch["response_mask"]
    actor, entropy = worker.compute_log_prob(batch)
    torch.testing.assert_close(actor, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(worker.compute_ref_log_prob(batch), expected, atol=1e-5, rtol=1e-5)
    assert entropy[0, 3] == 0 and bool((entropy[batch["response_mask"].bool()] > 0).all())


def test_the_sharded_actor_computes_the_log_probs_of_the_plain_model(sample_sets, tiny_tokenizer):
    worker = one_rank_worker(load_config(None, tiny_overrides(sample_sets)))
    _, batch = padded_batch(tiny_tokenizer)
    plain = load_model("tiny-qwen3", torch.device("cpu")).eval()
    expected, _ = response_log_probs(plain, batch["input_ids"], batch["attention_mask"], 4)
    torch.testing.assert_close(worker.compute_log_prob(batch)[0], expected * batch["response_mask"], atol=1e-5,
                               rtol=1e-5)


def lengths_mask(prompts: list[int], responses: list[int], prompt_width: int, response_width: int) -> torch.Tensor:
    """An attention mask of left-padded prompts and right-padded responses of these lengths."""
    return torch.stack([torch.cat([torch.arange(prompt_width) >= prompt_width - p, torch.arange(response_width) < r])
                        for p, r in zip(prompts, responses, strict=True)]).long()


def test_the_compile_ledger_counts_a_first_compile_and_a_recompile_for_new_shapes_and_nothing_for_repeats():
    # The step metrics perf/compile_s and perf/compiled_graphs come from this ledger: a step that compiled is
    # told apart from a slow one. The eager backend: dynamo traces and records as it does before inductor.
    fn = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False)
    ledger = CompileLedger()
    fn(torch.ones(3))
    first = ledger.take()
    assert first["perf/compiled_graphs"] == 1 and first["perf/compile_s"] > 0
    fn(torch.ones(3))
    assert ledger.take() == {"perf/compile_s": 0.0, "perf/compiled_graphs": 0.0}
    fn(torch.ones(4))  # a new shape: the graph's guards fail and it compiles again
    assert ledger.take()["perf/compiled_graphs"] == 1


def test_micro_batches_hold_rows_of_similar_length_each_cut_to_the_columns_its_rows_use():
    mask = lengths_mask([2, 5, 3, 1, 4], [1, 6, 2, 6, 3], prompt_width=6, response_width=7)
    batch = {"input_ids": torch.arange(5 * 13).view(5, 13), "attention_mask": mask,
             "response_mask": mask[:, 6:], "token_row": torch.arange(5)}
    plan = MicroBatches(mask, response_len=7, rows=2)
    parts = list(plan.split(batch))
    # Longest first: rows 1 (11) and 3 (7), rows 4 (7) and 2 (5), row 0 (3).
    assert [mb["token_row"].tolist() for mb, _ in parts] == [[1, 3], [4, 2], [0]]
    assert [(tuple(mb["input_ids"].shape), r) for mb, r in parts] == [((2, 11), 6), ((2, 7), 3), ((1, 3), 1)]
    for mb, r in parts:  # every real token kept, in place: the cut drops padding only
        for i, row in enumerate(mb["token_row"].tolist()):
            kept = mb["input_ids"][i][mb["attention_mask"][i].bool()]
            assert torch.equal(kept, batch["input_ids"][row][mask[row].bool()])
        assert mb["response_mask"].shape == (len(mb["token_row"]), r)
    joined = plan.join([mb["response_mask"].float() * (mb["token_row"][:, None] + 1) for mb, _ in parts], 7)
    assert torch.equal(joined, mask[:, 6:].float() * (torch.arange(5)[:, None] + 1))


def test_micro_batches_for_compiled_layers_are_widened_to_multiples_of_8_columns_past_the_batch_if_need_be():
    """Compiled layers specialise on a width's divisibility by 8; a cut is widened into the padding, left of
    the prompts first, then right of the responses, then past the batch's last column with masked zeros; no
    token moves and the joined outputs are the batch's."""
    mask = lengths_mask([2, 5, 3, 1, 4], [1, 6, 2, 6, 3], prompt_width=6, response_width=7)
    batch = {"input_ids": torch.arange(1, 5 * 13 + 1).view(5, 13), "attention_mask": mask,
             "response_mask": mask[:, 6:], "token_row": torch.arange(5)}
    plan = MicroBatches(mask, response_len=7, rows=2, width_multiple=COMPILED_WIDTH_MULTIPLE)
    parts = list(plan.split(batch))
    # Used widths 11, 7 and 3, all widened to multiples of 8: the first to 16, one column left (all its prompts'
    # padding) and 3 past the batch's 13; the last 1 column right of its response, its prompt's padding being 4.
    assert [(tuple(mb["input_ids"].shape), r) for mb, r in parts] == [((2, 16), 10), ((2, 8), 3), ((1, 8), 2)]
    for mb, r in parts:
        assert mb["response_mask"].shape == (len(mb["token_row"]), r)
        inside, extra = min(r, 7), max(r - 7, 0)  # response columns in the batch, and past its last
        for i, row in enumerate(mb["token_row"].tolist()):
            kept = mb["input_ids"][i][mb["attention_mask"][i].bool()]
            assert torch.equal(kept, batch["input_ids"][row][mask[row].bool()])
            assert torch.equal(mb["input_ids"][i, -r:][:inside], batch["input_ids"][row, 6:6 + inside])
        if extra:
            assert not any(mb[k][:, -extra:].any() for k in ("input_ids", "attention_mask", "response_mask"))
    joined = plan.join([mb["response_mask"].float() * (mb["token_row"][:, None] + 1) for mb, _ in parts], 7)
    assert torch.equal(joined, mask[:, 6:].float() * (torch.arange(5)[:, None] + 1))


def test_micro_batches_by_tokens_hold_what_fits_in_the_budget_and_split_further_when_ranks_need_more():
    mask = lengths_mask([3] * 8, [1, 8, 2, 8, 4, 4, 2, 1], prompt_width=4, response_width=8)
    plan = MicroBatches(mask, response_len=8, rows=100, max_tokens=24)
    widths = [(end - first, 3 + max(mask[plan.order[first:end], 4:].sum(-1).tolist())) for first, end in plan.spans]
    assert widths == [(2, 11), (3, 7), (3, 5)]
    assert all(n * w <= 24 for n, w in widths)
    assert sorted(plan.order.tolist()) == list(range(8))
    more = MicroBatches(mask, response_len=8, rows=100, max_tokens=24, at_least=5)
    assert len(more) == 5 and sum(end - first for first, end in more.spans) == 8


def test_chunked_log_probs_and_their_gradients_equal_a_whole_log_softmax(monkeypatch):
    monkeypatch.setattr(log_probs, "LOG_PROB_CHUNK_TOKENS", 10)  # 2 rows of 5 positions a chunk
    logits = torch.randn(5, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (5, 5))
    weights = torch.randn(5, 5)
    lp, ent = token_log_probs(logits, targets, temperature=0.7, with_entropy=True)
    (lp * weights).sum().backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    whole = torch.log_softmax(logits / 0.7, -1)
    expected = whole.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    torch.testing.assert_close(lp, expected)
    torch.testing.assert_close(ent, -(whole.exp() * whole).sum(-1).detach())
    torch.testing.assert_close(chunked_grad, logits.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy_grad", [False, True])
def test_the_eager_vocabulary_backward_gives_the_compiled_forms_gradient_and_leaves_the_logits_alone(
        dtype, temperature, with_entropy_grad):
    logits = (torch.randn(3, 4, 50) * 4).to(dtype)
    kept = logits.clone()
    targets = torch.randint(0, 50, (3, 4))
    log_prob, entropy, lse = _vocab_forward(logits, targets, temperature, True)
    z = logits.float() / temperature
    torch.testing.assert_close(lse, torch.logsumexp(z, -1))
    torch.testing.assert_close(log_prob, torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    grads = torch.randn(3, 4), torch.randn(3, 4) if with_entropy_grad else None
    got = _vocab_backward_eager(logits, targets, temperature, lse, entropy, *grads)
    assert got.dtype == dtype and torch.equal(logits, kept)
    want = _vocab_backward(logits, targets, temperature, lse, entropy, *grads)
    tolerance = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_the_entropy_bonus_gradient_equals_that_of_a_whole_softmax(monkeypatch):
    monkeypatch.setattr(log_probs, "LOG_PROB_CHUNK_TOKENS", 6)  # chunks of 2 rows, the last one shorter
    logits = torch.randn(5, 3, 7, requires_grad=True)
    targets = torch.randint(0, 7, (5, 3))
    w_lp, w_ent = torch.randn(5, 3), torch.randn(5, 3)
    lp, ent = token_log_probs(logits, targets, temperature=1.3, with_entropy=True, entropy_grad=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    fused_grad = logits.grad.clone()
    logits.grad = None
    whole = torch.log_softmax(logits / 1.3, -1)
    expected_lp = whole.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_ent = entropy_from_logits(logits / 1.3)
    ((expected_lp * w_lp).sum() + (expected_ent * w_ent).sum()).backward()
    torch.testing.assert_close(ent, expected_ent)
    torch.testing.assert_close(fused_grad, logits.grad)


def test_the_head_fused_into_the_vocabulary_pass_gives_the_log_probs_and_gradients_of_whole_logits(monkeypatch):
    monkeypatch.setattr(log_probs, "LOG_PROB_CHUNK_TOKENS", 6)  # chunks of 2 rows, the last one shorter
    hidden = torch.randn(5, 3, 4, requires_grad=True)
    weight = torch.randn(7, 4, requires_grad=True)
    targets = torch.randint(0, 7, (5, 3))
    w_lp, w_ent = torch.randn(5, 3), torch.randn(5, 3)
    lp, ent = head_token_log_probs(hidden, weight, targets, temperature=0.8, with_entropy=True,
                                         entropy_grad=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    fused = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected_lp, expected_ent = token_log_probs(hidden @ weight.T, targets, temperature=0.8, with_entropy=True,
                                                      entropy_grad=True)
    ((expected_lp * w_lp).sum() + (expected_ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, expected_lp)
    torch.testing.assert_close(ent, expected_ent)
    torch.testing.assert_close(fused[0], hidden.grad)
    torch.testing.assert_close(fused[1], weight.grad)


def test_the_compiled_vocabulary_pass_is_one_graph_for_chunks_of_any_size_with_the_vocabulary_constant():
    """What `compiled=True` runs on GPUs, traced here by a backend that records each graph's input shapes:
    the positions are symbolic and the vocabulary is not (a symbolic vocabulary made the backward's index
    arithmetic per element its cost), and the results are the eager functions'."""
    graphs: list[list[tuple]] = []

    def recording(gm, example_inputs):
        graphs.append([tuple(n.meta["example_value"].shape) for n in gm.graph.nodes
                       if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)])
        return gm.forward

    forward = _over_positions(torch.compile(_vocab_forward, backend=recording))
    backward = _over_positions(torch.compile(_vocab_backward, backend=recording))
    for rows, r in ((3, 5), (2, 7), (4, 1)):
        logits, targets = torch.randn(rows, r, 11), torch.randint(0, 11, (rows, r))
        got = forward(logits, targets, 0.7, True)
        for a, b in zip(got, _vocab_forward(logits, targets, 0.7, True), strict=True):
            torch.testing.assert_close(a, b)
        grads = torch.randn(rows, r), torch.randn(rows, r)
        torch.testing.assert_close(backward(logits, targets, 0.7, got[2], got[1], *grads),
                                   _vocab_backward(logits, targets, 0.7, got[2], got[1], *grads))
    assert len(graphs) == 2  # one forward and one backward for all three sizes
    for shapes in graphs:
        assert all(isinstance(shape[0], torch.SymInt) for shape in shapes)
    vocab = graphs[0][0][1]  # the forward's logits (positions, V)
    assert vocab == 11 and isinstance(vocab, int)


def test_a_model_whose_head_runs_in_the_vocabulary_pass_gets_the_gradients_of_its_full_logits(tiny_tokenizer):
    """response_log_probs never builds the (b, R, V) logits; every parameter, the tied head and
    embedding included, gets the gradient it gets through the model's own logits."""
    model = load_model("tiny-qwen3", torch.device("cpu"))
    assert _plain_head(model) is model.get_output_embeddings()
    _, batch = padded_batch(tiny_tokenizer)
    weights = torch.randn(2, 4)
    lp, _ = response_log_probs(model, batch["input_ids"], batch["attention_mask"], 4, temperature=0.9)
    (lp * weights).sum().backward()
    fused = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits[:, -5:-1]
    expected, _ = token_log_probs(logits, batch["responses"], temperature=0.9)
    (expected * weights).sum().backward()
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(fused[k], p.grad, atol=1e-5, rtol=1e-4, msg=k)
    assert model.get_output_embeddings().forward.__self__ is model.get_output_embeddings()  # forward restored


def test_without_an_entropy_bonus_the_entropy_carries_no_gradient_and_bf16_logits_get_a_bf16_gradient():
    logits = torch.randn(2, 4, 9, dtype=torch.bfloat16, requires_grad=True)
    lp, ent = token_log_probs(logits, torch.randint(0, 9, (2, 4)), with_entropy=True)
    assert lp.dtype == torch.float32 and not ent.requires_grad
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    # d/dz sum_t log softmax(z_t)[target_t] sums to 0 over the vocabulary at each position
    torch.testing.assert_close(logits.grad.float().sum(-1), torch.zeros(2, 4), atol=2e-2, rtol=0)


def test_a_weight_sync_that_skips_a_layer_fails_generation_naming_the_engine_and_the_tensors(
        sample_sets, tiny_tokenizer, monkeypatch):
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.rollout.name": "workbench"}))
    worker = one_rank_worker(cfg)
    sync, first = StaticCacheEngine.load_weights, {}

    def sync_skipping_layer_0(engine, model):
        """Layer 0 stays as the first sync left it (the engine frees its copy after generating, so the
        weights of the step before are kept here)."""
        sync(engine, model)
        for k, v in vars(engine.layers[0]).items():
            if isinstance(v, torch.Tensor):
                v.copy_(first.setdefault(k, v.clone()))

    monkeypatch.setattr(StaticCacheEngine, "load_weights", sync_skipping_layer_0)
    second_generation_is_stale(worker, tiny_tokenizer, r"after the weight sync the workbench engine's copy of 11 "
                                                       r"of the actor's tensors differs from the actor's: "
                                                       r"model\.layers\.0\.")


def second_generation_is_stale(worker: ActorRolloutRefWorker, tokenizer, match: str) -> None:
    """A first generation (its sync whole), every actor weight moved as an update would, then a generation whose
    sync the worker must find stale, raising what `match` says."""
    prompts = [tokenizer("1 + 2 =")["input_ids"]]
    params = SamplingParams(n=2, max_new_tokens=4, seed=1)
    assert worker.generate(prompts, params, first_row=0)["responses"].shape[0] == 2
    with torch.no_grad():
        for p in worker.actor.parameters():
            p.add_(torch.ones_like(p) * 1e-2)
    with pytest.raises(StaleWeightsError, match=match):
        worker.generate(prompts, params, first_row=2)


def test_a_worker_configured_for_an_fp8_kv_cache_generates_from_one(sample_sets, tiny_tokenizer):
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.rollout.name": "workbench",
                                                            "actor_rollout_ref.rollout.kv_cache_dtype": "fp8",
                                                            "actor_rollout_ref.rollout.free_cache_engine": False}))
    worker = one_rank_worker(cfg)
    batch = worker.generate([tiny_tokenizer("1 + 2 =")["input_ids"]], SamplingParams(n=2, max_new_tokens=4, seed=1),
                            first_row=0)
    assert batch["responses"].shape[0] == 2
    assert {t.dtype for pair in worker.rollout.cache for t in pair} == {torch.float8_e4m3fn}
