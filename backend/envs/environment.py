"""Environments: what answers a model's turns in an episode. One small class in a user's file::

    from backend import Environment, Step, register_environment

    @register_environment("guess")
    class Guess(Environment):
        def reset(self, row):                       # the first messages (default: the row's prompt)
            self.target = int(row["ground_truth"])
            return row["messages"]

        def step(self, assistant_text):             # after each assistant turn
            guess = int(assistant_text.strip() or 0)
            if guess == self.target:
                return Step(reward={"solved": 1.0}, done=True)
            hint = "higher" if guess < self.target else "lower"
            return Step(observation=[{"role": "user", "content": hint}])

and `actor_rollout_ref.rollout.multi_turn.environment=path/to/guess.py:Guess` (or the registered name once
the file is imported). One instance serves one episode. The built-in `tools` environment runs the tool
calls of each turn and ends the episode at the first turn without one; the run's reward function then
scores the episode's last assistant message, and the reward parts an environment returns are added to it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.envs.tool_calls import ToolCall, parse_calls, run_call
from backend.envs.tools import Tool, ToolError
from backend.rewards.registry import RewardError, load_module

KEY = "actor_rollout_ref.rollout.multi_turn.environment"


@dataclass
class Step:
    """What an environment answers to an assistant turn: messages for the model (role tool or user), reward
    parts (summed over the episode), and whether the episode is over."""

    observation: list[dict] | None = None
    reward: dict[str, float] = field(default_factory=dict)
    done: bool = False
    tool_calls: list[ToolCall] = field(default_factory=list)  # for the rollout table and the tool metrics


@dataclass
class ToolLimits:
    timeout_s: float = 10.0
    max_chars: int = 256  # verl's max_tool_response_length
    truncate_side: str = "middle"
    max_parallel_calls: int = 1

    @classmethod
    def of(cls, multi_turn: Any) -> ToolLimits:
        """The limits an actor_rollout_ref.rollout.multi_turn config section sets."""
        return cls(multi_turn.tool_timeout_s, multi_turn.max_tool_response_length,
                   multi_turn.tool_response_truncate_side, multi_turn.max_parallel_calls)


class Environment:
    """One episode's counterpart. `tools` are the run's tools (for environments that call them)."""

    def __init__(self, tools: list[Tool] | None = None, limits: ToolLimits | None = None):
        self.tools = {t.name: t for t in tools or []}
        self.limits = limits or ToolLimits()

    def reset(self, row: dict) -> list[dict]:
        """The episode's first messages; `row` is the data row (messages, ground_truth, extra_info, ...)."""
        return row["messages"]

    def step(self, assistant_text: str) -> Step:
        """The answer to one assistant turn (its text, without the end-of-turn token)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(self, assistant_text) -> Step")

    def run_tools(self, assistant_text: str) -> list[ToolCall]:
        """The tool calls of `assistant_text`, each run (the first max_parallel_calls; the rest are answered
        with an error saying so)."""
        calls = parse_calls(assistant_text)
        limit = self.limits
        out = [run_call(self.tools, name, args, problem, limit.timeout_s, limit.max_chars, limit.truncate_side)
               for name, args, problem in calls[:limit.max_parallel_calls]]
        out += [ToolCall(name, args, f"Error: only {limit.max_parallel_calls} tool call(s) a turn are run; this one "
                                     "was not", "bad_arguments") for name, args, _ in calls[limit.max_parallel_calls:]]
        return out


_REGISTRY: dict[str, type[Environment]] = {}


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator registering an Environment subclass under `name`; returns the class unchanged."""
    if not isinstance(name, str) or not name:
        raise ToolError("register_environment needs a name: @register_environment('my_env')")

    def decorate(cls: type[Environment]) -> type[Environment]:
        _check_class(cls, f"'{name}'")
        _REGISTRY[name] = cls
        return cls

    return decorate


def _check_class(cls: object, where: str) -> None:
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ToolError(f"{KEY}: {where} is not a subclass of backend.Environment (it must define "
                        "reset(self, row) and step(self, assistant_text))")
    if cls.step is Environment.step:
        raise ToolError(f"{KEY}: {where} ({cls.__name__}) does not define step(self, assistant_text) -> Step")


def known_environments() -> list[str]:
    return sorted(_REGISTRY)


def load_environment(target: str) -> type[Environment]:
    """A registered environment by name, or a class from 'file.py:Class' / 'module:Class'."""
    if ":" in target:
        path, _, name = target.rpartition(":")
        try:
            module = load_module(path, KEY)
        except RewardError as e:
            raise ToolError(str(e)) from None
        if not hasattr(module, name):
            found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, Environment)
                           and v is not Environment)
            raise ToolError(f"{KEY}: '{name}' is not defined in '{path}'; environments found there: "
                            f"{', '.join(found) or '(none)'}")
        cls = getattr(module, name)
        _check_class(cls, f"'{target}'")
        return cls
    if target in _REGISTRY:
        return _REGISTRY[target]
    close = difflib.get_close_matches(target, known_environments(), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ToolError(f"{KEY}='{target}' is not a registered environment.{hint} Known: "
                    f"{', '.join(known_environments())}; or give 'path/to/file.py:Class'")


@register_environment("tools")
class ToolEnvironment(Environment):
    """Runs the tool calls of each assistant turn and answers with their outputs (one tool message each);
    a turn without a tool call ends the episode."""

    def step(self, assistant_text: str) -> Step:
        calls = self.run_tools(assistant_text)
        if not calls:
            return Step(done=True)
        return Step(observation=[{"role": "tool", "name": c.name, "content": c.output} for c in calls],
                    tool_calls=calls)
