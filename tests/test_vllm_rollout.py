"""vLLM as the rollout engine, and the rollout importance-sampling correction it brings.

What runs everywhere: the validation messages, the mapping of our sampling settings to vLLM's, the
weights handed to vLLM (names and values, LoRA merged), the IS-weight math with hand-worked numbers, and
a real tiny-model worker update given a batch that carries rollout log-probs. What needs vLLM and a CUDA
GPU (skipped elsewhere, with the reason): sampling with the engine in Ray workers, and a training run.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from backend.algos.losses import get_policy_loss_fn, rollout_is_weights
from backend.core import lora
from backend.core.config import ConfigError, load_config, to_dict
from backend.core.models import load_model
from backend.core.vllm_support import INSTALL
from backend.engine import distributed
from backend.engine.worker_group import _merge
from backend.engine.workers import ActorRolloutRefWorker
from backend.rollout.base import RolloutBatch, SamplingParams, concat_rows
from backend.rollout.vllm_engine import (
    VLLMEngine,
    hf_weights,
    log_prob_rows,
    row_seed,
    sampling_kwargs,
    stale_in_engine,
    vllm_requests,
)

from .conftest import tiny_overrides
from .test_workers import one_rank_worker, padded_batch, second_generation_is_stale

# ---- validation ----


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return e.value.problems


def test_choosing_vllm_where_it_is_not_installed_fails_validation_with_the_install_command():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; the message for a missing vLLM is checked where it is not")
    problems = _problems("actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda")
    assert any("needs vLLM, which is not installed" in p and INSTALL in p for p in problems), problems
    assert INSTALL == "pip install 'grpo-workbench[vllm]'"


def test_choosing_vllm_with_trainer_device_cpu_fails_validation_saying_it_needs_cuda():
    problems = _problems("actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu")
    assert any("runs on CUDA GPUs only" in p and "trainer.device=cpu" in p for p in problems), problems


def test_vllm_refuses_a_temperature_above_two_at_validation():
    problems = _problems("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.temperature=2.5")
    assert any("temperature=2.5 is above 2" in p for p in problems), problems


def test_gpu_memory_utilization_must_lie_strictly_between_zero_and_one():
    assert any("gpu_memory_utilization=1.0 must be in (0, 1)" in p
               for p in _problems("actor_rollout_ref.rollout.gpu_memory_utilization=1.0"))
    assert any("gpu_memory_utilization=0.0 must be > 0" in p
               for p in _problems("actor_rollout_ref.rollout.gpu_memory_utilization=0"))
    assert load_config(None, []).actor_rollout_ref.rollout.gpu_memory_utilization == 0.5


def test_rollout_correction_keys_take_verl_spellings_and_null_turns_it_off():
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=null",
                             "algorithm.rollout_correction.rollout_is_threshold=3"])
    assert cfg.algorithm.rollout_correction.rollout_is is None
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 3.0
    defaults = load_config(None, []).algorithm.rollout_correction
    assert (defaults.rollout_is, defaults.rollout_is_threshold) == ("token", 2.0)
    assert any("rollout_is='sequence' is not allowed" in p
               for p in _problems("algorithm.rollout_correction.rollout_is=sequence"))


# ---- sampling settings and requests ----


def test_sampling_kwargs_map_our_settings_to_vllm_with_eos_stops_and_the_sampled_token_log_prob():
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=32, seed=11)
    kwargs = sampling_kwargs(params, eos_ids=[2, 7], row=5)
    assert kwargs == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 32, "ignore_eos": False,
                      "stop_token_ids": [2, 7], "seed": row_seed(11, 5), "logprobs": 0, "detokenize": False}
    assert sampling_kwargs(SamplingParams(top_k=20), [2], 0)["top_k"] == 20


def test_greedy_is_temperature_zero_and_ignore_eos_drops_the_stop_tokens():
    greedy = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.5, top_k=3, greedy=True), [2], 0)
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0)
    fixed = sampling_kwargs(SamplingParams(ignore_eos=True, max_new_tokens=9), [2, 7], 0)
    assert fixed["ignore_eos"] is True and fixed["stop_token_ids"] == [] and fixed["max_tokens"] == 9


def test_each_response_row_is_a_request_whose_seed_depends_only_on_the_step_seed_and_its_global_row():
    params = SamplingParams(n=3, seed=123)
    whole = vllm_requests([[1, 2], [3]], params, [0])
    assert [prompt["prompt_token_ids"] for prompt, _ in whole] == [[1, 2]] * 3 + [[3]] * 3  # prompt-major
    seeds = [kwargs["seed"] for _, kwargs in whole]
    assert len(set(seeds)) == 6 and all(0 <= s < 2**63 for s in seeds)
    # A worker given the second prompt alone (its rows are global rows 3..5) draws with the same seeds.
    assert [kwargs["seed"] for _, kwargs in vllm_requests([[3]], params, [0], first_row=3)] == seeds[3:]
    # Another step (seed) gets other seeds for the same rows, and neighbouring steps do not share any.
    assert set(seeds).isdisjoint(row_seed(124, r) for r in range(6))


def test_a_row_asks_vllm_for_no_more_tokens_than_the_context_leaves_after_its_prompt():
    # A lockstep episode turn asks every row for the longest budget; a row with a longer prefix must not
    # ask past vLLM's max_model_len, which refuses such a request and ends the generation.
    requests = vllm_requests([[1] * 90, [1] * 20], SamplingParams(max_new_tokens=50), [0], max_model_len=100)
    assert [kwargs["max_tokens"] for _, kwargs in requests] == [10, 50]


def test_log_prob_rows_lay_the_engine_log_probs_out_as_the_responses_with_zeros_at_padding():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = log_prob_rows([torch.tensor([-0.5, -1.0]), torch.tensor([-0.1, -0.2, -0.3])], mask)
    torch.testing.assert_close(out, torch.tensor([[-0.5, -1.0, 0.0], [-0.1, -0.2, -0.3]]))
    assert out.dtype == torch.float32


def test_dynamic_sampling_keeps_each_chosen_rows_rollout_log_probs():
    def batch(responses, lps):
        mask = (torch.tensor(responses) != 0).long()
        return RolloutBatch(input_ids=torch.cat([torch.ones_like(mask), torch.tensor(responses)], 1),
                            attention_mask=torch.cat([torch.ones_like(mask), mask], 1),
                            responses=torch.tensor(responses), response_mask=mask,
                            prompt_index=torch.arange(len(responses)), finish_reasons=["stop"] * len(responses),
                            rollout_log_probs=torch.tensor(lps) * mask)

    a = batch([[5, 6, 0], [7, 0, 0]], [[-1.0, -2.0, 9.0], [-3.0, 9.0, 9.0]])
    b = batch([[8, 9, 4, 3]], [[-4.0, -5.0, -6.0, -7.0]])
    merged = concat_rows([(a, torch.tensor([1])), (b, torch.tensor([0]))], pad_id=0)
    torch.testing.assert_close(merged.rollout_log_probs, torch.tensor([[-3.0, 0, 0, 0], [-4.0, -5.0, -6.0, -7.0]]))
    without = RolloutBatch(**{**a.__dict__, "rollout_log_probs": None})
    assert concat_rows([(without, torch.tensor([0]))], pad_id=0).rollout_log_probs is None


# ---- the weights vLLM is given ----


def test_the_gathered_sharded_actor_hands_vllm_the_plain_models_weights_under_hugging_face_names(sample_sets):
    worker = one_rank_worker(load_config(None, tiny_overrides(sample_sets)))
    plain = load_model("tiny-qwen3", torch.device("cpu"))
    expected = dict(plain.named_parameters())  # tied lm_head comes once, as the embedding
    with distributed.unsharded(worker.actor):  # the gathered tensors live only inside this block
        given = dict(hf_weights(worker.actor))
        assert sorted(given) == sorted(expected)
        for name, tensor in given.items():
            assert not isinstance(tensor, torch.distributed.tensor.DTensor), name
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    worker.shutdown()


def test_a_lora_model_hands_vllm_its_merged_weights_without_the_adapters():
    model = lora.wrap(load_model("tiny-qwen3", torch.device("cpu")), rank=4, alpha=8.0, target_modules=["all-linear"])
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # adapters that change the weights (B starts at 0)
    merged = lora.merge_state_dict(dict(model.state_dict()), rank=4, alpha=8.0)  # what export writes
    given = dict(hf_weights(model))
    assert not any("lora_" in name or "base_layer" in name for name in given)
    assert sorted(given) == sorted(k for k in merged if k != "lm_head.weight")  # tied to the embedding
    for name, tensor in given.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-5, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(given[q], dict(load_model("tiny-qwen3", torch.device("cpu")).named_parameters())[q])


def _vllm_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters vLLM's Qwen3 model holds for these Hugging Face weights, as its loader lays them out on
    one GPU: q, k, v stacked into qkv_proj, gate and up into gate_up_proj, the vocabulary padded, bf16."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        for part, stacked in (("q_proj", "qkv_proj"), ("k_proj", None), ("v_proj", None),
                              ("gate_proj", "gate_up_proj"), ("up_proj", None)):
            if f".{part}." in name:
                if stacked is not None:
                    rest = ("k_proj", "v_proj") if part == "q_proj" else ("up_proj",)
                    parts = [tensor] + [weights[name.replace(part, r)] for r in rest]
                    out[name.replace(part, stacked)] = torch.cat(parts).to(torch.bfloat16)
                break
        else:
            if name == "model.embed_tokens.weight":
                tensor = torch.cat([tensor, torch.zeros(5, tensor.shape[1])])
            out[name] = tensor.to(torch.bfloat16)
    return out


def test_the_weight_check_finds_each_tensor_in_vllms_stacked_parameters_and_names_those_a_sync_left_behind():
    model = load_model("tiny-qwen3", torch.device("cpu"))
    engine = _vllm_layout(dict(hf_weights(model)))
    assert "model.layers.1.self_attn.qkv_proj.weight" in engine and "model.layers.1.mlp.gate_up_proj.weight" in engine
    assert stale_in_engine(engine, hf_weights(model)) == []
    before = {k: v.clone() for k, v in engine.items()}
    with torch.no_grad():  # an update, then a push that skipped layer 1's k and up projections
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    engine = _vllm_layout(dict(hf_weights(model)))
    assert stale_in_engine(engine, hf_weights(model)) == []
    q_rows = model.model.layers[1].self_attn.q_proj.weight.shape[0]
    k_rows = model.model.layers[1].self_attn.k_proj.weight.shape[0]
    qkv, gate_up = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    engine[qkv][q_rows:q_rows + k_rows] = before[qkv][q_rows:q_rows + k_rows]
    gate_rows = model.model.layers[1].mlp.gate_proj.weight.shape[0]
    engine[gate_up][gate_rows:] = before[gate_up][gate_rows:]
    engine["model.norm.weight"] = before["model.norm.weight"]
    assert stale_in_engine(engine, hf_weights(model)) == [
        "model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]


# ---- the importance-sampling math ----


def test_rollout_is_weights_are_the_capped_detached_ratio_and_padding_counts_nowhere():
    # old - rollout = log r with r = [[0.5, 1, 5, pad], [1.5, 0.25, pad, pad]]; cap 2
    r = torch.tensor([[0.5, 1.0, 5.0, 1.0], [1.5, 0.25, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, float("nan")], [-3.0, -0.2, 0.0, 0.0]], requires_grad=True)
    rollout = (old.detach() - r.log()).masked_fill(mask == 0, float("-inf"))  # garbage at padding
    weights, metrics = rollout_is_weights(old, rollout, mask, threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.0, 2.0, 0.0], [1.5, 0.25, 0.0, 0.0]]))
    assert not weights.requires_grad
    # 5 valid tokens: |log r| = ln 2, 0, ln 5, ln 1.5, ln 4; capped weights 0.5, 1, 2, 1.5, 0.25
    diff = (math.log(2) + math.log(5) + math.log(1.5) + math.log(4)) / 5
    assert metrics["rollout/log_prob_diff_mean"].item() == pytest.approx(diff, rel=1e-6)
    assert metrics["rollout/is_weight_mean"].item() == pytest.approx(5.25 / 5, rel=1e-6)
    assert metrics["rollout/is_weight_max"].item() == pytest.approx(2.0)
    assert metrics["rollout/is_clipfrac"].item() == pytest.approx(1 / 5)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_the_policy_losses_multiply_each_tokens_loss_by_the_rollout_is_weight(loss_mode):
    # On-policy (old = logp) every ratio is 1, so each token's loss is -A, and with weights -A w.
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = torch.tensor([[0.5, 2.0, 7.0], [1.0, 0.25, 1.5]])
    loss, _ = get_policy_loss_fn(loss_mode)(logp.detach(), logp, adv, mask, loss_agg_mode="token-mean",
                                                  rollout_is_weights=w)
    # token-mean over the 5 valid tokens of -A w: (-0.5 - 2 + 2 + 0.5 + 3) / 5
    assert loss.item() == pytest.approx(3.0 / 5)
    loss.backward()
    # d/d logp_t of -A_t w_t rho_t at rho = 1 is -A_t w_t / 5 on valid tokens (GSPO-token: the same per token)
    expected = torch.where(mask.bool(), -adv * w / 5, 0.0)
    torch.testing.assert_close(logp.grad, expected)


def test_per_rank_metrics_merge_peaks_by_their_max_and_the_rest_by_their_mean():
    merged = _merge([{"rollout/is_weight_max": 1.5, "rollout/is_weight_mean": 1.0},
                     {"rollout/is_weight_max": 2.0, "rollout/is_weight_mean": 0.8}])
    assert merged == {"rollout/is_weight_max": 2.0, "rollout/is_weight_mean": pytest.approx(0.9)}


# ---- a real update with rollout log-probs ----


def _update_cfg(sample_sets, **extra):
    # One mini-batch of both rows in one micro-batch: metrics are exact token means, grads stay after the step.
    return load_config(None, tiny_overrides(sample_sets, **{
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1, "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2, "actor_rollout_ref.actor.use_kl_loss": "false",
        **extra}))


def _update(worker: ActorRolloutRefWorker, batch: dict) -> tuple[dict, dict, dict]:
    """Metrics, the gradients the step used (clipped as it used them) and the weights after it."""
    metrics, _ = worker.update_actor(dict(batch), mini_rows=2)
    grads = {k: p.grad.full_tensor().clone() for k, p in worker.actor.named_parameters() if p.grad is not None}
    params = {k: p.full_tensor().clone() for k, p in worker.actor.named_parameters()}
    worker.shutdown()
    return metrics, grads, params


ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
RATIOS = torch.tensor([[0.5, 1.0, 5.0, 1.0], [1.5, 0.25, 1.0, 3.0]])  # exp(old - rollout); the row 0 end is padding
WEIGHTS = torch.tensor([[0.5, 1.0, 2.0, 0.0], [1.5, 0.25, 1.0, 2.0]])  # capped at 2, 0 at padding


def test_the_rollout_is_weight_scales_each_tokens_gradient_as_the_formula_says(sample_sets, tiny_tokenizer):
    """Weighting token t's loss by w_t = min(exp(old_t - rollout_t), 2) is, on-policy (ratio 1, no clip),
    the same gradient as scaling its advantage by w_t; without the weights the gradient differs."""
    cfg = _update_cfg(sample_sets)
    _, batch = padded_batch(tiny_tokenizer)
    worker = one_rank_worker(cfg)
    training = worker.compute_log_prob(batch)[0]  # the detached current log-probs the update compares with
    rollout = (training - RATIOS.log()).masked_fill(batch["response_mask"] == 0, 50.0)  # garbage at padding
    metrics, weighted, _ = _update(worker, {**batch, "advantages": ADVANTAGES, "rollout_log_probs": rollout})
    _, scaled, _ = _update(one_rank_worker(cfg), {**batch, "advantages": ADVANTAGES * WEIGHTS})
    _, plain, _ = _update(one_rank_worker(cfg), {**batch, "advantages": ADVANTAGES})
    assert weighted.keys() == scaled.keys() and weighted
    for k in weighted:
        torch.testing.assert_close(weighted[k], scaled[k], rtol=1e-4, atol=1e-7)
    assert any(not torch.allclose(weighted[k], plain[k], rtol=1e-3, atol=1e-6) for k in weighted)
    # 7 valid tokens: |log r| = ln 2, 0, ln 5, ln 1.5, ln 4, 0, ln 3; weights 0.5, 1, 2, 1.5, 0.25, 1, 2
    diff = (math.log(2) + math.log(5) + math.log(1.5) + math.log(4) + math.log(3)) / 7
    assert metrics["rollout/log_prob_diff_mean"] == pytest.approx(diff, rel=1e-4)
    assert metrics["rollout/is_weight_mean"] == pytest.approx(8.25 / 7, rel=1e-4)
    assert metrics["rollout/is_weight_max"] == pytest.approx(2.0)
    assert metrics["rollout/is_clipfrac"] == pytest.approx(2 / 7)


def test_with_rollout_is_off_the_mismatch_is_logged_and_the_gradient_is_the_unweighted_one(sample_sets,
                                                                                          tiny_tokenizer):
    cfg = _update_cfg(sample_sets, **{"algorithm.rollout_correction.rollout_is": "null"})
    _, batch = padded_batch(tiny_tokenizer)
    worker = one_rank_worker(cfg)
    rollout = worker.compute_log_prob(batch)[0] - RATIOS.log()
    metrics, off, _ = _update(worker, {**batch, "advantages": ADVANTAGES, "rollout_log_probs": rollout})
    _, plain, _ = _update(one_rank_worker(cfg), {**batch, "advantages": ADVANTAGES})
    for k in off:
        torch.testing.assert_close(off[k], plain[k], rtol=1e-5, atol=1e-8)
    assert metrics["rollout/is_weight_max"] == pytest.approx(2.0)


def test_rollout_log_probs_equal_to_the_trainers_leave_the_update_as_it_is_without_them(sample_sets,
                                                                                     tiny_tokenizer):
    cfg = _update_cfg(sample_sets)
    _, batch = padded_batch(tiny_tokenizer)
    worker = one_rank_worker(cfg)
    same = worker.compute_log_prob(batch)[0]
    metrics, grads_with, params_with = _update(worker, {**batch, "advantages": ADVANTAGES,
                                                         "rollout_log_probs": same})
    plain_metrics, grads_without, params_without = _update(one_rank_worker(cfg),
                                                           {**batch, "advantages": ADVANTAGES})
    for k in params_with:
        torch.testing.assert_close(params_with[k], params_without[k], rtol=1e-6, atol=1e-7)
    for k in grads_with:
        torch.testing.assert_close(grads_with[k], grads_without[k], rtol=1e-5, atol=1e-8)
    assert metrics["rollout/log_prob_diff_mean"] < 1e-5
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["actor/pg_loss"] == pytest.approx(plain_metrics["actor/pg_loss"], rel=1e-6)
    assert not any(k.startswith("rollout/") for k in plain_metrics)


# ---- with vLLM on a GPU ----


def _needs_vllm_and_cuda():
    pytest.importorskip("vllm", reason="vLLM is optional (pip install 'grpo-workbench[vllm]'); these tests run "
                                       "where it is installed, on a CUDA GPU")
    if not torch.cuda.is_available():
        pytest.skip("vLLM runs on CUDA GPUs only")


def _gpu_overrides(sample_sets, **extra) -> list[str]:
    return tiny_overrides(sample_sets, **{
        "trainer.device": "cuda", "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.2, "actor_rollout_ref.actor.use_torch_compile": "false",
        # vLLM's torch.compile and graph capture add most of a minute to each engine start, and what these
        # tests check does not depend on them.
        "actor_rollout_ref.rollout.enforce_eager": "true",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "data.max_response_length": 16, **extra})


def test_vllm_in_the_workers_samples_reproducibly_with_the_actors_weights_after_every_update(sample_sets,
                                                                                          tiny_tokenizer):
    _needs_vllm_and_cuda()
    from backend.engine.worker_group import WorkerGroup

    cfg = load_config(None, _gpu_overrides(sample_sets, **{"actor_rollout_ref.actor.optim.lr": 1e-2}))
    group = WorkerGroup(cfg, total_steps=2, pad_id=tiny_tokenizer.pad_token_id)
    try:
        prompts = [tiny_tokenizer("1 + 2 =")["input_ids"], tiny_tokenizer("7 - 4 =")["input_ids"]]
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=5)
        first = group.generate(prompts, params)
        assert first.rollout_log_probs is not None and first.rollout_log_probs.shape == first.responses.shape
        assert bool((first.rollout_log_probs[first.response_mask == 0] == 0).all())
        assert torch.equal(group.generate(prompts, params).responses, first.responses)  # same seed, same draws
        assert not torch.equal(group.generate(prompts, SamplingParams(n=4, max_new_tokens=16, seed=6)).responses,
                               first.responses)
        tensors = {"input_ids": first.input_ids, "attention_mask": first.attention_mask,
                   "responses": first.responses, "response_mask": first.response_mask}
        mask = first.response_mask.bool()
        before = group.compute_log_prob(tensors)[0]
        assert (first.rollout_log_probs - before)[mask].abs().mean() < 0.05  # bf16 engines, same weights
        tensors["advantages"] = torch.randn(first.responses.shape[0], 1).expand_as(before).contiguous()
        # The default config's KL loss needs reference log-probs; the policy before the update serves.
        group.update_actor({**tensors, "rollout_log_probs": first.rollout_log_probs, "ref_log_probs": before},
                           mini_rows=8, epochs=1, shuffle=False)
        after = group.compute_log_prob(tensors)[0]
        assert (after - before)[mask].abs().mean() > 0.1  # lr 1e-2 moved the policy
        # The next generation samples with the updated weights: its log-probs are the trainer's new ones.
        again = group.generate(prompts, params)
        new = {"input_ids": again.input_ids, "attention_mask": again.attention_mask, "responses": again.responses,
               "response_mask": again.response_mask}
        assert (again.rollout_log_probs - group.compute_log_prob(new)[0])[again.response_mask.bool()].abs().mean() \
            < 0.05
    finally:
        group.shutdown()


def test_a_vllm_sync_that_left_a_layer_behind_fails_the_step_naming_vllm_and_that_layers_tensors(
        sample_sets, tiny_tokenizer, monkeypatch):
    _needs_vllm_and_cuda()
    worker = ActorRolloutRefWorker(to_dict(load_config(None, _gpu_overrides(sample_sets))), 0, 1,
                                   *distributed.local_meeting_point(), "cuda", total_steps=1)
    sync, first = VLLMEngine.load_weights, {}

    def sync_skipping_layer_0(engine, model):
        """Layer 0 keeps what the first push gave it (with sleep mode vLLM drops its weights after each
        generation, so they are put back here as a sync that skipped them would leave them)."""
        sync(engine, model)
        for name, p in engine._model().named_parameters():
            if ".layers.0." in name:
                p.data.copy_(first.setdefault(name, p.detach().clone()))

    monkeypatch.setattr(VLLMEngine, "load_weights", sync_skipping_layer_0)
    try:
        second_generation_is_stale(worker, tiny_tokenizer, r"after the weight sync vLLM's copy of \d+ of the actor's "
                                                           r"tensors differs from the actor's: model\.layers\.0\.")
    finally:
        worker.shutdown()


def test_a_grpo_run_with_vllm_trains_and_logs_the_rollout_mismatch_every_step(tmp_path, sample_sets):
    _needs_vllm_and_cuda()
    from backend.core.runs import read_metrics, read_status
    from backend.engine.trainer import Trainer

    cfg = load_config(None, _gpu_overrides(sample_sets, **{"trainer.total_training_steps": 3}))
    with Trainer(cfg, tmp_path / "run", show_progress=False) as trainer:
        trainer.train()
    assert read_status(tmp_path / "run")["state"] == "succeeded"
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 0 <= m["rollout/log_prob_diff_mean"] < 0.05, m["step"]  # weights pushed after every update
        assert 0.9 < m["rollout/is_weight_mean"] < 1.1 and m["rollout/is_weight_max"] <= 2.0
        assert math.isfinite(m["actor/pg_loss"]) and m["response_length/mean"] > 0
