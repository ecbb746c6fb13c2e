"""The device check's offline install: the pins of tools/gpu_wheelhouse.txt that this Python
lacks, or holds at another version, installed from the wheelhouse that tools/gpu_wheelhouse.sh
downloads (the device has no network).

They go into a folder of their own (``pip install --target``), put first on ``sys.path`` and
``PYTHONPATH`` (subprocesses such as the embedded server see them too), so that the image's own
packages stay untouched and the check runs on exactly the pinned versions CI tests. Imports
nothing beyond the standard library: it runs before torch is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

WHEEL_LIST = Path(__file__).resolve().parents[2] / "tools" / "gpu_wheelhouse.txt"


class InstallError(RuntimeError):
    """The pins could not be installed (the message says which and why)."""


def pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    """Distribution name -> pinned version of the wheelhouse list ``path``."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[name] = version
    return out


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this Python imports, None when absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def to_install(
    wanted: dict[str, str], installed: Callable[[str], str | None] = installed_version
) -> list[str]:
    """``name==version`` of each pin of ``wanted`` that ``installed`` reports absent or at
    another version, in the list's order."""
    return [f"{n}=={v}" for n, v in wanted.items() if installed(n) != v]


def install_command(requirements: list[str], wheelhouse: Path, site: Path) -> list[str]:
    """pip's offline install of exactly ``requirements`` into ``site`` (``--no-deps``: the
    list is the closure; ``--upgrade``: replaces what an earlier run left in ``site``;
    ``--ignore-requires-python``: megatron-core 0.19 declares Python >= 3.12 and runs on
    3.11)."""
    return [
        *(sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"),
        *("--no-compile", "--upgrade", "--ignore-requires-python", "--find-links", str(wheelhouse)),
        *("--target", str(site), *requirements),
    ]


def install(wheelhouse: Path, site: Path) -> str:
    """Install the pins this Python lacks from ``wheelhouse`` into ``site`` and put ``site``
    first on the paths; returns one line saying what was done.

    Raises:
        InstallError: when a pin is needed and ``wheelhouse`` is no folder, when pip fails, or
            when a pin is still not importable at its version afterwards.
    """
    wanted = pins()
    needed = to_install(wanted)
    if not needed:
        return f"all {len(wanted)} pins of {WHEEL_LIST.name} present, nothing installed"
    if not wheelhouse.is_dir():
        raise InstallError(f"no wheelhouse at {wheelhouse} for {needed} (tools/gpu_wheelhouse.sh)")
    proc = subprocess.run(install_command(needed, wheelhouse, site), capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(f"pip install from {wheelhouse} failed: {proc.stderr[-2000:]}")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p
    )
    importlib.invalidate_caches()
    still = to_install(wanted)
    if still:
        raise InstallError(f"installed into {site}, yet not at the pinned version: {still}")
    return f"installed {len(needed)} of {len(wanted)} pins into {site}"
