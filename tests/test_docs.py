"""The documentation: the generated configuration reference is current, and links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_config_reference_is_current():
    """docs/configuration.md equals what tools/gen_config_reference.py makes of the dataclasses."""
    proc = subprocess.run(
        [sys.executable, "tools/gen_config_reference.py", "--check"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_reference_lists_known_fields():
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = {
        line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")
    }
    assert "| `int` | `1` |" in rows["`rollout.lag`"]
    assert "| `float` | `0.0001` |" in rows["`train.lr`"]
    assert "| `str` | `sat-gspo` |" in rows["`objective.name`"]
    assert "| `int` | `1` |" in rows["`parallel.tensor_model_parallel_size`"]
    assert "| `str` | `torchrun` |" in rows["`launch.launcher`"]
    for section in ("data", "rollout", "train", "objective", "parallel", "launch"):
        assert f"## `{section}` (" in text


def _links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text()))
    return _LINK.findall(text)


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file or folder that exists."""
    assert len(PAGES) > 1
    broken = []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor of the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_link_pattern_finds_links(tmp_path):
    """The link check sees inline links and skips code (so its pass is not vacuous)."""
    page = tmp_path / "p.md"
    page.write_text("see [a](docs/a.md) and [b](https://x.y)\n`[c](c.md)`\n```\n[d](d.md)\n```\n")
    assert _links(page) == ["docs/a.md", "https://x.y"]


def test_readme_layers_block():
    """The layout block between the layers markers, which tools parse, stays a fenced block."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- layers -->\n", 1)[1].split("<!-- /layers -->", 1)[0]
    lines = block.splitlines()
    assert lines[0] == "```" and lines[1] == "megatron_sat/" and lines[-1] == "```"
    folders = [line.split()[0] for line in lines[2:-1]]
    assert folders[0] == "cli.py" and folders[-1] == "routing/"
