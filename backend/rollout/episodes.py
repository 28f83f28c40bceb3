"""Multi-turn episodes: the model's turns alternate with an environment's (tool outputs, user messages)
until the episode ends, and the trajectory stays token ids end to end.

The tokens the engine samples are appended as they came out (token ids out, never decoded and re-encoded),
then the environment's answer is appended as the chat template's own rendering of those messages. Two
drivers play the same episodes: `play_episodes` on the workbench engine, which keeps each episode in a
row of its KV cache and appends each observation there; `run_episodes` in lockstep turns for engines that
take whole prompts (Hugging Face generate, vLLM), each turn's prompt being the episode's whole prefix. The
batch layout is the single-turn one (see backend.rollout.base) with one difference: inside a response,
`response_mask` is 0 on the tokens the policy did not sample (observations), which every loss and
estimator skips, while `attention_mask` is 1 on them (the model reads them).

data.max_response_length counts every token after the prompt, observations included (as verl's agent
loop): an episode that reaches it, or max_assistant_turns / max_user_turns, ends truncated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.core.models import resolve_model
from backend.envs.deadlines import DeadlinePool, Outcome
from backend.envs.environment import Environment, Step, ToolLimits, load_environment
from backend.envs.tool_calls import tools_prompt
from backend.envs.tools import Tool, resolve_tools
from backend.rollout.base import RolloutBatch, SamplingParams, Turn, left_pad

# How an episode ended (its finish_reason in the rollout table): the model stopped and the environment
# said done; the token budget ran out; the turn limits were reached; the environment failed.
STOP, LENGTH, MAX_TURNS, ENV_ERROR = "stop", "length", "max_turns", "env_error"


def end_of_turn_ids(tokenizer, model_path: str) -> list[int]:
    """The ids that end an assistant turn: the tokenizer's EOS and the model's generation config's."""
    from transformers import GenerationConfig  # as backend.core.models: transformers loads on first need

    ids = [tokenizer.eos_token_id]
    with contextlib.suppress(OSError, ValueError):
        eos = GenerationConfig.from_pretrained(resolve_model(model_path)).eos_token_id
        ids += list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    return list(dict.fromkeys(i for i in ids if i is not None))


class ChatRenderer:
    """Token ids of an episode's first prompt and of each observation, as the tokenizer's chat template
    renders them. Tools go in through the template's `tools=` argument where it uses it, else as a system
    text (the hermes call format, see backend.envs.tool_calls)."""

    def __init__(self, tokenizer, tools: list[Tool], eos_ids: list[int]):
        self.tokenizer = tokenizer
        self.end_ids = eos_ids
        self.schemas = [t.schema() for t in tools]
        probe = [{"role": "user", "content": "x"}]
        self.native_tools = bool(tools) and self._text(probe, tools=self.schemas) != self._text(probe)
        self.system_text = tools_prompt(tools) if tools and not self.native_tools else ""
        # What precedes an observation: a finished assistant turn. Its ids up to the end-of-turn token are
        # what the model sampled; the template's rendering after that token is the observation's.
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        base_ids = self._ids(self._base)
        ends = [i for i, t in enumerate(base_ids) if t in eos_ids]
        self._cut = ends[-1] + 1 if ends else len(base_ids)
        self._base_ids = base_ids[:self._cut]
        # The tokens offering the tools add to every first prompt: data.max_prompt_length bounds the rest.
        self.tools_tokens = len(self.prompt(probe)[0]) - len(self._ids(probe, True))

    def _text(self, messages: list[dict], generation_prompt: bool = False, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **kwargs)

    def _ids(self, messages: list[dict], generation_prompt: bool = False, **kwargs) -> list[int]:
        return self.tokenizer(self._text(messages, generation_prompt, **kwargs), add_special_tokens=False)["input_ids"]

    def with_tools(self, messages: list[dict]) -> list[dict]:
        """The messages with the tools' system text, where the template does not take them itself."""
        if not self.system_text:
            return list(messages)
        if messages and messages[0].get("role") == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{self.system_text}"}, *messages[1:]]
        return [{"role": "system", "content": self.system_text}, *messages]

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """(ids, text) of the episode's first prompt, ending with the assistant's generation prompt."""
        kwargs = {"tools": self.schemas} if self.native_tools else {}
        text = self._text(self.with_tools(messages), True, **kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], text

    def observation(self, messages: list[dict]) -> list[int]:
        """Ids of `messages` as they follow an assistant turn, through the next assistant generation prompt."""
        full = self._ids(self._base + list(messages), True)
        if full[:self._cut] != self._base_ids:
            raise ValueError("the chat template renders earlier turns differently once an observation follows them, "
                             "so an observation's tokens cannot be cut out of its rendering")
        return full[self._cut:]


@dataclass
class Episode:
    """One row's trajectory: token ids after the prompt with their loss mask, and the turns for display."""

    prompt_ids: list[int]
    prompt_text: str
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 where the policy sampled the token
    log_probs: list[float] = field(default_factory=list)  # the engine's, 0 on observations (when it reports them)
    turns: list[dict] = field(default_factory=list)
    reward: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    error: str | None = None
    assistant_turns: int = 0
    observation_turns: int = 0
    observation_tokens: int = 0
    tool_seconds: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def last_assistant_text(self) -> str:
        texts = [t["text"] for t in self.turns if t["role"] == "assistant"]
        return texts[-1] if texts else ""

    def tool_calls(self) -> list[dict]:
        return [c for t in self.turns for c in t.get("tool_calls", [])]


@dataclass
class TurnLimits:
    max_response_length: int
    max_assistant_turns: int
    max_user_turns: int
    step_timeout_s: float = 60.0  # one environment step, its tools included
    max_tokens_per_turn: int = 0  # 0: what is left of max_response_length
    max_prompt_length: int = 0  # the first prompt's tokens, the tools' included; 0: any


@dataclass
class EpisodeSetup:
    """What every episode of a run shares, from actor_rollout_ref.rollout.multi_turn: the environment class,
    its tools and their limits, the chat renderer, the turn limits."""

    environment: type[Environment]
    tools: list[Tool]
    tool_limits: ToolLimits
    renderer: ChatRenderer
    limits: TurnLimits

    @classmethod
    def of(cls, cfg, tokenizer) -> EpisodeSetup:
        mt = cfg.actor_rollout_ref.rollout.multi_turn
        tools = resolve_tools(mt.tools, mt.tool_config_path)
        renderer = ChatRenderer(tokenizer, tools, end_of_turn_ids(tokenizer, cfg.actor_rollout_ref.model.path))
        limits = TurnLimits(cfg.data.max_response_length, mt.max_assistant_turns, mt.max_user_turns,
                            mt.tool_timeout_s * mt.max_parallel_calls, mt.max_tokens_per_turn,
                            cfg.data.max_prompt_length + renderer.tools_tokens)
        return cls(load_environment(mt.environment), tools, ToolLimits.of(mt), renderer, limits)

    def environments(self, n: int) -> list[Environment]:
        """A fresh environment for each of n episodes."""
        return [self.environment(self.tools, self.tool_limits) for _ in range(n)]


def run_episodes(generate: Callable[..., RolloutBatch], tokenizer,
                 renderer: ChatRenderer, envs: list[Environment], rows: list[dict], params: SamplingParams,
                 limits: TurnLimits, first_row: int = 0, progress: Callable[[str], None] | None = None,
                 timings: dict[str, float] | None = None) -> list[Episode]:
    """Run one episode per (env, row) pair in lockstep turns, for engines that take whole prompts: `rows[i]`
    is the data row episode i starts from (reset), and each turn `generate(prefixes, params, row_ids=...)`
    samples one response per unfinished episode's whole prefix, the row of episode i keyed
    first_row + i. Turn k's draws use seed params.seed + k * 7919, so episodes are the same on any
    number of workers, and the same as `play_episodes` gives. `timings` gets timing_s/tools: the wall
    time of the environment steps (all episodes of a turn step at once)."""
    turns = _Turns(tokenizer, renderer, envs, rows, params, limits)
    with turns.pool() as pool:
        for turn in range(limits.max_assistant_turns):
            active = [i for i, e in enumerate(turns.episodes) if not e.done]
            if not active:
                break
            if progress:
                progress(f"turn {turn + 1}: generating for {len(active)} of {len(envs)} episodes")
            caps = {i: turns.next_turn(i).max_new_tokens for i in active}
            out = generate([turns.episodes[i].prompt_ids + turns.episodes[i].ids for i in active],
                           dataclasses.replace(params, n=1, max_new_tokens=max(caps.values()),
                                               seed=turns.seed(turn)), row_ids=[first_row + i for i in active])
            texts = {}
            for row, i in enumerate(active):
                n = int(out.response_mask[row].sum())
                sampled = out.responses[row, :n][:caps[i]].tolist()
                log_probs = None if out.rollout_log_probs is None else \
                    out.rollout_log_probs[row, :len(sampled)].tolist()
                stopped = out.finish_reasons[row] == "stop" and len(sampled) == n
                text = turns.end_turn(i, sampled, stopped, log_probs)
                if text is not None:
                    texts[i] = text
            if progress and texts:
                progress(f"turn {turn + 1}: environment steps for {len(texts)} episodes")
            start = time.perf_counter()
            for step in [turns.step(pool, i, text) for i, text in texts.items()]:
                step.result()
            if timings is not None:
                timings["timing_s/tools"] = timings.get("timing_s/tools", 0.0) + time.perf_counter() - start
    return turns.finished()


def play_episodes(engine, tokenizer, renderer: ChatRenderer, envs: list[Environment], rows: list[dict],
                  params: SamplingParams, limits: TurnLimits, first_row: int = 0,
                  progress: Callable[[str], None] | None = None, timings: dict[str, float] | None = None
                  ) -> list[Episode]:
    """`run_episodes` on an engine that keeps each episode in its cache (StaticCacheEngine.play): the same
    episodes, token for token, but an episode's environment steps while the other rows go on
    decoding, and its next turn is appended to its cache instead of its prefix being prefilled again.
    `timings` gets timing_s/tools: the time the engine had no row to decode, waiting on environments."""
    turns = _Turns(tokenizer, renderer, envs, rows, params, limits)
    with turns.pool() as pool:
        def end_turn(i: int, sampled: list[int], stopped: bool) -> concurrent.futures.Future:
            text = turns.end_turn(i, sampled, stopped, None)
            if text is not None:
                return turns.step(pool, i, text)
            over: concurrent.futures.Future = concurrent.futures.Future()
            over.set_result(None)
            return over

        report = None if progress is None else (lambda finished, total: progress(
            f"episodes: {finished} of {total} finished"))
        waited = engine.play([turns.first_turn(i) for i in range(len(envs))], dataclasses.replace(params, n=1),
                             end_turn, limits.max_response_length, progress=report, first_row=first_row)
    if timings is not None:
        timings["timing_s/tools"] = timings.get("timing_s/tools", 0.0) + waited
    return turns.finished()


class _Turns:
    """What both drivers do at a turn's end, per episode: append the sampled ids, step the environment,
    append its observation, and say what the next turn may sample."""

    def __init__(self, tokenizer, renderer: ChatRenderer, envs: list[Environment], rows: list[dict],
                 params: SamplingParams, limits: TurnLimits):
        self.tokenizer, self.renderer, self.envs = tokenizer, renderer, envs
        self.params, self.limits = params, limits
        rendered: dict[str, tuple[list[int], str]] = {}  # a group's n episodes mostly start from the same messages
        self.episodes = [_start(env, row, renderer, limits.max_prompt_length, rendered)
                         for env, row in zip(envs, rows, strict=True)]

    def seed(self, turn: int) -> int:
        return self.params.seed + turn * 7919

    def next_turn(self, i: int, ids: list[int] | None = None) -> Turn:
        """Episode i's next turn: `ids` to append first, its budget (what is left of max_response_length,
        at most max_tokens_per_turn) and the seed of its turn."""
        e = self.episodes[i]
        budget = self.limits.max_response_length - len(e.ids)
        if self.limits.max_tokens_per_turn:
            budget = min(budget, self.limits.max_tokens_per_turn)
        return Turn(ids or [], budget, self.seed(e.assistant_turns))

    def first_turn(self, i: int) -> Turn | None:
        e = self.episodes[i]
        return None if e.done else self.next_turn(i, e.prompt_ids)

    def end_turn(self, i: int, sampled: list[int], stopped: bool, log_probs: list[float] | None) -> str | None:
        """Append the engine's sampled ids as they are (`stopped`: the last is the end-of-turn token);
        the assistant's text for the environment, or None when the episode ended (out of budget; with
        ignore_eos a turn that filled max_tokens_per_turn is whole and the episode goes on)."""
        e, limits = self.episodes[i], self.limits
        room = limits.max_response_length - len(e.ids)
        e.ids += sampled
        e.mask += [1] * len(sampled)
        e.log_probs += log_probs if log_probs is not None else [0.0] * len(sampled)
        e.assistant_turns += 1
        fixed_length = self.params.ignore_eos and len(sampled) == limits.max_tokens_per_turn and len(sampled) < room
        text = self.tokenizer.decode(sampled[:-1] if stopped else sampled, skip_special_tokens=True)
        e.turns.append({"role": "assistant", "text": text, "tokens": len(sampled)})
        if not (stopped or fixed_length):
            e.finish_reason = LENGTH
            return None
        return text

    def pool(self) -> DeadlinePool:
        """Where the environments step: at most 16 at once, each within limits.step_timeout_s."""
        return DeadlinePool(min(16, max(len(self.envs), 1)), self.limits.step_timeout_s)

    def step(self, pool: DeadlinePool, i: int, text: str) -> concurrent.futures.Future[Turn | None]:
        """Episode i's environment step on the assistant's text, on `pool`: a future of its next turn (the
        observation's ids to append), or of None when the episode ended."""
        def then(outcome: Outcome) -> Turn | None:
            e = self.episodes[i]
            before = len(e.ids)
            _apply_step(e, *_step_result(outcome, self.limits.step_timeout_s), outcome.seconds, self.renderer,
                        self.limits, e.assistant_turns >= self.limits.max_assistant_turns)
            return None if e.done else self.next_turn(i, e.ids[before:])

        env = self.envs[i]
        return pool.submit(lambda: env.step(text), then)

    def finished(self) -> list[Episode]:
        for e in self.episodes:
            if not e.ids:  # the environment failed before the model wrote anything: one masked token keeps the row
                e.ids, e.mask, e.log_probs = [self.renderer.end_ids[0]], [0], [0.0]
        return self.episodes


def _start(env: Environment, row: dict, renderer: ChatRenderer, max_prompt_length: int,
           rendered: dict[str, tuple[list[int], str]]) -> Episode:
    try:
        ids, text = _prompt(renderer, env.reset(row), rendered)
    except Exception as e:  # a user's reset: the episode fails, the run goes on
        ids, text = renderer.prompt(row["messages"])
        episode = Episode(ids, text)
        episode.finish_reason, episode.error = ENV_ERROR, f"reset raised {type(e).__name__}: {e}"
        return episode
    episode = Episode(ids, text)
    if max_prompt_length and len(ids) > max_prompt_length:
        # An engine with a fixed context (vLLM) would refuse it and end the whole generation.
        episode.finish_reason = ENV_ERROR
        episode.error = (f"the first prompt is {len(ids)} tokens (the tools' {renderer.tools_tokens} included), over "
                         f"data.max_prompt_length={max_prompt_length - renderer.tools_tokens} plus the tools': "
                         f"raise data.max_prompt_length or shorten what reset returns")
    return episode


def _prompt(renderer: ChatRenderer, messages: list[dict], rendered: dict[str, tuple[list[int], str]]
            ) -> tuple[list[int], str]:
    """renderer.prompt(messages), rendered once for the messages seen before in `rendered`."""
    try:
        key = json.dumps(messages, sort_keys=True)
    except TypeError:  # content that is not JSON (an image): rendered each time
        return renderer.prompt(messages)
    if key not in rendered:
        rendered[key] = renderer.prompt(messages)
    ids, text = rendered[key]
    return list(ids), text


def _step_result(outcome: Outcome, timeout_s: float) -> tuple[Step | None, str | None]:
    """The environment's step, or the episode's error: an exception, a step past timeout_s, not a Step."""
    if outcome.timed_out:
        return None, f"step did not return within {timeout_s:g} s"
    if outcome.error is not None:
        return None, f"step raised {type(outcome.error).__name__}: {outcome.error}"
    if not isinstance(outcome.value, Step):
        return None, f"step returned {type(outcome.value).__name__}, not a Step"
    return outcome.value, None


def _apply_step(e: Episode, step: Step | None, error: str | None, seconds: float, renderer: ChatRenderer,
                limits: TurnLimits, last_turn: bool) -> None:
    e.tool_seconds += seconds
    if error is not None:
        e.finish_reason, e.error = ENV_ERROR, error
        e.turns.append({"role": "error", "text": error})
        return
    e.turns[-1]["tool_calls"] = [c.as_dict() for c in step.tool_calls]
    for name, value in step.reward.items():
        e.reward[name] = e.reward.get(name, 0.0) + float(value)
    if step.done or not step.observation:
        e.finish_reason = STOP
        return
    if last_turn or e.observation_turns >= limits.max_user_turns:
        e.finish_reason = MAX_TURNS
        return
    try:
        ids = renderer.observation(step.observation)
    except Exception as exc:  # e.g. a message the template cannot render
        e.finish_reason, e.error = ENV_ERROR, f"observation could not be rendered: {type(exc).__name__}: {exc}"
        return
    room = limits.max_response_length - len(e.ids)
    kept = ids[:room]
    e.ids += kept
    e.mask += [0] * len(kept)
    e.log_probs += [0.0] * len(kept)
    e.observation_turns += 1
    e.observation_tokens += len(kept)
    for message in step.observation:
        e.turns.append({"role": message.get("role", "tool"), "text": str(message.get("content", "")),
                        **({"name": message["name"]} if "name" in message else {})})
    if len(kept) < len(ids) or len(e.ids) >= limits.max_response_length:
        e.finish_reason = LENGTH  # no room left for the model's next turn


def episode_batch(episodes: list[Episode], group_ids: torch.Tensor, pad_id: int, with_log_probs: bool
                  ) -> RolloutBatch:
    """The episodes in the batch layout: response_mask is 0 inside a response on observation tokens."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id)
    width = max(len(e.ids) for e in episodes)

    def padded(rows: list[list], pad: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=dtype)

    responses = padded([e.ids for e in episodes], pad_id, torch.long)
    response_mask = padded([e.mask for e in episodes], 0, torch.long)
    lengths = torch.tensor([len(e.ids) for e in episodes])
    attention = (torch.arange(width) < lengths.unsqueeze(1)).long()
    rollout_log_probs = padded([e.log_probs for e in episodes], 0.0, torch.float32) if with_log_probs else None
    return RolloutBatch(input_ids=torch.cat([prompt_ids, responses], 1),
                        attention_mask=torch.cat([prompt_mask, attention], 1), responses=responses,
                        response_mask=response_mask, prompt_index=group_ids,
                        finish_reasons=[e.finish_reason for e in episodes], rollout_log_probs=rollout_log_probs)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Turns, tool calls (in all, per tool, by failure kind), truncation, observation tokens, time in tools."""
    n = len(episodes)
    turns = torch.tensor([float(e.assistant_turns + e.observation_turns) for e in episodes])
    calls = [c for e in episodes for c in e.tool_calls()]
    m: dict[str, float] = {"num_turns/mean": turns.mean().item(), "num_turns/max": turns.max().item(),
                           "num_turns/min": turns.min().item(),
                           "multi_turn/assistant_turns/mean": sum(e.assistant_turns for e in episodes) / n,
                           "multi_turn/observation_tokens/mean": sum(e.observation_tokens for e in episodes) / n,
                           "multi_turn/truncated_by_budget": sum(e.finish_reason == LENGTH for e in episodes) / n,
                           "multi_turn/truncated_by_turns": sum(e.finish_reason == MAX_TURNS for e in episodes) / n,
                           "multi_turn/env_errors": float(sum(e.finish_reason == ENV_ERROR for e in episodes)),
                           "multi_turn/no_tool_call": sum(not e.tool_calls() for e in episodes) / n,
                           "tool/calls_per_episode/mean": len(calls) / n,
                           "tool/success_rate": sum(c["failure"] is None for c in calls) / len(calls) if calls else 0.0,
                           "multi_turn/tool_seconds/mean": sum(e.tool_seconds for e in episodes) / n}
    for kind in ("errors", "timeouts", "parse_errors", "unknown_tool", "bad_arguments"):
        m[f"tool/{kind}"] = float(sum(c["failure"] == kind for c in calls))
    for name in sorted({c["name"] for c in calls if c["name"]}):
        m[f"tool/{name}/calls"] = float(sum(c["name"] == name for c in calls))
    return m


def first_tool_error(episodes: list[Episode]) -> str | None:
    """The first failure's message (a tool's or an environment's), for the dashboard."""
    for e in episodes:
        if e.error:
            return f"environment: {e.error}"
        for c in e.tool_calls():
            if c["failure"]:
                return f"{c['name'] or 'tool call'}: {c['output']}"
    return None

