"""Where the workbench may read and write: the workspace root (the folder the app was started in) and
any extra roots named in `GRPO_WB_ROOTS` (os.pathsep-separated). Every path or name typed into the UI
goes through these checks, so nothing outside the roots is read or written and no text reaches a shell.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SHELL_CHARS = set(";&|`$<>\\!*?\"'\n\r\t{}()[]")


class PathError(ValueError):
    """A path or name the workbench refuses; the message says what is allowed."""


def workspace_root() -> Path:
    return Path(os.environ.get("GRPO_WB_HOME") or os.getcwd()).resolve()


def allowed_roots() -> list[Path]:
    extra = [Path(p).expanduser().resolve() for p in os.environ.get("GRPO_WB_ROOTS", "").split(os.pathsep) if p]
    return [workspace_root(), *extra]


def runs_root() -> Path:
    return workspace_root() / "runs"


def saved_configs_dir() -> Path:
    return workspace_root() / "configs" / "saved"


def uploads_dir() -> Path:
    return workspace_root() / "uploads"


def check_name(name: str, what: str = "name") -> str:
    """A run or config name: letters, digits, '.', '_' and '-', at most 64 characters."""
    if not _NAME.match(name or "") or ".." in name:
        raise PathError(f"{what} {name!r} is not allowed: use letters, digits, '.', '_' and '-' "
                        "(at most 64 characters, starting with a letter or digit)")
    return name


def safe_path(text: str, *, must_exist: bool = True, suffixes: tuple[str, ...] = ()) -> Path:
    """Resolve a user-typed path (relative to the workspace root, or absolute) that must lie inside an
    allowed root. Refuses '..', shell metacharacters, links out of the roots, and other suffixes."""
    text = (text or "").strip()
    if not text:
        raise PathError("no path given")
    if any(c in _SHELL_CHARS for c in text):
        raise PathError(f"path {text!r} contains characters that are not allowed in paths here")
    if ".." in Path(text).parts:
        raise PathError(f"path {text!r} contains '..': give a path inside {_roots_text()}")
    candidate = Path(text).expanduser()
    if not candidate.is_absolute():
        candidate = workspace_root() / candidate
    resolved = candidate.resolve()
    if not any(resolved == root or root in resolved.parents for root in allowed_roots()):
        raise PathError(f"path {text!r} is outside the allowed folders ({_roots_text()}); "
                        "add a folder to GRPO_WB_ROOTS to allow it")
    if suffixes and resolved.suffix.lower() not in suffixes:
        raise PathError(f"{text!r} is not a {' or '.join(suffixes)} file")
    if must_exist and not resolved.exists():
        raise PathError(f"{text!r} does not exist")
    return resolved


def _roots_text() -> str:
    return ", ".join(str(r) for r in allowed_roots())
