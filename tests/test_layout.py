"""The layout's rules, read off the import graph of backend/, app/ and pages/ (imports inside functions
count): no import loop, no module reaching into another's private names, each part importing only the
parts below it, and Streamlit only in the UI."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each part of backend/ may import of ours, besides itself. Lower parts never import higher ones.
ALLOWED = {
    "backend.algos": set(),  # the RL math: pure tensor functions
    "backend.kernels": set(),  # Triton kernels with their PyTorch checks
    "backend.rewards": set(),  # scorers: no model code
    "backend.core": set(),  # config, data, models, checkpoints, the run directory
    "backend.envs": {"backend.rewards"},  # environments and tools: what answers a model's turns
    "backend.rollout": {"backend.core", "backend.kernels", "backend.envs"},
    "backend.engine": {"backend.core", "backend.kernels", "backend.rollout", "backend.algos", "backend.rewards",
                       "backend.envs"},
    "backend.services": {"backend.core", "backend.kernels", "backend.rollout", "backend.algos", "backend.rewards",
                         "backend.engine", "backend.envs"},
}
# The UI holds no training logic: it calls the services and reads what core and rewards describe. The
# pre-run checks and the sampling settings are the two things it takes from lower down.
UI_ALLOWED = {"backend.services", "backend.core", "backend.rewards", "backend.engine.checks", "backend.rollout.base"}
TOP = {"backend", "backend.__main__", "backend.cli"}  # the public API and the command line sit above everything


def _modules() -> dict[str, Path]:
    found = {}
    for folder in ("backend", "app", "pages"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import of the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return out


def _edges() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a name that is itself a module counts as that module)."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(path):
            if module in MODULES:
                edges[name].add(module)
            edges[name].update(f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES)
        edges[name].discard(name)
    return edges


def _part(module: str) -> str:
    """The part of backend/ a module belongs to (backend.engine.trainer -> backend.engine)."""
    return ".".join(module.split(".")[:2])


def test_no_module_imports_another_in_a_loop():
    edges, seen, done, loops = _edges(), set(), set(), []

    def visit(module: str, path: list[str]) -> None:
        seen.add(module)
        path.append(module)
        for dep in sorted(edges[module]):
            if dep in path:
                loops.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in seen:
                visit(dep, path)
        path.pop()
        done.add(module)

    for module in sorted(edges):
        if module not in seen:
            visit(module, [])
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_no_module_imports_a_private_name_of_another():
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line} imports {n} from {module}"
           for name, path in MODULES.items() for module, names, line in _imports(path)
           if module.startswith("backend") for n in names
           if n.startswith("_") and not n.startswith("__") and module != name]
    assert not bad, "\n".join(bad)


def test_each_part_of_backend_imports_only_the_parts_below_it():
    edges = _edges()
    bad = []
    for name, deps in edges.items():
        if name in TOP or not name.startswith("backend."):
            continue
        allowed = ALLOWED[_part(name)] | {_part(name)}
        bad += [f"{name} imports {dep}" for dep in sorted(deps)
                if dep != "backend" and _part(dep) not in allowed]
    assert not bad, "\n".join(bad)


def test_the_ui_imports_services_not_the_engine():
    bad = []
    for name, deps in _edges().items():
        if name.startswith(("app.", "pages.")):
            bad += [f"{name} imports {dep}" for dep in sorted(deps) if dep.startswith("backend")
                    and not any(dep == a or dep.startswith(a + ".") for a in UI_ALLOWED)]
    assert not bad, "\n".join(bad)


def test_streamlit_is_imported_only_in_app_and_pages():
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line}" for name, path in MODULES.items()
           if name.startswith("backend") for module, _, line in _imports(path) if module.split(".")[0] == "streamlit"]
    assert not bad, "streamlit imported in backend: " + ", ".join(bad)


def test_the_rl_math_imports_no_kernels_and_nothing_else_of_ours():
    for name, path in MODULES.items():
        if name.startswith("backend.algos"):
            ours = [m for m, _, _ in _imports(path) if m.startswith("backend") and not m.startswith("backend.algos")]
            assert not ours, f"{name} imports {ours}"
