"""Trying an environment by hand before training: the Data page's environment playground.

The user picks a data row, reads the first messages and the tools the model is offered, types what the
model might write, and sees the environment answer: each tool call run, the observation, the reward parts
and whether the episode is over. The same environment class and tools as the run's, with the same limits.
"""

from __future__ import annotations

import time
from typing import Any

from backend.core.config import MultiTurnConfig
from backend.core.data import row_item
from backend.envs.environment import Environment, Step, ToolLimits, load_environment
from backend.envs.tool_calls import call_with_timeout
from backend.envs.tools import resolve_tools


class EnvironmentTrial:
    """One episode of the configured environment, stepped by hand. Raises ToolError (bad tools or
    environment) or DataError (a row it cannot read) with the key or row at fault."""

    def __init__(self, multi_turn: MultiTurnConfig, row: dict[str, Any], where: str = "row"):
        self.limits = ToolLimits.of(multi_turn)
        tools = resolve_tools(multi_turn.tools, multi_turn.tool_config_path)
        self.tools = [t.schema() for t in tools]
        self.environment: Environment = load_environment(multi_turn.environment)(tools, self.limits)
        self.max_assistant_turns = multi_turn.max_assistant_turns
        self.turns: list[dict] = []
        self.done = False
        item = row_item(row, where)
        try:
            self.messages = list(self.environment.reset(item))
            self.error: str | None = None
        except Exception as e:  # the user's reset: shown, as a run would count it
            self.messages, self.error, self.done = list(item["messages"]), f"reset raised {type(e).__name__}: {e}", True

    def step(self, assistant_text: str) -> dict[str, Any]:
        """Answer one assistant turn as a run would: the environment's step, under the tool time limit.
        Returns the turn's record: assistant text, tool calls, observation, reward parts, done, error, seconds."""
        if self.done:
            raise ValueError("the episode is over: start again to try another")
        start = time.perf_counter()
        value, error, timed_out = call_with_timeout(lambda: self.environment.step(assistant_text),
                                                    self.limits.timeout_s * self.limits.max_parallel_calls)
        record: dict[str, Any] = {"assistant": assistant_text, "tool_calls": [], "observation": [], "reward": {},
                                  "done": True, "error": None, "seconds": time.perf_counter() - start}
        if timed_out:
            record["error"] = f"step did not return within {self.limits.timeout_s * self.limits.max_parallel_calls:g} s"
        elif error is not None:
            record["error"] = f"step raised {type(error).__name__}: {error}"
        elif not isinstance(value, Step):
            record["error"] = f"step returned {type(value).__name__}, not a Step"
        else:
            record.update(tool_calls=[c.as_dict() for c in value.tool_calls], observation=value.observation or [],
                          reward=dict(value.reward), done=value.done or not value.observation)
        self.turns.append(record)
        if len(self.turns) >= self.max_assistant_turns and not record["done"]:
            record["done"], record["truncated"] = True, "max_assistant_turns reached"
        self.done = record["done"]
        return record

    def total_reward(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for turn in self.turns:
            for name, value in turn["reward"].items():
                total[name] = total.get(name, 0.0) + float(value)
        return total
