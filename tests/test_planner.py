"""The memory and time plan (backend.services.planner): each formula against numbers worked out here for tiny-qwen3,
the directions the suggestions rely on, and `python -m backend plan` as a user runs it."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from backend.core.config import ConfigError, load_config
from backend.engine.distributed import cpu_has_bf16
from backend.services import planner

from .conftest import REPO

GiB = 2**30
DEFAULT = REPO / "configs/default.yaml"

# tiny-qwen3 (backend.core.models._build_tiny): 2 layers, hidden 64, vocab 512, 2 KV heads of 16, tied embeddings
P, P_LAYER, P_ROOT = 106_880, 37_024, 32_832
L, H, V, HKV, D = 2, 64, 512, 2, 16

# round numbers, so each term below is the formula and nothing else
CHOSEN = {"activation_bytes": 10.0, "logprob_activation_copies": 4.0, "sampling_bytes_per_vocab": 26.0,
          "fragmentation": 1.5, "cuda_overhead_gib": 1.0, "mfu": 0.5, "decode_efficiency_hf": 0.5,
          "decode_step_overhead_hf_s": 0.0, "decode_layer_overhead_hf_s": 0.0, "decode_efficiency_workbench": 0.25,
          "micro_batch_overhead_s": 0.0}


def tiny(*overrides: str):
    return load_config(DEFAULT, ["actor_rollout_ref.model.path=tiny-qwen3", *overrides])


# 2 GPUs, 4 prompts x 4 = 16 responses (8 per rank), mini-batches of 2 prompts (two optimizer steps, so old
# log-probs run), sequences of 100 + 28 = 128 tokens, a reference (use_kl_loss), our own engine.
WORKED = ("trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "data.max_prompt_length=100", "data.max_response_length=28",
          "actor_rollout_ref.rollout.generation_batch_size=5",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.name=workbench")


@pytest.fixture(scope="module")
def worked() -> planner.Plan:
    return planner.plan(tiny(*WORKED), gpu="h200", calibration=CHOSEN)


def test_tiny_qwen3_dimensions_come_from_its_config_and_a_meta_instance():
    dims = planner.model_dims("tiny-qwen3")
    assert (dims.params, dims.layer_params, dims.root_params) == (P, P_LAYER, P_ROOT)
    assert dims.root_params == V * H + H  # tied embedding and head counted once, plus the final norm
    assert (dims.layers, dims.hidden, dims.vocab, dims.kv_heads, dims.head_dim) == (L, H, V, HKV, D)
    assert planner.model_dims("tiny-qwen3") is dims  # cached per path


def test_held_memory_is_the_sharded_actor_and_reference_and_the_engines_copy_only_if_it_is_kept(worked):
    W, c = 2, 2
    assert worked.held == {"actor fp32 master shard": 4 * P / W,   # 213,760
                           "AdamW states": 8 * P / W,               # 427,520
                           "fp32 gradients": 4 * P / W,             # 213,760
                           "reference shard (bf16)": c * P / W}     # 106,880
    assert sum(worked.held.values()) == 961_920
    # an engine that keeps its cache (free_cache_engine off) keeps its weights through every phase too
    kept = planner.plan(tiny(*WORKED, "actor_rollout_ref.rollout.free_cache_engine=false"), gpu="h200",
                        calibration=CHOSEN)
    assert kept.held["rollout engine weights (bf16)"] == c * P  # 213,760
    assert (worked.rows_per_step, worked.rows_per_rank, worked.seq_len, worked.response_len) == (16, 8, 128, 28)


def test_generation_terms(worked):
    gen = worked.phase("generation")
    bg, T, c = 5, 128, 2  # generation_batch_size 5 < 8 rows per rank
    own = {k: v for k, v in gen.terms.items() if k not in worked.held}
    # The weights gathered for the engine's copy (213,760) are freed before the cache is made, and the
    # cache and sampling temporaries are the larger of the two: they are what generation holds.
    assert own == {"KV cache": bg * T * L * 2 * HKV * D * c,                   # 163,840
                   "sampling temporaries": bg * V * 26,                        # 66,560
                   "rollout engine weights (bf16)": c * P}                     # 213,760, freed after it
    assert gen.allocated == 961_920 + 163_840 + 66_560 + 213_760
    assert gen.reserved == gen.allocated * 1.5 + 1 * GiB
    # With one generation row the cache is smaller than the gathered weights, which then make the peak.
    one_row = planner.plan(tiny(*WORKED, "actor_rollout_ref.rollout.generation_batch_size=1"), gpu="h200",
                           calibration=CHOSEN).phase("generation")
    assert {k: v for k, v in one_row.terms.items() if k not in worked.held} == {
        "weights gathered for the engine copy": c * P, "rollout engine weights (bf16)": c * P}
    # An engine that keeps its cache has it while the next step's weights are gathered: they add up.
    kept = planner.plan(tiny(*WORKED, "actor_rollout_ref.rollout.free_cache_engine=false"), gpu="h200",
                        calibration=CHOSEN).phase("generation")
    assert {"KV cache", "weights gathered for the engine copy"} <= kept.terms.keys()


def test_log_prob_terms_use_each_passs_micro_batch_capped_at_the_rows_of_a_rank(worked):
    T, R, c = 128, 28, 2
    gathered = c * (P_LAYER + P_ROOT)  # 139,712
    for name, m in (("old log-prob", 3), ("reference log-prob", 8)):  # ref micro 16 > 8 rows
        phase = worked.phase(name)
        assert phase.runs
        own = {k: v for k, v in phase.terms.items() if k not in worked.held}
        # compiled on the GPU, the vocabulary pass is fused: no fp32 copy of a chunk
        assert own == {"gathered weights": gathered, "logits": m * R * V * c,
                       "activations": m * T * H * c * 4}, name
    assert worked.phase("old log-prob").terms["logits"] == 86_016


def test_micro_batches_by_tokens_are_planned_as_the_rows_of_the_longest_length_the_budget_holds():
    """A budget of 300 positions holds two 128-token rows: every pass is planned as micro-batches of two,
    whatever its rows setting, unless its own keys say otherwise."""
    by_tokens = planner.plan(tiny(*WORKED, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
                                  "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=600"),
                             gpu="h200", calibration=CHOSEN)
    by_rows = {m: planner.plan(tiny(*WORKED, f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={m}",
                                    f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={m}",
                                    f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={m}"),
                               gpu="h200", calibration=CHOSEN) for m in (2, 4)}
    assert by_tokens.phase("update").terms == by_rows[2].phase("update").terms
    assert by_tokens.phase("old log-prob").terms == by_rows[2].phase("old log-prob").terms
    assert by_tokens.phase("reference log-prob").terms == by_rows[4].phase("reference log-prob").terms


def test_the_eager_vocabulary_pass_counts_fp32_temporaries_for_one_chunk_not_the_micro_batch():
    eager = ("actor_rollout_ref.actor.use_torch_compile=false", "data.train_batch_size=64",
             "actor_rollout_ref.actor.ppo_mini_batch_size=32",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "data.max_response_length=100")
    big = planner.plan(tiny(*WORKED, *eager), gpu="h200", calibration=CHOSEN)
    chunk = (2048 // 100) * 100  # whole rows of 100 positions, far fewer than the micro-batch's 6,400
    assert big.phase("update").terms["fp32 vocabulary pass of one chunk"] == chunk * V * 20
    assert big.phase("reference log-prob").terms["fp32 vocabulary pass of one chunk"] == 8 * 100 * V * 8
    # the head runs inside the vocabulary pass: the logits and their gradient of one chunk, not 6,400 positions
    assert big.phase("update").terms["logits + gradient"] == 2 * chunk * V * 2
    fused = planner.plan(tiny(*WORKED, *eager[1:]), gpu="h200", calibration=CHOSEN)
    assert not any("vocabulary pass" in k for p in fused.phases for k in p.terms)


def test_update_terms_with_and_without_gradient_checkpointing(worked):
    T, R, c, m, A = 128, 28, 2, 4, 10
    update = worked.phase("update")
    own = {k: v for k, v in update.terms.items() if k not in worked.held}
    assert own == {"activations kept for backward": m * T * L * H * A,  # 655,360
                   "logits + gradient": 2 * m * R * V * c,  # 229,376: 112 positions, within one chunk
                   "fp32 gradient sum of the head": 4 * V * H,  # 131,072
                   "gathered weights": c * (P_LAYER + P_ROOT)}
    assert update.allocated == 961_920 + 655_360 + 229_376 + 131_072 + 139_712
    # the update holds more of its own (1,155,520, m=4) than the reference pass (893,376, m=8)
    ref = worked.phase("reference log-prob")
    assert ref.allocated == 961_920 + 139_712 + 229_376 + 524_288
    assert worked.peak_phase == "update" and worked.need_gib == update.reserved / GiB

    gc = planner.plan(tiny(*WORKED, "actor_rollout_ref.model.enable_gradient_checkpointing=true"), gpu="h200",
                      calibration=CHOSEN).phase("update")
    assert gc.terms["checkpointed layer inputs"] == m * T * H * c * L  # 131,072
    assert gc.terms["activations of one layer"] == m * T * H * A       # 327,680
    assert "activations kept for backward" not in gc.terms

    # compiled layers keep the activation_memory_budget share; eager ones keep all, whatever the budget
    half = planner.plan(tiny(*WORKED, "actor_rollout_ref.actor.activation_memory_budget=0.5"), gpu="h200",
                        calibration=CHOSEN).phase("update")
    assert half.terms["activations kept for backward"] == m * T * L * H * A * 0.5
    eager = planner.plan(tiny(*WORKED, "actor_rollout_ref.actor.activation_memory_budget=0.5",
                              "actor_rollout_ref.actor.use_torch_compile=false"), gpu="h200",
                         calibration=CHOSEN).phase("update")
    assert eager.terms["activations kept for backward"] == m * T * L * H * A


def test_step_time_terms(worked):
    flops, bw = 989e12 * 0.5, 4.8e12 * 0.25  # h200 at the chosen MFU and workbench decode efficiency
    kv, tokens = 163_840, 8 * 128
    gen = math.ceil(8 / 5) * (28 * (2 * P + 0.5 * kv) / bw + 2 * P * 5 * 100 / flops)
    assert worked.phase("generation").seconds == pytest.approx(gen)
    # an FP8 cache halves the cache's memory, not the time: the kernel reads it no faster (docs/performance.md)
    fp8 = planner.plan(tiny(*WORKED, "actor_rollout_ref.rollout.kv_cache_dtype=fp8"), gpu="h200", calibration=CHOSEN)
    assert fp8.phase("generation").seconds == pytest.approx(gen)
    assert worked.phase("reference log-prob").seconds == pytest.approx(2 * P * tokens / flops)
    assert worked.phase("update").seconds == pytest.approx(6 * P * tokens / flops)
    assert worked.step_seconds == pytest.approx(gen + 2 * (2 * P * tokens / flops) + 6 * P * tokens / flops)
    gc = planner.plan(tiny(*WORKED, "actor_rollout_ref.model.enable_gradient_checkpointing=true"), gpu="h200",
                      calibration=CHOSEN)
    assert gc.phase("update").seconds == pytest.approx(8 * P * tokens / flops)
    # LoRA: the base's weight gradients are not computed, only the adapters' (forward, input gradient, and
    # the adapters' weight gradient)
    lora = planner.plan(tiny(*WORKED, "actor_rollout_ref.model.lora_rank=4"), gpu="h200", calibration=CHOSEN)
    trained = planner.lora_params(planner.model_dims("tiny-qwen3"), 4, ["all-linear"])
    assert lora.phase("update").seconds == pytest.approx((4 * P + 2 * trained) * tokens / flops)


def test_hf_engine_holds_no_copy_but_gathers_the_actor_for_generation():
    p = planner.plan(tiny(*WORKED, "actor_rollout_ref.rollout.name=hf"), gpu="h200", calibration=CHOSEN)
    assert not any(k.startswith("rollout engine weights") for k in p.held)
    assert p.phase("generation").terms["actor weights gathered for sampling"] == 2 * P
    assert p.phase("update").allocated == 1_175_680 - 2 * P + 655_360 + 229_376 + 131_072 + 139_712


def test_one_rank_counts_the_whole_model_gathered_and_offload_a_layer_at_a_time():
    one = ("trainer.n_gpus_per_node=1", *WORKED[1:])
    p = planner.plan(tiny(*one), gpu="h200", calibration=CHOSEN)
    for phase in ("old log-prob", "reference log-prob", "update"):
        assert p.phase(phase).terms["gathered weights"] == 2 * P, phase
    offloaded = planner.plan(tiny(*one, "actor_rollout_ref.actor.fsdp_config.offload_policy=true"), gpu="h200",
                             calibration=CHOSEN)
    assert offloaded.phase("update").terms["gathered weights"] == 2 * (P_LAYER + P_ROOT)
    assert offloaded.phase("reference log-prob").terms["gathered weights"] == 2 * P  # the reference is not offloaded


def test_phases_that_the_step_skips_are_not_counted():
    p = planner.plan(tiny("actor_rollout_ref.actor.use_kl_loss=false"), gpu="h200")
    assert not p.phase("old log-prob").runs  # one mini-batch, one epoch: on-policy
    assert not p.phase("reference log-prob").runs
    assert not any(k.startswith("reference shard") for k in p.held)
    assert p.phase("reference log-prob").seconds is None


def update_peak(*overrides: str) -> float:
    return planner.plan(tiny(*overrides), gpu="h200").phase("update").reserved


def test_checkpointing_a_smaller_micro_batch_offload_and_more_gpus_each_lower_the_update_peak():
    base = ("data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=512")
    peak = update_peak(*base)
    assert update_peak(*base, "actor_rollout_ref.model.enable_gradient_checkpointing=true") < peak
    assert update_peak(*base[:-2], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", base[-1]) < peak
    assert update_peak(*base, "actor_rollout_ref.actor.fsdp_config.offload_policy=true") < peak
    assert update_peak(*base, "trainer.n_gpus_per_node=2") < peak


def test_kv_cache_scales_with_the_generation_batch_and_the_sequence_length():
    def kv(*overrides: str) -> float:
        return planner.plan(tiny("data.train_batch_size=16", *overrides), gpu="h200").phase("generation").terms[
            "KV cache"]

    base = kv("actor_rollout_ref.rollout.generation_batch_size=8")
    assert kv("actor_rollout_ref.rollout.generation_batch_size=16") == 2 * base
    # T from 128 + 64 to 320 + 64
    assert kv("actor_rollout_ref.rollout.generation_batch_size=8", "data.max_prompt_length=320") == 2 * base
    # an FP8 cache holds one byte a value against bf16's two (a GPU's compute dtype)
    assert kv("actor_rollout_ref.rollout.generation_batch_size=8", "actor_rollout_ref.rollout.kv_cache_dtype=fp8") * 2 \
        == base
    # never more sequences at once than a rank generates: 64 rows
    assert kv("actor_rollout_ref.rollout.generation_batch_size=1000") == kv(
        "actor_rollout_ref.rollout.generation_batch_size=64")


HUGE = ("data.train_batch_size=64", "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=256", "data.max_prompt_length=4096",
        "data.max_response_length=28672", "actor_rollout_ref.rollout.generation_batch_size=1024")


def test_a_config_that_does_not_fit_gets_suggestions_that_replanning_confirms():
    p = planner.plan(tiny(*HUGE), gpu="l4")
    assert not p.fits and p.need_gib > 24 and "does not fit" in p.verdict
    by_key = {s.changes[0][0]: s for s in p.suggestions if len(s.changes) == 1}
    micro = by_key["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]
    assert micro.fits and micro.changes[0][1] < 256
    assert 1024 % micro.changes[0][1] == 0  # divides a rank's mini-batch, so the changed config is valid
    assert "actor_rollout_ref.model.enable_gradient_checkpointing" in by_key
    assert by_key["actor_rollout_ref.actor.activation_memory_budget"].changes[0][1] < 1  # compiled layers recompute
    for s in p.suggestions:
        again = planner.plan(tiny(*HUGE, *s.overrides), gpu="l4")
        assert again.need_gib == pytest.approx(s.need_gib)
        assert s.saves_gib == pytest.approx(p.need_gib - again.need_gib)
        assert s.saves_gib > 0


def test_when_no_change_fits_alone_the_cheapest_changes_together_do_and_replanning_confirms():
    # the reference pass is huge too: 1,024 sequences of 16,384 + 28,672 tokens at once
    huge = (*HUGE, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1024", "data.max_prompt_length=16384")
    p = planner.plan(tiny(*huge), gpu="l4")
    assert not any(s.fits for s in p.suggestions if len(s.changes) == 1)
    [together] = [s for s in p.suggestions if len(s.changes) > 1]
    assert together.fits
    keys = [key for key, _ in together.changes]
    # both passes are over the GPU, so lowering either micro-batch alone cannot fit: both are needed
    assert set(keys[:2]) == {"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"}
    assert "actor_rollout_ref.actor.fsdp_config.offload_policy" not in keys  # not needed, so not asked for
    again = planner.plan(tiny(*huge, *together.overrides), gpu="l4")
    assert again.fits and again.need_gib == pytest.approx(together.need_gib)
    assert "or all of these together" in planner.format_plan(p)


def test_a_config_that_fits_has_headroom_and_no_suggestions():
    p = planner.plan(tiny(), gpu="h200")
    assert p.fits and p.suggestions == []
    assert p.verdict.startswith("fits") and "headroom" in p.verdict


def test_offload_moves_the_actors_state_to_host_memory():
    p = planner.plan(tiny("actor_rollout_ref.actor.fsdp_config.offload_policy=true"), gpu="h200")
    assert not any(k.startswith(("actor fp32", "AdamW", "fp32 gradients")) for k in p.held)
    assert p.host_gib_per_worker == pytest.approx(16 * P / GiB)
    assert any("offloaded to CPU memory" in n for n in p.notes)


def test_on_cpu_gpu_memory_does_not_apply_and_the_host_total_is_given():
    p = planner.plan(tiny("trainer.device=cpu", "trainer.n_gpus_per_node=2"))
    assert p.device == "cpu" and p.gpu is None and p.compute_bytes == (2 if cpu_has_bf16() else 4)
    peak = max(ph.allocated for ph in p.phases if ph.runs)
    assert p.need_gib == pytest.approx(2 * peak / GiB)  # both workers of the node, no fragmentation factor
    assert "GPU memory does not apply" in p.verdict and "host memory" in p.verdict


CPU_CHOSEN = {"cpu_pass_efficiency": 0.5, "cpu_decode_efficiency": 0.25, "cpu_decode_layer_overhead_s": 0.001,
              "cpu_micro_batch_overhead_s": 0.01}


def test_cpu_step_time_is_this_machines_measured_speed_through_the_formulas(monkeypatch):
    monkeypatch.setattr(planner, "cpu_flops", lambda dtype: 100e9)
    # fp32 (the calibration chosen here is fp32's), 4 x 4 = 16 responses of 100 + 28 = 128 tokens, one
    # optimizer step (no old log-probs), a reference, generation 5 at a time, the reference in one
    # micro-batch of 16, the update in two of 8.
    p = planner.plan(tiny("trainer.device=cpu", "actor_rollout_ref.actor.fsdp_config.param_dtype=fp32",
                          "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_prompt_length=100",
                          "data.max_response_length=28", "actor_rollout_ref.rollout.generation_batch_size=5",
                          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"), calibration=CPU_CHOSEN)
    passes, decode = 100e9 * 0.5, 100e9 * 0.25
    tokens = 16 * 128
    # 4 rounds of 5 rows: 28 decode steps (the products of 5 rows, 1 ms a layer) and a prefill of 100 tokens each
    generation = 4 * (28 * (2 * P * 5 / decode + 0.001 * L) + 2 * P * 5 * 100 / passes)
    reference = 2 * P * tokens / passes + 1 * 0.01
    update = 6 * P * tokens / passes + 2 * 2 * 0.01  # a backward counts twice
    assert p.phase("generation").seconds == pytest.approx(generation)
    assert not p.phase("old log-prob").runs
    assert p.phase("reference log-prob").seconds == pytest.approx(reference)
    assert p.phase("update").seconds == pytest.approx(update)
    assert p.step_seconds == pytest.approx(generation + reference + update)
    assert any("100 GFLOP/s" in n for n in p.notes)
    # two worker processes share the node's cores: each has half the speed for half the rows
    fp32 = "actor_rollout_ref.actor.fsdp_config.param_dtype=fp32"
    two = planner.plan(tiny("trainer.device=cpu", "trainer.n_gpus_per_node=2", fp32), calibration=CPU_CHOSEN)
    one = planner.plan(tiny("trainer.device=cpu", fp32), calibration=CPU_CHOSEN)
    assert two.phase("update").seconds == pytest.approx(one.phase("update").seconds, rel=0.35)


def test_cpu_flops_is_a_positive_speed_and_leaves_torchs_threads_as_they_were():
    import torch

    threads = torch.get_num_threads()
    planner.cpu_flops.cache_clear()
    assert 1e8 < planner.cpu_flops() < 1e14
    assert torch.get_num_threads() == threads


def test_the_plan_is_for_this_machine_its_gpu_else_its_cpu(monkeypatch):
    monkeypatch.setattr(planner, "visible_gpu", lambda: None)
    p = planner.plan(tiny())  # trainer.device=auto: a run started here would train on the CPU
    assert p.device == "cpu" and p.gpu is None and p.verdict.endswith("GiB on this machine")
    assert any("planned for this machine's CPU" in n for n in p.notes)
    assert planner.this_machine().startswith("this machine's CPU")
    p = planner.plan(tiny("trainer.device=cuda"))  # a GPU asked for and none here: plan for the default GPU
    assert p.gpu.name == "h200" and any("no CUDA GPU is visible" in n for n in p.notes)
    monkeypatch.setattr(planner, "visible_gpu", lambda: planner.GPU("NVIDIA Mystery", 12.0, None, None))
    assert planner.this_machine() == "this machine's GPU (NVIDIA Mystery, 12 GiB)"
    p = planner.plan(tiny())
    assert p.gpu.memory_gib == 12.0 and p.step_seconds is None
    assert any("not in the table" in n for n in p.notes)
    with pytest.raises(ValueError, match="choose one of h200"):
        planner.plan(tiny(), gpu="v100")


@pytest.mark.parametrize(("name", "memory", "kind"), [
    ("NVIDIA H200", 139.8, "h200"), ("NVIDIA H100 80GB HBM3", 79.2, "h100"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"), ("NVIDIA A100-PCIE-40GB", 39.4, "a100-40gb"),
    ("NVIDIA L40S", 44.5, "l40s"), ("NVIDIA GeForce RTX 4090", 23.6, "rtx4090"),
    ("NVIDIA L4", 22.0, "l4"), ("NVIDIA L40", 44.5, None), ("Tesla V100-SXM2-16GB", 15.8, None)])
def test_cuda_device_names_match_the_table(name, memory, kind):
    assert planner.match_gpu(name, memory) == kind


def test_more_gpus_than_the_batch_splits_into_is_a_config_error():
    with pytest.raises(ConfigError, match="does not split into micro-batches"):
        planner.plan(tiny(), gpu="h200", gpus=3)
    assert planner.plan(tiny(), gpu="h200", gpus=2).world_size == 2


def test_the_text_names_the_model_ranks_phases_time_and_verdict():
    text = planner.format_plan(planner.plan(tiny(*HUGE), gpu="l4"))
    assert "tiny-qwen3 (Qwen3ForCausalLM), 106.9K parameters" in text
    assert "ranks: 1 (1 per node) on l4 GPUs" in text
    for phase in planner.PHASES:
        assert f"\n{phase}" in text
    assert "step time:" in text and "verdict: does not fit" in text
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=" in text


# ---- the command line ----

def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "backend", "plan", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_cli_plan_of_the_default_config_with_tiny_qwen3_fits_an_h200():
    result = cli("configs/default.yaml", "actor_rollout_ref.model.path=tiny-qwen3", "--gpu", "h200")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "106.9K parameters" in out and "ranks: 1" in out
    assert "phase" in out and "allocated" in out and "reserved" in out
    for phase in ("generation", "old log-prob", "reference log-prob", "update"):
        assert phase in out
    assert "step time:" in out and "verdict: fits" in out


@pytest.mark.slow
def test_cli_plan_of_a_huge_config_on_an_l4_exits_1_and_says_what_to_change():
    result = cli("configs/default.yaml", "actor_rollout_ref.model.path=tiny-qwen3", "--gpu", "l4", *HUGE)
    assert result.returncode == 1, result.stderr
    assert "verdict: does not fit" in result.stdout
    assert "ppo_micro_batch_size_per_gpu=" in result.stdout or "enable_gradient_checkpointing=true" in result.stdout


@pytest.mark.slow
def test_cli_plan_of_a_bad_config_exits_2_with_the_config_error():
    result = cli("configs/default.yaml", "data.train_batch_size=6", "--gpus", "1")
    assert result.returncode == 2
    assert "error: invalid config:" in result.stderr
    assert "data.train_batch_size=6 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=4" in result.stderr


def test_a_critic_adds_its_sharded_state_to_every_phase_and_its_own_update():
    base = planner.plan(tiny(*WORKED), gpu="h200", calibration=CHOSEN)
    ppo = planner.plan(tiny(*WORKED, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"),
                       gpu="h200", calibration=CHOSEN)
    W = 2
    assert ppo.held["critic fp32 shard, AdamW states and gradients"] == 16 * P / W
    assert ppo.phase("generation").allocated == base.phase("generation").allocated + 16 * P / W
    critic = ppo.phase("critic update")
    assert critic.runs and critic.terms["critic activations"] == 4 * 128 * L * H * 10
    assert "critic update" not in [p.name for p in base.phases]


def test_a_reward_model_is_held_whole_on_every_worker():
    with_rm = planner.plan(tiny(*WORKED, "reward_model.enable=true", "reward_model.model.path=tiny-qwen3"),
                           gpu="h200", calibration=CHOSEN)
    assert with_rm.held["reward model (bf16, whole on every worker)"] == 2 * P


def test_lora_keeps_the_fp32_base_but_drops_its_adam_state_gradients_and_the_reference_copy():
    full = planner.plan(tiny(*WORKED), gpu="h200", calibration=CHOSEN)
    lora = planner.plan(tiny(*WORKED, "actor_rollout_ref.model.lora_rank=4"), gpu="h200", calibration=CHOSEN)
    dims = planner.model_dims("tiny-qwen3")
    # tiny-qwen3, per layer: q (64 -> 64), k, v (64 -> 32), o (64 -> 64), gate, up (64 -> 128), down (128 -> 64)
    per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)
    trained = 4 * L * per_layer
    assert planner.lora_params(dims, 4, ["all-linear"]) == trained
    assert planner.lora_params(dims, 4, ["q_proj", "v_proj"]) == 4 * L * ((64 + 64) + (64 + 32))
    W = 2
    assert lora.held["AdamW states"] == 8 * trained / W and lora.held["fp32 gradients"] == 4 * trained / W
    assert lora.held["actor fp32 master shard"] == 4 * (P + trained) / W
    assert not any(k.startswith("reference shard") for k in lora.held)
    assert lora.need_gib < full.need_gib


def test_vllm_takes_its_share_of_the_gpu_while_generating_and_none_while_it_sleeps():
    """vLLM maps its share (weights and KV cache) itself, so the share is counted exactly, not through the
    allocator's fragmentation; asleep between generations it holds none of it, awake it holds it throughout."""
    h200 = planner.GPUS["h200"]
    dims = planner.model_dims("tiny-qwen3")
    share = 0.3 * 141 * GiB
    vllm = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3")
    asleep = planner._plan(load_config(DEFAULT, ["actor_rollout_ref.model.path=tiny-qwen3", *WORKED[:-1], *vllm],
                                       validate=False), dims, "cuda", h200, CHOSEN)
    gen = asleep.phase("generation")
    assert gen.terms[planner.VLLM_SHARE] == share and planner.VLLM_SHARE not in asleep.held
    assert not any(k.startswith("rollout engine weights") for k in asleep.held)  # vLLM's copy is in its share
    assert gen.reserved == (gen.allocated - share) * 1.5 + share + 1 * GiB
    assert gen.seconds is None and asleep.step_seconds is None
    assert any("vLLM's generation time is not predicted" in n for n in asleep.notes)
    awake = planner._plan(load_config(DEFAULT, ["actor_rollout_ref.model.path=tiny-qwen3", *WORKED[:-1], *vllm,
                                                "actor_rollout_ref.rollout.free_cache_engine=false"], validate=False),
                          dims, "cuda", h200, CHOSEN)
    assert all(p.terms[planner.VLLM_SHARE] == share for p in awake.phases if p.runs)
    assert awake.peak_phase == "update" and awake.need_gib > share / GiB


def test_async_generation_is_the_rollout_workers_and_overlaps_the_rest_of_the_step():
    """trainer.rollout_mode=async: the rollout worker holds its copy, the engine's, the cache and its log-prob
    forward, and none of the actor's state; the actor's workers hold no engine; at max_staleness=1 the step
    takes the longer of generation and the rest."""
    apart = planner.plan(tiny(*WORKED, "trainer.rollout_mode=async",
                              "actor_rollout_ref.rollout.free_cache_engine=false"), gpu="h200", calibration=CHOSEN)
    c, T, R, bg, rows = 2, 128, 28, 5, 16  # one rollout worker samples all 16 rows, 5 at a time
    kv = bg * T * L * 2 * HKV * D * c
    assert not any(k.startswith("rollout engine weights") for k in apart.held)
    assert apart.phase("generation").terms == {
        "rollout worker's model (bf16)": c * P, "rollout engine weights (bf16)": c * P, "KV cache": kv,
        # its forward over micro-batches of 3 rows is larger than the sampling temporaries (5 x V x 26)
        "logits": 3 * R * V * c, "activations": 3 * T * H * c * 4}
    flops, bw = 989e12 * 0.5, 4.8e12 * 0.25
    gen = math.ceil(rows / bg) * (R * (2 * P + 0.5 * kv) / bw + 2 * P * bg * 100 / flops) + 2 * P * rows * T / flops
    assert apart.phase("generation").seconds == pytest.approx(gen)
    rest = sum(p.seconds for p in apart.phases if p.runs and p.name != "generation")
    assert apart.step_seconds == pytest.approx(max(gen, rest))
    assert "the longer of generation" in apart.step_time_text()
    in_turn = planner.plan(tiny(*WORKED, "trainer.rollout_mode=async", "trainer.max_staleness=0"), gpu="h200",
                           calibration=CHOSEN)
    assert in_turn.step_seconds == pytest.approx(sum(p.seconds for p in in_turn.phases if p.runs))
