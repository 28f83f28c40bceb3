"""The run config: a typed schema with one line of help per field, YAML loading, dotted overrides
(`actor_rollout_ref.rollout.n=8`) and validation that runs before anything starts.

Key paths follow verl's for the subset both share, so a verl user's overrides carry over. Every
error names the key, the value and what is allowed; an unknown key names the closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from backend.core import vllm_support
from backend.core.trackers import check_trackers


class ConfigError(ValueError):
    """A config that must not start a run; `problems` holds one message per problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _f(default: Any, help: str, *, choices: tuple = (), min: float | None = None,
       gt: float | None = None) -> Any:
    """A schema field: its default, the help line the CLI and UI show, and its allowed values."""
    meta = {"help": help, "choices": choices, "min": min, "gt": gt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _section(cls: type) -> Any:
    return field(default_factory=cls)


# Allowed values that the algorithms and scorers define; written out here because core imports neither
# (tests/test_config.py holds them equal to backend.algos.losses.LOSS_AGG_MODES and KL_TYPES, and to
# backend.rewards.rules.GSM8K_SCORERS, whose first rule is reward.gsm8k_scorer's default).
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTY_TYPES = ("kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs")
KL_LOSS_TYPES = (*KL_PENALTY_TYPES, "kl+", "k1+", "low_var_kl+", "k3+")
GSM8K_SCORERS = ("verl", "lenient")


# ---- data ----

@dataclass
class DataConfig:
    train_files: list[str] = _f(["sample_data/arithmetic_train.parquet"], "Parquet files to train on (verl rows).")
    val_files: list[str] = _f(["sample_data/arithmetic_val.parquet"], "Parquet files for validation; empty for none.")
    train_batch_size: int = _f(4, "Prompts per training step.", min=1)
    val_batch_size: int = _f(32, "Prompts per generation batch during validation.", min=1)
    val_max_samples: int = _f(64, "Validate on at most this many rows of the validation set (0 = all).", min=0)
    max_prompt_length: int = _f(256, "Longest prompt in tokens, after the chat template.", min=1)
    max_response_length: int = _f(64, "Most new tokens generated per response.", min=1)
    truncation: str = _f("error", "What to do with a prompt over max_prompt_length.",
                         choices=("error", "left", "right"))
    filter_overlong_prompts: bool = _f(False, "Drop prompts over max_prompt_length instead of truncating.")
    shuffle: bool = _f(True, "Shuffle the training prompts each epoch (seeded).")
    seed: int = _f(0, "Seed of the prompt order.")


# ---- actor / rollout / reference ----

@dataclass
class ModelConfig:
    path: str = _f("smollm2-135m-instruct",
                   "Model: a shipped name (smollm2-135m-instruct, tiny-qwen3, tiny-llama), a local folder "
                   "or a Hugging Face Hub id.")
    tokenizer_path: str = _f("", "Tokenizer folder or Hub id, if not the model's own.")
    enable_gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    lora_rank: int = _f(0, "LoRA rank: train low-rank adapters on the base's linear layers instead of every weight "
                        "(PEFT); the reference is the base with adapters off. 0 trains every weight.", min=0)
    lora_alpha: float = _f(16.0, "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank.", gt=0)
    target_modules: list[str] = _f(["all-linear"], "Layers that get adapters: all-linear, or module names such as "
                                   "q_proj, v_proj.")


@dataclass
class OptimConfig:
    lr: float = _f(1e-6, "AdamW learning rate.", gt=0)
    weight_decay: float = _f(0.01, "AdamW weight decay.", min=0)
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    lr_warmup_steps: int = _f(0, "Linear warm-up steps of the learning rate.", min=0)
    warmup_style: str = _f("constant", "Schedule after warm-up.", choices=("constant", "cosine"))
    min_lr_ratio: float = _f(0.0, "Cosine schedule floor as a fraction of lr.", min=0)


@dataclass
class FSDPConfig:
    param_dtype: str = _f("auto", "Dtype the sharded fp32 weights are gathered and computed in (auto: bf16 on GPUs "
                          "and on CPUs with bf16 matrix instructions, AVX512-BF16 or AMX; fp32 on other CPUs); "
                          "gradients are reduced in fp32.", choices=("auto", "bf16", "fp32"))
    offload_policy: bool = _f(False, "FSDP2 CPU offload: weights, gradients and optimizer state live in CPU memory "
                              "and the optimizer steps there; saves GPU memory, costs speed.")


@dataclass
class RefFSDPConfig:
    offload_policy: bool = _f(False, "Keep the reference model's shards in CPU memory between uses.")


@dataclass
class PolicyLossConfig:
    loss_mode: str = _f("vanilla", "Policy loss: vanilla (PPO clip with dual clip) or gspo (clip on the "
                        "length-normalised sequence ratio; pair it with clip_ratio_low/high near 3e-4/4e-4 and "
                        "loss_agg_mode=seq-mean-token-mean).", choices=("vanilla", "gspo"))


@dataclass
class ActorConfig:
    optim: OptimConfig = _section(OptimConfig)
    policy_loss: PolicyLossConfig = _section(PolicyLossConfig)
    fsdp_config: FSDPConfig = _section(FSDPConfig)
    ppo_mini_batch_size: int = _f(4, "Prompts per optimizer step (times rollout.n responses).", min=1)
    ppo_micro_batch_size_per_gpu: int = _f(8, "Responses per forward/backward pass (gradient accumulation).",
                                           min=1)
    use_dynamic_bsz: bool = _f(False, "Form the update's micro-batches by tokens instead of rows (verl's name): each "
                               "holds as many responses as fit in ppo_max_token_len_per_gpu positions, longest "
                               "first, which bounds the update's activation memory whatever the responses' lengths "
                               "(ppo_micro_batch_size_per_gpu is then unused). The log-prob passes follow unless "
                               "their log_prob_use_dynamic_bsz says otherwise.")
    ppo_max_token_len_per_gpu: int = _f(16384, "With use_dynamic_bsz: the most positions (prompt and response, "
                                        "padding left out) a micro-batch holds; at least data.max_prompt_length + "
                                        "data.max_response_length.", min=1)
    ppo_epochs: int = _f(1, "Passes over each step's responses.", min=1)
    shuffle: bool = _f(False, "Shuffle responses between mini-batches.")
    clip_ratio: float = _f(0.2, "PPO clip range, used for both sides unless clip_ratio_low/high are set.", gt=0)
    clip_ratio_low: float | None = _f(None, "Lower clip range (1 - low); defaults to clip_ratio.")
    clip_ratio_high: float | None = _f(None, "Upper clip range (1 + high); defaults to clip_ratio.")
    clip_ratio_c: float = _f(3.0, "Dual-clip bound for negative advantages; must be > 1.", gt=1)
    grad_clip: float = _f(1.0, "Clip the gradient norm to this value.", gt=0)
    loss_agg_mode: str = _f("token-mean", "How per-token losses L (response mask m) become one number, as verl "
                            "0.9.1, with the counts of the whole mini-batch (all micro-batches and ranks): "
                            "token-mean: sum(L*m) / valid tokens; token-sum: sum(L*m); seq-mean-token-sum: each "
                            "response's sum(L*m), averaged over the non-empty responses; seq-mean-token-mean: each "
                            "response's token-mean, averaged over the non-empty responses; seq-mean-token-sum-norm "
                            "(Dr.GRPO): seq-mean-token-sum / loss_scale_factor.", choices=LOSS_AGG_MODES)
    loss_scale_factor: float | None = _f(None, "The constant seq-mean-token-sum-norm divides by (the other modes "
                                         "ignore it); null: data.max_response_length, the width verl pads every "
                                         "response to (verl's name and default).", gt=0)
    use_kl_loss: bool = _f(True, "Add a KL-to-reference term to the loss (GRPO).")
    kl_loss_coef: float = _f(0.001, "Weight of the KL loss.", min=0)
    kl_loss_type: str = _f("low_var_kl", "KL estimator of the KL loss: k1/kl logp - ref; k2/mse 0.5 (logp - ref)^2; "
                           "k3/low_var_kl exp(r) - r - 1, r = ref - logp, clamped to [-10, 10]; abs |logp - ref|; "
                           "k1+/kl+ and k3+/low_var_kl+: the value of k1 or k3 with the gradient of k2 "
                           "(straight-through, as verl 0.9.1); differs from verl: k2+, mse+ and abs+ are refused.",
                           choices=KL_LOSS_TYPES)
    entropy_coeff: float = _f(0.0, "Entropy bonus weight (0 = off).", min=0)
    use_torch_compile: bool = _f(True, "On GPUs, compile each decoder layer's forward with torch.compile (actor "
                                 "and reference): faster steps after a one-off compilation.")
    activation_memory_budget: float = _f(1.0, "With use_torch_compile on GPUs: the share (0-1] of the compiled "
                                         "layers' activations kept for backward. Below 1, torch.compile "
                                         "recomputes the cheapest of the rest in backward (selective "
                                         "checkpointing): less memory for a little compute, so larger "
                                         "micro-batches fit.", gt=0)
    nan_policy: str = _f("skip", "What an optimizer step with a non-finite loss or gradient norm does: skip (drop "
                         "that step, keep training, warn) or stop (end the run as failed; the last checkpoint "
                         "stays).", choices=("skip", "stop"))

    def clip_range(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]; each side defaults to clip_ratio."""
        low = self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio
        high = self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio
        return low, high


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = _f(16, "Responses per reference forward pass.", min=1)
    log_prob_use_dynamic_bsz: bool | None = _f(None, "Reference passes by tokens (see actor.use_dynamic_bsz); "
                                               "null: as actor.use_dynamic_bsz.")
    log_prob_max_token_len_per_gpu: int | None = _f(None, "With dynamic micro-batches: the most positions a "
                                                    "reference pass holds; null: actor.ppo_max_token_len_per_gpu.",
                                                    min=1)
    fsdp_config: RefFSDPConfig = _section(RefFSDPConfig)


@dataclass
class MultiTurnConfig:
    enable: bool = _f(False, "Multi-turn episodes: the model's turns alternate with an environment's (tool outputs, "
                      "user messages) until it ends; tokens the policy did not sample carry no loss. The reward "
                      "function scores the last assistant message, plus the environment's reward parts.")
    environment: str = _f("tools", "The environment: tools (built in: runs the tool calls of each turn, ends at a "
                          "turn without one), a name registered with @register_environment, or "
                          "'path/to/file.py:Class' / 'module:Class' (a backend.Environment subclass).")
    tools: list[str] = _f([], "Tools offered to the model: built-in calculator and python (sandboxed), names "
                          "registered with @register_tool, or 'path/to/file.py:function' / 'module:function'.")
    tool_config_path: str = _f("", "A YAML file listing more tools (verl's shape: tools: [{class_name, config, "
                               "tool_schema}]).")
    format: str = _f("hermes", "How the model writes a tool call: hermes (<tool_call>{\"name\": ..., "
                     "\"arguments\": {...}}</tool_call>, as Qwen2.5/Qwen3 templates).", choices=("hermes",))
    max_assistant_turns: int = _f(5, "Most assistant turns an episode; one that still calls a tool then ends "
                                  "truncated (finish reason max_turns).", min=1)
    max_user_turns: int = _f(5, "Most environment turns (tool outputs or user messages) an episode.", min=0)
    max_tokens_per_turn: int = _f(0, "Most tokens the model writes in one turn (0: what is left of "
                                  "data.max_response_length). A turn cut there ends the episode as truncated; with "
                                  "rollout.ignore_eos (fixed-length benchmarks) every turn runs to it and the episode "
                                  "goes on.", min=0)
    max_parallel_calls: int = _f(1, "Tool calls run per assistant turn; later ones are answered with an error.",
                                 min=1)
    max_tool_response_length: int = _f(256, "Characters of a tool's output the model reads; longer output is cut.",
                                       min=1)
    tool_response_truncate_side: str = _f("middle", "Which part of a long tool output is kept: left (its start), "
                                          "right (its end), middle (both ends).", choices=("left", "middle", "right"))
    tool_timeout_s: float = _f(10.0, "A tool call (or an environment step) running longer is answered with a "
                               "timeout error and counted in tool/timeouts.", gt=0)


@dataclass
class RolloutConfig:
    name: str = _f("auto", "Rollout engine: workbench (our static-cache decode loop with CUDA graphs; Llama, "
                   "Mistral, Qwen2 and Qwen3 models), hf (Hugging Face generate; any causal LM), auto (workbench "
                   "where it runs, else hf), vllm (vLLM's offline engine in each worker, colocated with the actor; "
                   "optional: pip install 'grpo-workbench[vllm]', CUDA GPUs only).",
                   choices=("auto", "workbench", "hf", "vllm"))
    n: int = _f(4, "Responses sampled per prompt (the group size).", min=1)
    temperature: float = _f(1.0, "Sampling temperature.", gt=0)
    top_p: float = _f(1.0, "Nucleus sampling mass.", gt=0)
    top_k: int = _f(0, "Sample among the k likeliest tokens (0 = off).", min=0)
    log_prob_micro_batch_size_per_gpu: int = _f(16, "Responses per forward pass for old log-probs.", min=1)
    log_prob_use_dynamic_bsz: bool | None = _f(None, "Old log-prob passes by tokens (see actor.use_dynamic_bsz); "
                                               "null: as actor.use_dynamic_bsz.")
    log_prob_max_token_len_per_gpu: int | None = _f(None, "With dynamic micro-batches: the most positions an old "
                                                    "log-prob pass holds; null: actor.ppo_max_token_len_per_gpu.",
                                                    min=1)
    generation_batch_size: int = _f(64, "Most sequences generated at once.", min=1)
    ignore_eos: bool = _f(False, "Keep sampling past the end-of-sequence token up to data.max_response_length "
                          "(fixed-length benchmarks; as vLLM's ignore_eos).")
    enforce_eager: bool = _f(False, "Run the workbench or vLLM engine without CUDA graphs or compiled kernels "
                             "(slower; for debugging).")
    kv_cache_dtype: str = _f("auto", "The KV cache's dtype in the workbench and vLLM engines: auto (the compute "
                             "dtype) or fp8 (e4m3 without scales, as vLLM's kv_cache_dtype=fp8: half the memory and "
                             "the bytes a decode step reads, each key and value rounded to 3 mantissa bits, so the "
                             "sampler's probabilities move a little away from the trainer's).",
                             choices=("auto", "fp8"))
    free_cache_engine: bool = _f(True, "Free the rollout engine's GPU memory after each generation, so the update can "
                                 "use it: the workbench engine drops its KV cache and CUDA graphs (captured again "
                                 "next step); vLLM sleeps (sleep mode: its weights and KV cache are released and "
                                 "woken before the next generation).")
    gpu_memory_utilization: float = _f(0.5, "vLLM only: the share of each GPU's memory vLLM may take for its weights, "
                                       "activations and KV cache; the FSDP actor, reference and optimizer live in "
                                       "the rest. In (0, 1).", gt=0)
    multi_turn: MultiTurnConfig = _section(MultiTurnConfig)
    n_gpus_per_node: int = _f(1, "With trainer.rollout_mode=async: the rollout engine's own workers (GPUs, or "
                              "processes on the CPU), beside trainer.n_gpus_per_node of the actor (as verl's "
                              "one-step-off rollout.n_gpus_per_node).", min=1)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = _section(ModelConfig)
    actor: ActorConfig = _section(ActorConfig)
    ref: RefConfig = _section(RefConfig)
    rollout: RolloutConfig = _section(RolloutConfig)

    def log_prob_token_budget(self, section: RefConfig | RolloutConfig) -> int | None:
        """The most positions a micro-batch of that log-prob pass holds when it goes by tokens, else None (by
        rows); its log_prob_* keys left null take the actor's."""
        dynamic = section.log_prob_use_dynamic_bsz
        if dynamic is None:
            dynamic = self.actor.use_dynamic_bsz
        return (section.log_prob_max_token_len_per_gpu or self.actor.ppo_max_token_len_per_gpu) if dynamic else None


# ---- algorithm and reward ----

@dataclass
class KLControlConfig:
    type: str = _f("fixed", "KL-in-reward controller.", choices=("fixed", "adaptive"))
    kl_coef: float = _f(0.001, "Initial KL-in-reward coefficient.", min=0)
    target_kl: float = _f(0.1, "Target KL of the adaptive controller.", gt=0)
    horizon: int = _f(10000, "Horizon of the adaptive controller.", min=1)


@dataclass
class FilterGroupsConfig:
    enable: bool = _f(False, "DAPO dynamic sampling: drop prompts whose responses all score the same (they give "
                      "no gradient) and generate for more prompts until data.train_batch_size are kept.")
    max_num_gen_batches: int = _f(4, "Most generation rounds per step, each of data.train_batch_size prompts; if "
                                  "fewer groups are kept by then, the step trains on those.", min=1)


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = _f("token", "Truncated importance sampling between the rollout engine and the "
                                "trainer (verl's rollout correction, TRL's vllm_importance_sampling_correction): "
                                "with an engine that returns its sampling log-probs (vllm, and every engine on "
                                "the rollout workers of trainer.rollout_mode=async), each token's policy loss is "
                                "multiplied by min(exp(old_log_prob - rollout_log_prob), "
                                "rollout_is_threshold). token: on, per token; null: off (the mismatch metrics "
                                "rollout/* are logged either way).", choices=("token",))
    rollout_is_threshold: float = _f(2.0, "Cap of the importance-sampling weight (TIS).", gt=0)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "Advantage estimator: grpo, drgrpo (no std, no length normalisation), rloo "
                            "(leave-one-out baseline; a response alone in its group keeps its score, as verl "
                            "0.9.1's default rloo, where its rloo_vectorized gives 0), reinforce_plus_plus (the "
                            "return runs through masked positions inside a response, as verl 0.9.1), "
                            "reinforce_plus_plus_baseline, remax (greedy response as baseline), gae (PPO with a "
                            "critic: the critic.* keys).",
                            choices=("grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                                     "reinforce_plus_plus_baseline", "remax", "gae"))
    norm_adv_by_std_in_grpo: bool = _f(True, "Divide GRPO advantages by the group's reward std.")
    gamma: float = _f(1.0, "Discount factor (REINFORCE++, GAE).", min=0)
    lam: float = _f(1.0, "GAE lambda.", min=0)
    use_kl_in_reward: bool = _f(False, "Subtract a KL penalty from the reward instead of (or as well as) a loss.")
    kl_penalty: str = _f("kl", "KL estimator of the in-reward penalty (the estimators of "
                         "actor_rollout_ref.actor.kl_loss_type); differs from verl: the straight-through '+' types "
                         "are refused here, where verl accepts them to the same value: a reward has no gradient for "
                         "the '+' to change.", choices=KL_PENALTY_TYPES)
    kl_ctrl: KLControlConfig = _section(KLControlConfig)
    filter_groups: FilterGroupsConfig = _section(FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = _section(RolloutCorrectionConfig)


@dataclass
class CustomRewardConfig:
    path: str = _f("", "Python file (or module) holding your reward function; empty to use built-ins.")
    name: str = _f("compute_score", "Name of the function in that file.")


@dataclass
class OverlongBufferConfig:
    enable: bool = _f(False, "DAPO overlong reward shaping: a response longer than max_response_length - len "
                      "loses up to penalty_factor, linearly in its length.")
    len: int = _f(16, "Tokens before data.max_response_length over which the penalty grows.", min=1)
    penalty_factor: float = _f(1.0, "Penalty at data.max_response_length.", min=0)


@dataclass
class RewardConfig:
    gsm8k_scorer: str = _f("verl", "Rule for the GSM8K data sources (openai/gsm8k, gsm8k). verl: verl 0.9.1's "
                           "own rule (the number right after the last '#### ' in the last 300 characters, "
                           "compared as a string with the ground truth: 1 if equal, else 0), the default so that "
                           "a config brought from verl scores as there and accuracies compare with verl's. "
                           "lenient: ours, more signal for small models; differs from verl: numbers compared by "
                           "value, looser '####' forms, 0.5 for a right last number without '####'.",
                           choices=GSM8K_SCORERS)
    timeout_s: float = _f(10.0, "A reward call running longer scores 0 and is counted.", gt=0)
    rule_weight: float = _f(1.0, "Weight of the data_source scorer (or custom_reward_function) in the score; 0 "
                            "leaves it out (then reward.functions or reward_model score alone).", min=0)
    functions: list[str] = _f([], "More reward functions, each 'file.py:function' or 'module:function' with verl's "
                              "signature; each response's score adds weight x their scores, logged as "
                              "reward/<function>/mean. They run your code.")
    weights: list[float] = _f([], "One weight per reward.functions entry (empty: 1 each).")
    overlong_buffer: OverlongBufferConfig = _section(OverlongBufferConfig)


@dataclass
class RewardModelPathConfig:
    path: str = _f("", "A Hugging Face sequence-classification model (one output) folder or Hub id.")


@dataclass
class RewardModelConfig:
    enable: bool = _f(False, "Score responses with a reward model (its own worker group), added to the score with "
                      "reward_model.weight; logged as reward/reward_model/mean.")
    model: RewardModelPathConfig = _section(RewardModelPathConfig)
    weight: float = _f(1.0, "Weight of the reward model's score.")
    micro_batch_size_per_gpu: int = _f(8, "Responses per reward-model forward pass.", min=1)


# ---- critic (PPO with GAE) ----

@dataclass
class CriticModelConfig:
    path: str = _f("", "Value model's base (its transformer gets a new one-output head); empty = the actor's model.")
    enable_gradient_checkpointing: bool = _f(False, "Recompute the critic's activations in backward.")


@dataclass
class CriticOptimConfig:
    lr: float = _f(1e-5, "Critic AdamW learning rate.", gt=0)
    weight_decay: float = _f(0.01, "Critic AdamW weight decay.", min=0)
    betas: list[float] = _f([0.9, 0.999], "Critic AdamW betas.")
    lr_warmup_steps: int = _f(0, "Linear warm-up steps of the critic's learning rate.", min=0)


@dataclass
class CriticConfig:
    model: CriticModelConfig = _section(CriticModelConfig)
    optim: CriticOptimConfig = _section(CriticOptimConfig)
    ppo_micro_batch_size_per_gpu: int = _f(8, "Responses per critic forward/backward pass.", min=1)
    use_dynamic_bsz: bool = _f(False, "Form the critic's micro-batches (values and update) by tokens, as "
                               "actor_rollout_ref.actor.use_dynamic_bsz (verl's name).")
    ppo_max_token_len_per_gpu: int = _f(32768, "With use_dynamic_bsz: the most positions a critic micro-batch "
                                        "holds; at least data.max_prompt_length + data.max_response_length.", min=1)
    cliprange_value: float = _f(0.5, "How far a value prediction may move from the rollout's value (PPO value "
                                "clipping).", min=0)
    grad_clip: float = _f(1.0, "Clip the critic's gradient norm to this value.", gt=0)
    loss_agg_mode: str = _f("token-mean", "How per-token value losses become one number: the modes of "
                            "actor_rollout_ref.actor.loss_agg_mode.", choices=LOSS_AGG_MODES)
    loss_scale_factor: float | None = _f(None, "The constant seq-mean-token-sum-norm divides the value loss by; "
                                         "null: data.max_response_length.", gt=0)
    fsdp_config: FSDPConfig = _section(FSDPConfig)


# ---- trainer ----

@dataclass
class DebugConfig:
    attach_rank: int = _f(-1, "Worker rank that waits for a debugger (debugpy) to attach; -1 = off.", min=-1)
    attach_step: int = _f(1, "Training step at whose start that worker waits.", min=1)
    port: int = _f(5678, "Port the waiting worker listens on (on its node's address).", min=1)


@dataclass
class TrainerConfig:
    project_name: str = _f("grpo-workbench", "Project name (grouping for trackers).")
    experiment_name: str = _f("", "Run name; the run directory is named from it when set.")
    total_epochs: int = _f(1, "Passes over the training prompts (when total_training_steps is 0).", min=1)
    total_training_steps: int = _f(0, "Training steps; 0 = total_epochs worth.", min=0)
    save_freq: int = _f(0, "Checkpoint every N steps (0 = only at the end).", min=0)
    test_freq: int = _f(0, "Validate every N steps (0 = only at the end).", min=0)
    val_before_train: bool = _f(False, "Validate once before the first step.")
    resume_mode: str = _f("disable", "auto: continue from the run directory's last checkpoint.",
                          choices=("disable", "auto", "resume_path"))
    resume_from_path: str = _f("", "Checkpoint folder to start from when resume_mode=resume_path.")
    max_checkpoints_to_keep: int = _f(2, "Keep the newest N checkpoints (0 = all).", min=0)
    export_at_end: bool = _f(True, "Write export/ (a plain Hugging Face folder) when training ends.")
    stall_warning_s: float = _f(300.0, "The dashboard warns when a run reports no progress for this long; a call to "
                                "the workers running this long (or five times its recent median, if over a minute) "
                                "has every process's Python stacks written to diagnosis/.", gt=0)
    hang_timeout_s: float = _f(1800.0, "A call to the workers still running after this long fails the run with that "
                               "diagnosis instead of hanging (0 = wait forever).", min=0)
    token_log_max: int = _f(8, "Responses per step whose per-token log-probs, KL, entropy, advantage and clipping "
                            "are stored for the token view (0 = none).", min=0)
    rollout_log_max: int = _f(512, "Responses per step written to rollouts/ (0 = none).", min=0)
    logger: list[str] = _f(["console", "jsonl"], "Where metrics go: console, jsonl (always written), tensorboard, "
                           "wandb (offline unless WANDB_MODE is set), mlflow.")
    runs_root: str = _f("runs", "Folder that holds run directories.")
    device: str = _f("auto", "auto picks cuda when present, else cpu.", choices=("auto", "cpu", "cuda"))
    seed: int = _f(0, "Seed of sampling and initialisation.")
    deterministic: bool = _f(False, "Every rank uses deterministic algorithms only (PyTorch's deterministic mode, "
                             "cuBLAS with a fixed workspace, torch.compile without timing-based choices), so a run "
                             "repeats exactly with the same seed on the same machine and software: needed to tell "
                             "close settings of a sweep apart on a GPU, at some speed (attention's backward without "
                             "atomic adds). CPU runs repeat without it; vLLM's own kernels are not covered.")
    n_gpus_per_node: int = _f(1, "Workers per node: GPUs, or processes when trainer.device is cpu.", min=1)
    rollout_mode: str = _f("colocated", "colocated: the rollout engine lives in the actor's workers and generates "
                           "between updates. async: it gets its own workers (actor_rollout_ref.rollout."
                           "n_gpus_per_node), the weights go there by broadcast after each update, and with "
                           "trainer.max_staleness=1 the next step's responses are generated while this step trains.",
                           choices=("colocated", "async"))
    max_staleness: int = _f(1, "With trainer.rollout_mode=async: how many updates behind the actor a batch's "
                            "weights may be. 1: generate step k+1 while step k trains (one-step-off; the update "
                            "corrects with truncated importance weights against the rollout's log-probs). 0: "
                            "generate, then train (synchronous, on split workers).", min=0)
    nnodes: int = _f(1, "Nodes of the Ray cluster to use.", min=1)
    ray_address: str = _f("", "Ray cluster to join (host:6379, or auto for the one `ray start` made on this "
                          "machine); empty starts a private Ray in the training process.")
    gpu_share: float = _f(1.0, "On a Ray cluster: the share of one GPU the run's worker asks Ray for, so runs whose "
                          "shares add up to at most 1 train on the same GPU (Ray's fractional GPUs; a sweep sets it "
                          "from the planner's predicted memory). In (0, 1]; below 1 the run has one worker, "
                          "colocated.", gt=0)
    critic_warmup: int = _f(0, "Steps at the start that train only the critic (algorithm.adv_estimator=gae).", min=0)
    dump_steps: list[int] = _f([], "Steps whose actor update is saved, inputs and weights, to dumps/step_N for "
                               "`python -m backend replay` (one process, no Ray, --pdb to step through).")
    debug: DebugConfig = _section(DebugConfig)


@dataclass
class SFTConfig:
    train_files: list[str] = _f([], "Supervised warm-start (python -m backend sft): parquet files with a messages "
                                "column (one conversation a row). Loss on the assistant messages only; tool and user "
                                "messages are laid out token for token as in an episode, with the run's tools "
                                "(actor_rollout_ref.rollout.multi_turn.tools) in the prompt.")
    steps: int = _f(100, "Optimizer steps of the warm-start.", min=1)
    batch_size: int = _f(16, "Conversations per optimizer step.", min=1)
    lr: float = _f(1e-4, "AdamW learning rate of the warm-start (10 warm-up steps, then constant).", gt=0)
    max_length: int = _f(1024, "Tokens a conversation is cut to.", min=8)


@dataclass
class Config:
    data: DataConfig = _section(DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = _section(ActorRolloutRefConfig)
    critic: CriticConfig = _section(CriticConfig)
    algorithm: AlgorithmConfig = _section(AlgorithmConfig)
    custom_reward_function: CustomRewardConfig = _section(CustomRewardConfig)
    reward: RewardConfig = _section(RewardConfig)
    reward_model: RewardModelConfig = _section(RewardModelConfig)
    trainer: TrainerConfig = _section(TrainerConfig)
    sft: SFTConfig = _section(SFTConfig)


# ---- schema walking ----

def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def uses_critic(cfg: Config) -> bool:
    """Whether the run trains a value model (PPO's GAE needs one; the group estimators do not)."""
    return cfg.algorithm.adv_estimator == "gae"


def field_specs(cls: type = Config, prefix: str = "") -> dict[str, tuple[Any, dict]]:
    """Every leaf key as `dotted.path -> (type, metadata)`; what the UI and the reference docs show."""
    out: dict[str, tuple[Any, dict]] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            out.update(field_specs(tp, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (tp, dict(f.metadata))
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """Return `value` as type `tp`, or raise TypeError. Ints are accepted where floats are expected,
    a single string where a list of strings is (a common shorthand for one file)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg)
            except TypeError:
                continue
        raise TypeError
    if origin is list:
        inner = typing.get_args(tp)[0]
        if isinstance(value, str) and inner is str:
            value = [value]
        if not isinstance(value, list):
            raise TypeError
        return [_coerce(v, inner) for v in value]
    if tp is type(None):
        if value is None:
            return None
        raise TypeError
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `3e-6` (no dot) as a string; it is the way people write learning rates.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise TypeError from None
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError
    raise TypeError


def _closest(key: str, known: list[str]) -> str:
    leaf_matches = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    matches = leaf_matches or difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"; did you mean '{matches[0]}'?" if matches else ""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _set(cfg: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        cfg = getattr(cfg, p)
    setattr(cfg, leaf, value)


def _get(cfg: Any, dotted: str) -> Any:
    for p in dotted.split("."):
        cfg = getattr(cfg, p)
    return cfg


def from_dict(raw: dict, source: str = "config") -> Config:
    """Build a Config from a nested dict (YAML shape), collecting every problem before raising."""
    cfg, problems = _build(raw, source)
    if problems:
        raise ConfigError(problems)
    return cfg


def _build(raw: dict, source: str) -> tuple[Config, list[str]]:
    """The config with every key that could be read set, and a message for each that could not."""
    if not isinstance(raw, dict):
        return Config(), [f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}"]
    specs = field_specs()
    cfg = Config()
    problems: list[str] = []
    for key, value in _flatten(raw).items():
        if key not in specs:
            sections = {k.rsplit(".", 1)[0] for k in specs} | {k.split(".", 1)[0] for k in specs}
            if key in sections:
                if value not in ({}, None):
                    problems.append(f"{source}: '{key}' is a section; give it keys, not the value {value!r}")
                continue
            problems.append(f"{source}: unknown key '{key}'{_closest(key, list(specs))}")
            continue
        tp, meta = specs[key]
        try:
            value = _coerce(value, tp)
        except TypeError:
            problems.append(f"{source}: {key}={value!r} must be {_type_name(tp)}")
            continue
        _set(cfg, key, value)
    return cfg, problems


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as YAML, so `8` is an int and `[a, b]` a list)."""
    if "=" not in text:
        raise ConfigError([f"override '{text}' must look like key.path=value"])
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                section = ".".join(parents[: i + 1])
                raise ConfigError([f"'{key}' puts a key under '{section}', which is set to a value: "
                                   f"'{section}' cannot be both"])
        node[leaf] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                *, validate: bool = True) -> Config:
    """Read a YAML config (or the defaults when path is None), apply dotted overrides, validate."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {path} does not exist"])
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError([f"{path} is not valid YAML: {e}"]) from None
    return _config_from_raw(raw, overrides, str(path or "config"), validate=validate)


def _config_from_raw(raw: Any, overrides: list[str] | None, source: str, *, validate: bool) -> Config:
    """load_config after the YAML is read: overrides on top of the raw dict, build, validate."""
    flat = _flatten(raw) if isinstance(raw, dict) else raw
    problems: list[str] = []
    if isinstance(flat, dict):
        for text in overrides or []:
            try:
                key, value = parse_override(text)
            except ConfigError as e:
                problems.extend(e.problems)
                continue
            flat[key] = value
    if problems:
        raise ConfigError(problems)
    cfg, problems = _build(_nest(flat) if isinstance(flat, dict) else flat, source)
    if validate:
        try:
            validate_config(cfg)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:-1])) + (f" or {ds[-1]}" if len(ds) > 1 else str(ds[0]))


@dataclass
class BatchPlan:
    """The numbers people most often get wrong in verl and TRL: what one training step does."""

    prompts_per_step: int
    responses_per_step: int
    responses_per_mini_batch: int
    optimizer_steps_per_step: int
    micro_batches_per_mini_batch: int
    world_size: int


def batch_plan(cfg: Config) -> BatchPlan:
    a, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    mini = a.ppo_mini_batch_size * n
    return BatchPlan(
        prompts_per_step=cfg.data.train_batch_size,
        responses_per_step=cfg.data.train_batch_size * n,
        responses_per_mini_batch=mini,
        optimizer_steps_per_step=max(cfg.data.train_batch_size // max(a.ppo_mini_batch_size, 1), 1) * a.ppo_epochs,
        micro_batches_per_mini_batch=max(mini // max(a.ppo_micro_batch_size_per_gpu * world, 1), 1),
        world_size=world,
    )


def validate_config(cfg: Config) -> None:
    """Check every value against its allowed range and the cross-field rules; raise ConfigError listing
    all problems, each naming the key, the value and what is allowed."""
    problems: list[str] = []
    for key, (_, meta) in field_specs().items():
        value = _get(cfg, key)
        if value is None:
            continue
        if meta["choices"] and value not in meta["choices"]:
            problems.append(f"{key}={value!r} is not allowed; choose one of: {', '.join(meta['choices'])}")
        if meta["min"] is not None and isinstance(value, (int, float)) and value < meta["min"]:
            problems.append(f"{key}={value} must be >= {meta['min']:g}")
        if meta["gt"] is not None and isinstance(value, (int, float)) and value <= meta["gt"]:
            problems.append(f"{key}={value} must be > {meta['gt']:g}")

    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if not d.train_files:
        problems.append("data.train_files is empty: name at least one parquet file")
    if d.train_batch_size >= 1 and a.ppo_mini_batch_size >= 1:
        if a.ppo_mini_batch_size > d.train_batch_size:
            problems.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is larger than "
                            f"data.train_batch_size={d.train_batch_size}: a mini-batch is a part of the step's prompts")
        elif d.train_batch_size % a.ppo_mini_batch_size:
            problems.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.ppo_mini_batch_size}: choose a "
                            f"mini-batch that divides it ({_divisors(d.train_batch_size)})")
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    mini = a.ppo_mini_batch_size * r.n
    # Sizes below 1 already have their own message above; the arithmetic here needs them positive.
    if world >= 1 and mini >= 1 and a.ppo_micro_batch_size_per_gpu >= 1 and not a.use_dynamic_bsz and \
            mini % (a.ppo_micro_batch_size_per_gpu * world):
        problems.append(f"a mini-batch of {mini} responses (ppo_mini_batch_size={a.ppo_mini_batch_size} x "
                        f"rollout.n={r.n}) does not split into micro-batches of "
                        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu}"
                        f" on {world} worker(s): choose a micro-batch that divides {mini // world or mini} "
                        f"({_divisors(mini // world or mini)})")
    # Each token budget in use, once under the key that sets it (the log-prob passes' null means the actor's).
    longest = d.max_prompt_length + d.max_response_length
    actor_budget = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    budgets = {actor_budget: a.ppo_max_token_len_per_gpu} if a.use_dynamic_bsz else {}
    for name, s in (("ref", cfg.actor_rollout_ref.ref), ("rollout", r)):
        budget = cfg.actor_rollout_ref.log_prob_token_budget(s)
        if budget is not None:
            own = s.log_prob_max_token_len_per_gpu is not None
            budgets[f"actor_rollout_ref.{name}.log_prob_max_token_len_per_gpu" if own else actor_budget] = budget
    if uses_critic(cfg) and cfg.critic.use_dynamic_bsz:
        budgets["critic.ppo_max_token_len_per_gpu"] = cfg.critic.ppo_max_token_len_per_gpu
    for key, budget in budgets.items():
        if 1 <= budget < longest:
            problems.append(f"{key}={budget} is less than the longest row, data.max_prompt_length + "
                            f"data.max_response_length = {longest}: a micro-batch must hold at least one row")
    low, high = a.clip_range()
    if not 0 < low < 1:
        problems.append(f"actor_rollout_ref.actor.clip_ratio_low={low} must be between 0 and 1")
    if high <= 0:
        problems.append(f"actor_rollout_ref.actor.clip_ratio_high={high} must be > 0")
    if len(cfg.actor_rollout_ref.actor.optim.betas) != 2:
        problems.append("actor_rollout_ref.actor.optim.betas must hold two numbers, e.g. [0.9, 0.999]")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a checkpoint folder)")
    if r.top_p > 1:
        problems.append(f"actor_rollout_ref.rollout.top_p={r.top_p} must be in (0, 1]")
    if a.activation_memory_budget > 1:
        problems.append(f"actor_rollout_ref.actor.activation_memory_budget={a.activation_memory_budget} must be in "
                        "(0, 1]: the share of activations kept (1 keeps them all)")
    if r.gpu_memory_utilization >= 1:
        problems.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in "
                        "(0, 1): the actor, reference and optimizer need the rest of the GPU")
    if r.name == "vllm":
        problems.extend(vllm_support.config_problems(cfg))
    if r.kv_cache_dtype == "fp8" and r.name == "hf":
        problems.append("actor_rollout_ref.rollout.kv_cache_dtype=fp8 runs in the workbench and vLLM engines, and "
                        "rollout.name=hf keeps Hugging Face's cache in the compute dtype: choose rollout.name=auto, "
                        "workbench or vllm, or kv_cache_dtype=auto")
    if cfg.algorithm.adv_estimator in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline") and r.n < 2:
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the responses of one "
                        f"prompt, so actor_rollout_ref.rollout.n must be >= 2 (got {r.n})")
    if r.multi_turn.enable and cfg.algorithm.filter_groups.enable:
        problems.append("algorithm.filter_groups (dynamic sampling) does not run with "
                        "actor_rollout_ref.rollout.multi_turn.enable: turn one of them off")
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len > d.max_response_length:
        problems.append(f"reward.overlong_buffer.len={ob.len} is longer than data.max_response_length="
                        f"{d.max_response_length}: the penalty grows over the last len tokens before that limit")
    rw = cfg.reward
    if rw.weights and len(rw.weights) != len(rw.functions):
        problems.append(f"reward.weights has {len(rw.weights)} entries and reward.functions {len(rw.functions)}: give "
                        "one weight per function, or none for 1 each")
    if rw.rule_weight == 0 and not rw.functions and not cfg.reward_model.enable and not r.multi_turn.enable:
        problems.append("reward.rule_weight=0 leaves nothing to score: add reward.functions or reward_model.enable, "
                        "or give the rule scorer a weight")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        problems.append("reward_model.enable needs reward_model.model.path (a sequence-classification model)")
    if cfg.algorithm.filter_groups.enable and r.n < 2:
        problems.append("algorithm.filter_groups.enable keeps prompts whose responses score differently, so "
                        f"actor_rollout_ref.rollout.n must be >= 2 (got {r.n})")
    if uses_critic(cfg):
        micro = cfg.critic.ppo_micro_batch_size_per_gpu
        if world >= 1 and mini >= 1 and micro >= 1 and not cfg.critic.use_dynamic_bsz and mini % (micro * world):
            problems.append(f"a mini-batch of {mini} responses does not split into micro-batches of "
                            f"critic.ppo_micro_batch_size_per_gpu={micro} on {world} worker(s): choose one that "
                            f"divides {mini // world or mini} ({_divisors(mini // world or mini)})")
        if len(cfg.critic.optim.betas) != 2:
            problems.append("critic.optim.betas must hold two numbers, e.g. [0.9, 0.999]")
    problems.extend(check_trackers(cfg.trainer.logger))
    if cfg.trainer.nnodes > 1 and not cfg.trainer.ray_address:
        problems.append(f"trainer.nnodes={cfg.trainer.nnodes} needs a Ray cluster: set trainer.ray_address to its "
                        "head (ray start --head on one node, ray start --address=HEAD:6379 on the others)")
    if cfg.trainer.gpu_share > 1:
        problems.append(f"trainer.gpu_share={cfg.trainer.gpu_share} must be in (0, 1]: a worker takes one GPU at most")
    elif cfg.trainer.gpu_share < 1 and (world > 1 or cfg.trainer.rollout_mode == "async"):
        # Ray could put two of the run's own workers on one GPU, where their process group cannot meet.
        problems.append(f"trainer.gpu_share={cfg.trainer.gpu_share} shares a GPU between runs of one worker: this "
                        f"run has {world} actor worker(s) and trainer.rollout_mode={cfg.trainer.rollout_mode}; set "
                        "trainer.gpu_share=1, or one worker and trainer.rollout_mode=colocated")
    if world >= 1 and cfg.trainer.debug.attach_rank >= world:
        problems.append(f"trainer.debug.attach_rank={cfg.trainer.debug.attach_rank} is not a worker rank: this run "
                        f"has ranks 0 to {world - 1}")
    problems.extend(_async_problems(cfg))
    if problems:
        raise ConfigError(problems)


def _async_problems(cfg: Config) -> list[str]:
    """What trainer.rollout_mode=async does not run with: each of these generates on the actor's weights inside a
    step (or trains weights the broadcast does not carry)."""
    problems = []
    if cfg.trainer.max_staleness > 1:
        problems.append(f"trainer.max_staleness={cfg.trainer.max_staleness} is not allowed: 0 (synchronous) or 1 "
                        "(one step off), the staleness whose weights the rollout workers can hold while the actor "
                        "trains")
    if cfg.trainer.rollout_mode != "async":
        return problems
    arr, unsupported = cfg.actor_rollout_ref, []
    if arr.rollout.multi_turn.enable:
        unsupported.append("actor_rollout_ref.rollout.multi_turn.enable")
    if cfg.algorithm.filter_groups.enable:
        unsupported.append("algorithm.filter_groups.enable")
    if cfg.algorithm.adv_estimator == "remax":
        unsupported.append("algorithm.adv_estimator=remax")
    if arr.model.lora_rank > 0:
        unsupported.append("actor_rollout_ref.model.lora_rank > 0")
    return problems + [f"trainer.rollout_mode=async does not run with {key}: use trainer.rollout_mode=colocated, or "
                       "turn it off" for key in unsupported]


# ---- for the UI: YAML text in, config and messages out ----

_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def problems_by_key(problems: list[str]) -> dict[str, list[str]]:
    """Group ConfigError messages by the config key each one is about: the first dotted key of the schema
    that the message names ("" when it names none), so a form can show a message next to its field."""
    specs = field_specs()
    out: dict[str, list[str]] = {}
    for message in problems:
        key = next((m.group(0) for m in _DOTTED.finditer(message) if m.group(0) in specs), "")
        out.setdefault(key, []).append(message)
    return out


def _read_yaml_text(text: str, source: str) -> tuple[dict | None, list[str]]:
    try:
        raw = yaml.safe_load(text or "")
    except yaml.YAMLError as e:
        return None, [f"{source}: not valid YAML: {e}"]
    if raw is None:
        return {}, []
    if not isinstance(raw, dict):
        return None, [f"{source}: the top level must be a mapping of sections (data:, actor_rollout_ref:, ...), "
                      f"got {type(raw).__name__}"]
    return raw, []


def config_from_yaml_text(text: str, overrides: list[str] | None = None,
                          source: str = "config") -> tuple[Config | None, list[str]]:
    """The config a YAML text (plus dotted overrides) describes, validated like load_config does.
    Never raises: a text that does not parse and every validation problem come back as messages, and
    the config is None whenever there is one."""
    raw, problems = _read_yaml_text(text, source)
    if raw is None:
        return None, problems
    try:
        return _config_from_raw(raw, overrides, source, validate=True), []
    except ConfigError as e:
        return None, e.problems
    except (TypeError, ValueError, AttributeError) as e:  # e.g. an override under a section set to null
        return None, [f"{source}: cannot be read as a config: {e}"]


def get_value(cfg: Config, key: str) -> Any:
    """The value at a dotted key: `get_value(cfg, "actor_rollout_ref.rollout.n")`."""
    return _get(cfg, key)


def draft_config(text: str) -> Config | None:
    """Best effort for a form: every key of the YAML text that has the right type set, the defaults
    elsewhere, no validation. None when the text is not a YAML mapping."""
    raw, _ = _read_yaml_text(text, "config")
    if raw is None:
        return None
    return _build(raw, "config")[0]


def yaml_value(value: Any) -> str:
    """A value as it is written after `key=` on the command line (YAML flow style, one line)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()


def set_yaml_value(text: str, key: str, value: Any) -> str:
    """The YAML text with one dotted key set to `value`, other keys left as they are. Comments at the top
    of the text are kept; comments elsewhere are lost (the text is written anew). Raises ConfigError when
    the text is not a YAML mapping or the key is not in the schema."""
    if key not in field_specs():
        raise ConfigError([f"unknown key '{key}'{_closest(key, list(field_specs()))}"])
    raw, problems = _read_yaml_text(text, "config")
    if raw is None:
        raise ConfigError(problems)
    flat = _flatten(raw)
    flat[key] = value
    # `section:` left empty (null or {}) would block the keys now nested under it
    flat = {k: v for k, v in flat.items()
            if not (v in (None, {}) and any(other.startswith(k + ".") for other in flat))}
    header = []
    for line in (text or "").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            break
        header.append(line)
    while header and not header[-1].strip():
        header.pop()
    body = dump_yaml(_nest(flat))
    return "\n".join(header) + "\n" + body if header else body


class _Dumper(yaml.SafeDumper):
    """Lists of plain values on one line (`train_files: [a.parquet]`), as people write them by hand."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(v, (list, dict)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_yaml(raw: dict) -> str:
    """A config dict as YAML the way configs/ files are written: keys in the given order, short lists
    on one line, a blank line between top-level sections."""
    lines = yaml.dump(raw, Dumper=_Dumper, sort_keys=False, width=10**9).splitlines()
    out: list[str] = []
    for line in lines:
        if out and line[:1] not in ("", " ", "-"):
            out.append("")
        out.append(line)
    return "\n".join(out) + "\n"


def overrides_from_defaults(cfg: Config) -> list[str]:
    """`key=value` for every field that differs from the schema defaults, in schema order:
    `load_config(None, overrides_from_defaults(cfg)) == cfg`. Unquoted (one argv item each)."""
    defaults = Config()
    return [f"{key}={yaml_value(_get(cfg, key))}" for key in field_specs()
            if _get(cfg, key) != _get(defaults, key)]


def cli_command(config_path: str | Path = "config.yaml") -> str:
    """The command line that trains a saved YAML config."""
    return shlex.join(["python", "-m", "backend", "train", str(config_path)])


def cli_overrides_command(cfg: Config) -> str:
    """One line, no file needed: the schema defaults (the config path `defaults`) plus an override for
    every field that differs from them."""
    return shlex.join(["python", "-m", "backend", "train", "defaults", *overrides_from_defaults(cfg)])


def derived_numbers(cfg: Config) -> dict[str, int | str]:
    """What one training step does, from batch_plan. A count that does not come out whole is given as
    text saying so (e.g. "1.5 (6 / 4 is not whole)"); validate_config has the message to fix it."""
    plan = batch_plan(cfg)
    a = cfg.actor_rollout_ref.actor

    def ratio(num: int, den: int, whole: int, times: int = 1) -> int | str:
        if den >= 1 and num % den == 0:
            return whole
        return f"{num / den * times:g} ({num} / {den} is not whole)" if den >= 1 else f"{num} / {den} is not defined"

    micro = a.ppo_micro_batch_size_per_gpu * plan.world_size
    return {
        "prompts per step": plan.prompts_per_step,
        "responses per step": plan.responses_per_step,
        "responses per mini-batch": plan.responses_per_mini_batch,
        "optimizer steps per training step": ratio(cfg.data.train_batch_size, a.ppo_mini_batch_size,
                                                   plan.optimizer_steps_per_step, a.ppo_epochs),
        "micro-batches per mini-batch per device": (
            f"by tokens, up to {a.ppo_max_token_len_per_gpu} positions each" if a.use_dynamic_bsz
            else ratio(plan.responses_per_mini_batch, micro, plan.micro_batches_per_mini_batch)),
    }
