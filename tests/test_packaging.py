"""The wheel `pip install .` builds: it carries the engine, the workbench (app/, pages/, Streamlit defaults) and
the `grpo-wb` command, and `grpo-wb ui` finds the app inside the installed package, not in a checkout."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import backend
from backend.cli import build_parser, streamlit_command

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    had_build_dir = (ROOT / "build").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, cwd=tmp_path_factory.mktemp("cwd"))
    if not had_build_dir:  # setuptools builds in the source tree; leave the checkout as it was
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    [whl] = out.glob("grpo_workbench-*.whl")
    return whl


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    return target


def _run_installed(site: Path, *args: str, cwd: Path) -> str:
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); sys.argv[0] = 'grpo-wb'; "
            "from backend.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_wheel_carries_the_engine_the_workbench_pages_and_streamlit_defaults(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (ROOT / "backend").glob("*.py"):
        assert f"backend/{module.name}" in names
    assert "backend/workbench/app/main.py" in names
    for page in (ROOT / "pages").glob("*.py"):
        assert f"backend/workbench/pages/{page.name}" in names
    assert "backend/workbench/streamlit/config.toml" in names
    assert not [n for n in names if n.startswith(("tests/", "app/", "pages/", "sample_data/", "runs/"))]


def test_every_backend_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "backend").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_wheel_declares_the_grpo_wb_console_script_and_the_version_from_backend(wheel):
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(f"grpo_workbench-{backend.__version__}.dist-info/entry_points.txt").decode()
        metadata = z.read(f"grpo_workbench-{backend.__version__}.dist-info/METADATA").decode()
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert parser["console_scripts"]["grpo-wb"] == "backend.cli:main"
    assert f"\nVersion: {backend.__version__}\n" in metadata


def test_installed_package_imports_and_runs_from_outside_the_checkout(site, tmp_path):
    assert (site / "backend" / "cli.py").is_file()
    assert (site / "bin" / "grpo-wb").is_file()
    out = _run_installed(site, "--version", cwd=tmp_path)
    assert out.strip() == f"grpo-workbench {backend.__version__}"
    assert "ui" in _run_installed(site, "--help", cwd=tmp_path)


def test_grpo_wb_ui_runs_the_installed_app_on_localhost_with_extra_arguments_passed_through(site, tmp_path):
    out = _run_installed(site, "ui", "--print-command", "--server.port", "8599", cwd=tmp_path)
    command = out.split()
    assert command[1:4] == ["-m", "streamlit", "run"]
    assert Path(command[4]) == site / "backend" / "workbench" / "app" / "main.py"
    assert (site / "backend" / "workbench" / "pages" / "runs.py").is_file()  # app/main.py's ../pages/ paths
    assert command.count("--server.address=127.0.0.1") == 1
    assert "--server.headless=true" in command
    assert command[-2:] == ["--server.port", "8599"]


def test_ui_command_from_a_checkout_uses_the_repository_app():
    command = streamlit_command(["--server.port", "8600"])
    assert command[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(command[4]) == ROOT / "app" / "main.py"
    assert command[-3:] == ["--server.address=127.0.0.1", "--server.port", "8600"]


def test_cli_subcommands_include_ui_and_docs():
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert {"train", "data", "eval", "export", "generate", "ui", "docs"} <= set(choices)


def test_changelog_has_an_entry_for_the_current_version():
    assert f"## [{backend.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
