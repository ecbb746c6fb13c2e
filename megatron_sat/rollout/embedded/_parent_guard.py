"""The embedded server's first import: end with the parent before the slow imports.

Run as ``python -m megatron_sat.rollout.embedded.server``, the server spends seconds (far
more on a loaded machine) importing torch, transformers and FastAPI before ``main`` runs; a
trainer SIGKILLed meanwhile would leave it behind until then, and ``bench/crash_resume.py``
found one still importing 15 s after such a kill. So ``server.py`` imports this module first,
which, only when the server module is the program being run, calls
``platform.lifetime.end_with_parent`` (parent-death signal, parent check, poll). ``lifetime.py``
is loaded from its file: it imports only the standard library, while ``megatron_sat.platform``'s
``__init__`` imports torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SERVER_MODULE = "megatron_sat.rollout.embedded.server"


def _guard() -> None:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or spec.name != SERVER_MODULE:
        return  # imported by something else (a test, the trainer): nothing to do
    path = Path(__file__).resolve().parents[2] / "platform" / "lifetime.py"
    loader_spec = importlib.util.spec_from_file_location("_megatron_sat_lifetime", path)
    lifetime = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(lifetime)
    lifetime.end_with_parent()


_guard()
