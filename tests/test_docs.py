"""The config reference in docs/ is generated from the schema; a field added or changed without regenerating
it fails here, so the reference never lies."""

from __future__ import annotations

from pathlib import Path

from backend.cli import main
from backend.core.config import field_specs
from backend.core.docs import config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_the_generated_reference():
    stale = (ROOT / "docs" / "config.md").read_text() != config_reference()
    assert not stale, "docs/config.md is stale: run `python -m backend docs config` and commit the result"


def test_config_reference_lists_every_key_with_its_help_and_allowed_values():
    text = config_reference()
    for key, (_, meta) in field_specs().items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        assert meta["help"].replace("|", "\\|") in row
        for choice in meta["choices"]:
            assert f"`{choice}`" in row
    assert "| `actor_rollout_ref.actor.optim.lr` | float | `1e-06` | > 0 |" in text
    assert "Do not edit by hand" in text and "python -m backend docs config" in text


def test_docs_config_command_writes_the_reference(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["docs", "config", "--output", str(out)]) == 0
    assert out.read_text() == config_reference()
    assert str(out) in capsys.readouterr().out


def test_user_docs_link_to_files_that_exist():
    import re

    for name in ("concepts.md", "cluster.md", "troubleshooting.md", "config.md", "multi_turn.md"):
        doc = ROOT / "docs" / name
        for target in re.findall(r"\]\((?!https?://|#)([^)#]+)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{name} links to missing {target}"
