"""The GPU install as documented (README's "GPU install", docs/gpu.md) is the one the dry-run
bench checks (bench/gpu_install_dry_run.py) and the one the package and the fusion probe expect
(setup.py's gpu extra, platform.fusions.TE_MIN_VERSION)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path
from unittest import mock

from packaging.requirements import Requirement
from packaging.version import Version

from megatron_sat.platform.fusions import TE_MIN_VERSION

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_install_dry_run as bench  # noqa: E402


def _pip_lines(markdown: str) -> list[str]:
    """Every ``pip install`` line inside the fenced code blocks (continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.startswith("pip install")]


def test_readme_commands_are_the_documented_ones():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## GPU install", 1)[1].split("\n## ", 1)[0]
    in_readme = _pip_lines(section)
    assert in_readme == [
        "pip install -e .",
        "pip install -e .",
        'pip install --no-build-isolation "transformer_engine[pytorch]==2.20.2"',
    ]
    assert set(in_readme) <= set(_pip_lines((ROOT / "docs/gpu.md").read_text()))
    assert "(docs/gpu.md)" in section


def test_bench_runs_the_documented_commands():
    documented = _pip_lines((ROOT / "docs/gpu.md").read_text())
    for name in ("base", "py311", "te_torch"):  # te_core is the binary part of te_torch's
        assert bench.as_documented(bench.COMMANDS[name]) in documented, name
    assert bench.as_documented(bench.COMMANDS["te_torch"]) == (
        'pip install --no-build-isolation "transformer_engine[pytorch]==2.20.2"'
    )


def test_gpu_extra_and_probe_agree_on_transformer_engine():
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    (te,) = [Requirement(r) for r in setup.call_args.kwargs["extras_require"]["gpu"]]
    assert (te.name, te.extras) == ("transformer-engine", {"pytorch"})
    assert te.specifier.contains(TE_MIN_VERSION)
    assert not te.specifier.contains("2.5.99")  # the extra's floor is the probe's
    assert te.specifier.contains(bench.TE_VERSION)
    assert Version(bench.TE_VERSION) >= Version(TE_MIN_VERSION)
