"""Tool calls in a model's text: finding them (the hermes format, verl's `multi_turn.format=hermes`, which
Qwen2.5 and Qwen3 templates also use), checking their arguments against the tool's schema, running them
with a time limit, and offering the tools in the prompt where the chat template has no `tools=` support.

A call is written as::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347 * 86"}}
    </tool_call>

Whatever the model writes, the result is a `ToolCall` record: malformed JSON, an unknown tool, wrong
arguments, a tool that raises or runs past its time limit all become an error text the model reads next.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from backend.envs.tools import Tool, ToolFailure, ToolTimeout

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
FORMATS = ("hermes",)

# Kinds of failure, each counted in the metrics as tool/<kind>.
PARSE_ERROR, UNKNOWN_TOOL, BAD_ARGUMENTS, TOOL_ERROR, TIMEOUT = (
    "parse_errors", "unknown_tool", "bad_arguments", "errors", "timeouts")


@dataclass
class ToolCall:
    """One call as the model wrote it and what came back: `output` is what the model reads."""

    name: str
    arguments: dict[str, Any] | None
    output: str
    failure: str | None = None  # one of the kinds above, None when the tool answered
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "output": self.output, "failure": self.failure,
                "seconds": round(self.seconds, 4)}


def parse_calls(text: str) -> list[tuple[str, dict | None, str | None]]:
    """(name, arguments, problem) for each <tool_call> block of `text`, in order; problem says what is wrong
    with a block that is not a call (then name may be '' and arguments None)."""
    out = []
    for match in CALL.finditer(text):
        body = match.group(1).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(("", None, f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body[:200]!r}; "
                                  'write {"name": "<tool>", "arguments": {...}}'))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(("", None, 'the tool call must be a JSON object with a "name" string and an "arguments" '
                                  f"object, got {body[:200]!r}"))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            out.append((call["name"], None, f'"arguments" of the call to {call["name"]} must be a JSON object, got '
                                           f"{json.dumps(arguments)[:200]}"))
            continue
        out.append((call["name"], arguments, None))
    return out


_CHECKS = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def argument_problems(tool: Tool, arguments: dict) -> list[str]:
    """What is wrong with `arguments` for `tool`'s schema: missing or unknown names, wrong JSON types."""
    properties = tool.parameters.get("properties", {})
    problems = [f"missing argument '{name}'" for name in tool.parameters.get("required", []) if name not in arguments]
    for name, value in arguments.items():
        if name not in properties:
            problems.append(f"unknown argument '{name}' (takes: {', '.join(properties) or 'none'})")
            continue
        want = properties[name].get("type")
        kind = _CHECKS.get(want)
        wrong_bool = isinstance(value, bool) and want in ("integer", "number")
        if kind is not None and (not isinstance(value, kind) or wrong_bool):
            problems.append(f"argument '{name}' must be a {want}, got {json.dumps(value)[:80]}")
    return problems


def call_with_timeout(fn, timeout_s: float) -> tuple[Any, BaseException | None, bool]:
    """(value, exception, timed_out) of fn() run on a daemon thread for at most timeout_s: a tool that hangs
    is left behind (a thread cannot be killed; the sandboxed python tool kills its own process) and the
    episode goes on."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller as data: a tool must never end the run
            box["error"] = e

    thread = threading.Thread(target=run, name="tool", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, None, True
    return box.get("value"), box.get("error"), False


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """`text` cut to at most `limit` characters plus a marker (verl's max_tool_response_length and
    tool_response_truncate_side: left keeps the start, right the end, middle both ends)."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)"
    if side == "left":
        return text[:limit] + marker
    if side == "right":
        return marker + text[-limit:]
    half = limit // 2
    return text[:half] + marker + text[len(text) - (limit - half):]


def run_call(tools: dict[str, Tool], name: str, arguments: dict | None, problem: str | None, timeout_s: float,
             max_chars: int, truncate_side: str = "middle") -> ToolCall:
    """Run one parsed call; whatever goes wrong is the record's output and failure kind."""
    if problem is not None:
        return ToolCall(name, arguments, f"Error: {problem}", PARSE_ERROR if arguments is None and not name
                        else BAD_ARGUMENTS)
    tool = tools.get(name)
    if tool is None:
        return ToolCall(name, arguments, f"Error: there is no tool named '{name}'; the tools are: "
                                         f"{', '.join(tools) or 'none'}", UNKNOWN_TOOL)
    problems = argument_problems(tool, arguments)
    if problems:
        return ToolCall(name, arguments, f"Error: {name}: {'; '.join(problems)}", BAD_ARGUMENTS)
    start = time.perf_counter()
    value, error, timed_out = call_with_timeout(lambda: tool(**arguments), timeout_s)
    seconds = time.perf_counter() - start
    if timed_out:
        return ToolCall(name, arguments, f"Error: {name} did not answer within {timeout_s:g} s", TIMEOUT, seconds)
    if error is not None:
        text = str(error) if isinstance(error, ToolFailure) else f"{type(error).__name__}: {error}"
        kind = TIMEOUT if isinstance(error, ToolTimeout) else TOOL_ERROR
        return ToolCall(name, arguments, "Error: " + truncate(text, max_chars, truncate_side), kind, seconds)
    return ToolCall(name, arguments, truncate(value, max_chars, truncate_side), None, seconds)


def tools_prompt(tools: list[Tool]) -> str:
    """The system text that offers the tools to a model whose chat template takes no `tools=` argument."""
    listed = "\n".join(json.dumps(t.schema()) for t in tools)
    return ("You can call tools. To call one, write exactly\n<tool_call>\n"
            '{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
            "and stop; the result comes back in the next message. Answer without a tool call when you are done.\n"
            f"Tools:\n{listed}")
