"""The reward registry: a scorer per `data_source`, and a user's own function loaded from a file or a
module.

A scorer has verl's custom-reward signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None)
        -> float | dict

A dict return holds "score" (a number) and may hold other numeric parts ("correct", "format", ...)
and a string "pred" (the answer the scorer read from the response). Scorers are called with keyword
arguments, as verl calls them, so a user's function must use these four parameter names.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Scorer = Callable[..., "float | dict[str, Any]"]


class RewardError(ValueError):
    """A reward function cannot be found, loaded or called as configured."""


# ---- registry ----

_REGISTRY: dict[str, Scorer] = {}


def register_reward(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering a scorer for one or more `data_source` names; returns the function unchanged.

    Registering a name again replaces the earlier scorer (re-running a notebook cell or re-importing a
    user module must not fail).
    """
    if not data_sources or callable(data_sources[0]):
        raise RewardError(
            "register_reward needs at least one data_source name: use @register_reward('my_source')"
        )
    for name in data_sources:
        if not isinstance(name, str) or not name:
            raise RewardError(f"register_reward: data_source names must be non-empty strings, got {name!r}")

    def decorate(fn: Scorer) -> Scorer:
        _check_signature(fn, getattr(fn, "__name__", "?"), getattr(fn, "__module__", "?"))
        for name in data_sources:
            _REGISTRY[name] = fn
        return fn

    return decorate


def known_data_sources() -> list[str]:
    """The registered data_source names, sorted."""
    return sorted(_REGISTRY)


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for `data_source`; `RewardError` naming the known ones when there is none."""
    try:
        return _REGISTRY[data_source]
    except (KeyError, TypeError):
        pass
    known = known_data_sources()
    close = difflib.get_close_matches(str(data_source), known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise RewardError(
        f"no reward function is registered for data_source '{data_source}'.{hint} "
        f"Known data sources: {', '.join(known) or '(none)'}. To score it with your own function, set "
        "custom_reward_function.path (a .py file or module) and custom_reward_function.name (the function)."
    )


# ---- a user's own function ----

_CALL_SHAPE = "fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"


def load_custom_reward(path: str, name: str) -> Scorer:
    """Load a user's scorer named `name` from a .py file (relative or absolute) or an importable module.

    `path` is a file when it ends in ".py", contains a path separator, or names an existing file;
    otherwise it is imported as a module name (`pkg.mod`). With an empty `name`, `path` may be written
    as "target:function". Raises `RewardError` when the file is missing, the function is missing (listing
    the callables the file defines), the attribute is not callable, or its signature cannot be called as
    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...).
    """
    path, name = str(path).strip(), str(name or "").strip()
    if not name and ":" in path:
        target, _, func = path.rpartition(":")
        if func.isidentifier():
            path, name = target, func
    if not path:
        raise RewardError("custom_reward_function.path is empty: give a .py file or an importable module")
    if not name:
        raise RewardError(f"custom_reward_function.name is empty: give the name of the function in '{path}'")

    module = load_module(path)
    where = f"'{path}'"
    if not hasattr(module, name):
        defined = sorted(
            n for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RewardError(
            f"custom_reward_function.name='{name}' is not defined in {where}; "
            f"callables found there: {', '.join(defined) or '(none)'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(
            f"custom_reward_function.name='{name}' in {where} is a {type(fn).__name__}, not a function"
        )
    _check_signature(fn, name, where)
    return fn


def _check_signature(fn: Callable, name: str, where: str) -> None:
    """A scorer must accept verl's keyword call; say how to define it when it does not."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no introspectable signature; the call itself will tell
    try:
        signature.bind(data_source="", solution_str="", ground_truth="", extra_info=None)
    except TypeError as exc:
        raise RewardError(
            f"reward function '{name}{signature}' in {where} cannot be called as {_CALL_SHAPE} "
            f"({exc}); define it as def {name}(data_source, solution_str, ground_truth, extra_info=None)"
        ) from exc


def load_module(path: str, key: str = "custom_reward_function.path") -> Any:
    """A user's Python file (relative or absolute) or importable module; `key` is the config key that named
    it, for the messages."""
    as_file = path.endswith(".py") or "/" in path or "\\" in path or Path(path).is_file()
    if not as_file:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as exc:
            missing_itself = exc.name is None or path == exc.name or path.startswith(exc.name + ".")
            if not missing_itself:  # the module exists but imports something that does not
                raise RewardError(f"{key}: importing module '{path}' failed: {exc}") from exc
            raise RewardError(
                f"{key}='{path}' is neither an existing .py file nor an importable "
                "module; give a file path like path/to/reward.py or a module name like pkg.rewards"
            ) from exc
        except Exception as exc:
            raise RewardError(
                f"{key}: importing module '{path}' raised {type(exc).__name__}: {exc}"
            ) from exc

    file = Path(path).expanduser()
    resolved = file.resolve()
    if not resolved.is_file():
        raise RewardError(f"{key}: file not found: '{path}' (looked at {resolved})")
    # A stable, unique module name per file: two users' "reward.py" must not collide, and registering
    # in sys.modules lets classes and dataclasses defined in the file work (they look themselves up).
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", resolved.stem)
    module_name = f"_custom_reward_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise RewardError(f"{key}: cannot load '{path}' as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardError(f"{key}: loading '{path}' raised {type(exc).__name__}: {exc}") from exc
    return module


