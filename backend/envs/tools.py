"""Tools a model may call during an episode: plain Python functions with a JSON schema, in a registry.

A tool is registered with `@register_tool` (the schema is read off the signature and docstring, or given),
or listed in a tool config file (verl's `multi_turn.tool_config_path` shape)::

    tools:
      - class_name: calculator              # a registered name, or path/to/file.py:function, module:function
        config: {wall_s: 5}                 # optional: keyword arguments bound into the function
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}  # optional

The built-ins are `calculator` (arithmetic without eval) and `python` (code run in a sandboxed process).
A tool returns text (anything else is shown as JSON); what it raises becomes an error the model reads.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from backend.envs.calculator import calculate
from backend.envs.sandbox import run_python
from backend.rewards.registry import RewardError, load_module


class ToolError(ValueError):
    """A tool that cannot be found, loaded or described as configured; the message says what to do."""


class ToolFailure(Exception):
    """Raised by a tool to hand the model exactly this message as its error (other exceptions are shown as
    'TypeName: message')."""


class ToolTimeout(ToolFailure):
    """Raised by a tool that ran out of its own time limit (counted as a timeout, not an error)."""


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the keyword arguments: {"type": "object", "properties": ..., "required": ...}
    fn: Callable[..., Any]
    config: dict = field(default_factory=dict)  # keyword arguments bound into every call

    def schema(self) -> dict:
        """The OpenAI function shape that chat templates' `tools=` argument takes."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __call__(self, **arguments: Any) -> str:
        out = self.fn(**arguments, **self.config)
        return out if isinstance(out, str) else json.dumps(out, default=str)


_REGISTRY: dict[str, Tool] = {}

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def schema_of(fn: Callable, description: str | None = None) -> tuple[str, dict]:
    """(description, parameters schema) read off a function: each parameter's type hint gives its JSON type,
    parameters without a default are required, the docstring's first paragraph is the description."""
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(name)) or hints.get(name)
        if hint not in _JSON_TYPES:
            raise ToolError(f"tool '{fn.__name__}': parameter '{name}' needs a type hint of str, int, float, bool, "
                            f"list or dict (found {hints.get(name)!r}), or give parameters= to register_tool")
        properties[name] = {"type": _JSON_TYPES[hint]}
        if p.default is p.empty:
            required.append(name)
    text = description or inspect.getdoc(fn) or ""
    return text.split("\n\n")[0].replace("\n", " ").strip(), {"type": "object", "properties": properties,
                                                              "required": required}


def register_tool(name: str | None = None, *, description: str | None = None,
                  parameters: dict | None = None) -> Callable[[Callable], Callable]:
    """Decorator registering a function as a tool the model can call; returns the function unchanged.

    The name defaults to the function's, the schema to what `schema_of` reads off it. Registering a name
    again replaces the earlier tool (re-importing a user file must not fail)."""
    if callable(name):
        raise ToolError("register_tool takes arguments: write @register_tool() or @register_tool('name')")

    def decorate(fn: Callable) -> Callable:
        text, schema = schema_of(fn, description) if parameters is None else (
            description or (inspect.getdoc(fn) or "").split("\n\n")[0], parameters)
        _REGISTRY[name or fn.__name__] = Tool(name or fn.__name__, text, schema, fn)
        return fn

    return decorate


def known_tools() -> list[str]:
    return sorted(_REGISTRY)


def get_tool(name: str) -> Tool:
    if name in _REGISTRY:
        return _REGISTRY[name]
    close = difflib.get_close_matches(name, known_tools(), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ToolError(f"no tool is registered as '{name}'.{hint} Known tools: {', '.join(known_tools())}; or give "
                    "'path/to/file.py:function' or 'module:function'")


def resolve_tool(target: str, config: dict | None = None, tool_schema: dict | None = None,
                 key: str = "actor_rollout_ref.rollout.multi_turn.tools") -> Tool:
    """A registered tool by name, or a function loaded from 'file.py:function' / 'module:function' (its
    file's @register_tool decorators run too); `config` is bound into its calls, `tool_schema` (the OpenAI
    function shape) replaces the schema read off it."""
    if ":" in target and not target.endswith(":"):
        path, _, name = target.rpartition(":")
        try:
            module = load_module(path, key)
        except RewardError as e:
            raise ToolError(str(e)) from None
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ToolError(f"{key}: '{name}' is not a function defined in '{path}'")
        registered = _REGISTRY.get(name)
        tool = registered if registered is not None and registered.fn is fn else Tool(name, *schema_of(fn), fn)
    else:
        tool = get_tool(target)
    if tool_schema:
        function = tool_schema.get("function", tool_schema)
        tool = Tool(function.get("name", tool.name), function.get("description", tool.description),
                    function.get("parameters", tool.parameters), tool.fn)
    if config:
        accepted = inspect.signature(tool.fn).parameters
        unknown = sorted(set(config) - set(accepted))
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            raise ToolError(f"{key}: tool '{tool.name}' takes no argument {', '.join(unknown)} in its config "
                            f"(it takes: {', '.join(accepted)})")
        tool = Tool(tool.name, tool.description, tool.parameters, tool.fn, dict(config))
    return tool


def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools a tool config file lists (verl's shape: tools: [{class_name, config, tool_schema}])."""
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    file = Path(path)
    if not file.is_file():
        raise ToolError(f"{key}: file not found: '{path}'")
    try:
        spec = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ToolError(f"{key}: '{path}' is not valid YAML: {e}") from None
    entries = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(entries, list):
        raise ToolError(f"{key}: '{path}' must hold a list under 'tools:', each entry with a class_name")
    tools = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolError(f"{key}: '{path}' tools[{i}] needs a class_name (a tool name or 'file.py:function')")
        tools.append(resolve_tool(entry["class_name"], entry.get("config") or {}, entry.get("tool_schema"),
                                  key=f"{key} ('{path}' tools[{i}])"))
    return tools


def resolve_tools(names: list[str], tool_config_path: str = "") -> list[Tool]:
    """The tools of a run: those named, then those of the tool config file; names must not repeat."""
    tools = [resolve_tool(n) for n in names] + (load_tool_config(tool_config_path) if tool_config_path else [])
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ToolError(f"two tools are named '{tool.name}': the model could not tell them apart; rename one "
                            "(tool_schema.function.name in the tool config)")
        seen.add(tool.name)
    return tools


# ---- built-ins ----

register_tool("calculator", parameters={
    "type": "object", "required": ["expression"],
    "properties": {"expression": {"type": "string",
                                  "description": "Arithmetic with numbers, + - * / // % ** and parentheses, "
                                                 "e.g. '347 * 86' or '(1200 + 3456) / 4'."}}},
    description="Evaluate an arithmetic expression exactly and return the result.")(calculate)


@functools.wraps(run_python)
def _python(code: str, **limits: Any) -> str:
    result = run_python(code, **limits)
    if result.error:
        message = result.error if not result.output else f"{result.output.rstrip()}\n{result.error}"
        raise (ToolTimeout if result.timed_out else ToolFailure)(message)
    return result.output


register_tool("python", parameters={
    "type": "object", "required": ["code"],
    "properties": {"code": {"type": "string", "description": "A Python program; what it prints is returned."}}},
    description="Run a short Python program in a sandbox (no network, no files outside its own empty folder, "
                "limited time and memory) and return what it prints.")(_python)
