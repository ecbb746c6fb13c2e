"""``pip install --dry-run --report`` of docs/gpu.md's install commands, on this machine.

    python bench/gpu_install_dry_run.py [--pip PATH]

Runs with the pip of this interpreter (its environment stands for "your CUDA torch
environment": its torch must stay as it is), from the repository root, against the package
index pip is configured with (PyPI); nothing is installed. Three dry runs:

- ``base``: ``pip install -e .``: it must resolve and keep the installed torch (no torch in the
  report's ``install`` list).
- ``py311``: docs/gpu.md's Python 3.11 line, ``pip install --no-deps --ignore-requires-python
  "megatron-core==0.19.2"`` (only judged on a 3.11 interpreter, which this machine has): it must
  resolve (megatron-core 0.19.2, or nothing when it is installed already).
- ``te_core``: transformer-engine's core library wheel, ``transformer_engine[core]==2.20.2``
  (binary, CUDA 12), must resolve.
- ``te_torch``: the documented ``pip install --no-build-isolation
  "transformer_engine[pytorch]==2.20.2"``. Its torch extension is a source package whose
  metadata is produced by running its build against the environment's torch (that is what
  ``--no-build-isolation`` buys). On a CUDA torch it resolves; on a CPU-only torch the build
  stops there, which this records as ``needs_cuda_torch`` (the proof that it builds against the
  installed torch rather than an isolated one).

The last line is JSON: ``gpu_install_dry_run`` is true when every dry run gave its expected
result, with per command the outcome, what it would install, and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TE_VERSION = "2.20.2"
MEGATRON_CORE = "megatron-core==0.19.2"
# The documented commands (docs/gpu.md), as pip arguments after `pip install`.
COMMANDS = {
    "base": ["-e", "."],
    "py311": ["--no-deps", "--ignore-requires-python", MEGATRON_CORE],
    "te_core": [f"transformer_engine[core]=={TE_VERSION}"],
    "te_torch": ["--no-build-isolation", f"transformer_engine[pytorch]=={TE_VERSION}"],
}


def as_documented(args: list[str]) -> str:
    """How docs/gpu.md writes the command (tests/test_gpu_docs.py finds it on the page)."""
    return " ".join(["pip install", *(f'"{a}"' if "==" in a else a for a in args)])


def dry_run(pip: list[str], args: list[str]) -> dict:
    """One ``pip install --dry-run --report`` from the repository root: ``ok``, ``install``
    (name==version per package pip would install), its output on failure, and ``seconds``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        start = time.perf_counter()
        proc = subprocess.run(
            [*pip, "install", "--dry-run", "--report", str(report), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        seconds = round(time.perf_counter() - start, 1)
        if proc.returncode != 0 or not report.exists():
            output = proc.stdout + proc.stderr
            errors = [line.strip() for line in output.splitlines() if "error" in line.lower()]
            return {"ok": False, "output": output, "error": errors[-3:], "seconds": seconds}
        items = json.loads(report.read_text())["install"]
        install = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items)
        return {"ok": True, "install": install, "seconds": seconds}


def torch_is_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


def judge(name: str, result: dict, cuda_torch: bool) -> str:
    """The outcome of one dry run against what docs/gpu.md promises."""
    names = {p.split("==")[0].lower().replace("_", "-") for p in result.get("install", [])}
    if name == "base":
        return "expected" if result["ok"] and "torch" not in names else "unexpected"
    if name == "py311":
        if sys.version_info[:2] != (3, 11):
            return "skipped: not Python 3.11"
        return "expected" if result["ok"] and names <= {"megatron-core"} else "unexpected"
    if name == "te_core":
        return "expected" if result["ok"] and "transformer-engine-cu12" in names else "unexpected"
    if result["ok"]:
        good = "transformer-engine-torch" in names and "torch" not in names
        return "expected" if good else "unexpected"
    text = result["output"]
    reached = "transformer_engine_torch" in text or "transformer-engine-torch" in text
    if not cuda_torch and reached and "metadata-generation-failed" in text:
        return "needs_cuda_torch"
    return "unexpected"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pip", default=f"{sys.executable} -m pip", help="pip command")
    args = parser.parse_args()
    pip = args.pip.split()
    cuda_torch = torch_is_cuda()
    results = {}
    for name, command in COMMANDS.items():
        result = dry_run(pip, command)
        result["outcome"] = judge(name, result, cuda_torch)
        results[name] = result
        print(f"{name}: {result['outcome']} ({result['seconds']} s)", flush=True)
    ok = all(
        r["outcome"] == "expected"
        or r["outcome"].startswith("skipped")
        or (name == "te_torch" and r["outcome"] == "needs_cuda_torch" and not cuda_torch)
        for name, r in results.items()
    )
    summary = {
        "gpu_install_dry_run": ok,
        "python": ".".join(map(str, sys.version_info[:3])),
        "cuda_torch": cuda_torch,
        **{name: {k: v for k, v in r.items() if k != "output"} for name, r in results.items()},
    }
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
