"""The device check's wheelhouse (tools/gpu_wheelhouse.txt, downloaded by tools/gpu_wheelhouse.sh)
covers what tests/gpu/check_policy_trainer.py imports on an image that has only CUDA torch.

The imports are parsed (``ast``), not executed: every import of the check itself, and what
importing the package modules it uses runs (their module-level imports, recursively; function
bodies import lazily: transformer-engine, SGLang, ...), plus the embedded server module it
starts (``python -m megatron_sat.rollout.embedded.server``). The distributions providing them
and their dependencies (this environment's metadata), less torch and torch's own dependencies,
must all be pinned in the list, at the versions this environment tests; the check's installer
(tests/gpu/wheelhouse_install.py) reads the same list and installs exactly the pins that differ.
The wheelhouse's size (47.0 MiB, 38 wheels for CPython 3.12: 46.9 MiB measured, plus orjson's
0.13 MiB wheel) is printed and bounded by the script itself, which downloads: not repeated here.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "gpu" / "check_policy_trainer.py"
LIST = ROOT / "tools" / "gpu_wheelhouse.txt"
# modules found next to the check (sys.path entries it adds) or in this repository
LOCAL_DIRS = (ROOT, ROOT / "tests" / "dist", ROOT / "tests" / "gpu")
EXTRA_ROOTS = ("megatron_sat.rollout.embedded.server",)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def local_file(module: str) -> Path | None:
    parts = module.split(".")
    for base in LOCAL_DIRS:
        for candidate in (
            base.joinpath(*parts).with_suffix(".py"),
            base.joinpath(*parts, "__init__.py"),
        ):
            if candidate.is_file():
                return candidate
    return None


def imported_modules(tree: ast.AST, module: str, top_level_only: bool) -> set[str]:
    """Absolute names of the modules ``tree`` imports (relative imports resolved against
    ``module``); with ``top_level_only`` not those inside function bodies or
    ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if (
                top_level_only
                and isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".")[: -child.level]
                    base = ".".join([*package, base] if base else package)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


def third_party_imports() -> set[str]:
    """Top-level names of the non-stdlib, non-local modules the check's run imports."""
    seen: set[str] = set()
    todo = [(CHECK, "__main__", False), *((local_file(m), m, True) for m in EXTRA_ROOTS)]
    outside: set[str] = set()
    while todo:
        path, module, top_only = todo.pop()
        for name in imported_modules(ast.parse(path.read_text()), module, top_only):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            file = local_file(name)
            if file is not None:
                if name not in seen:
                    seen.add(name)
                    todo.append((file, name, True))
            elif local_file(top) is None:
                outside.add(top)
    return outside


def requirements_closure(roots: set[str]) -> set[str]:
    """Canonical names of ``roots`` and, transitively, their dependencies (markers evaluated
    here, no extras)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in md.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def pins() -> dict[str, str]:
    out = {}
    for line in LIST.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonical(name)] = version
    return out


def test_the_list_covers_every_import_of_the_check():
    modules = third_party_imports()
    # the check's own imports and the trainer's and the server's, found by parsing
    assert {"torch", "megatron", "transformers", "fastapi", "uvicorn", "httpx"} <= modules
    providers = md.packages_distributions()
    unknown = sorted(m for m in modules if m not in providers)
    assert not unknown, f"imported but not installed here: {unknown}"
    distributions = {canonical(d) for m in modules for d in providers[m]}
    image = requirements_closure({"torch"})  # the device image has CUDA torch
    needed = requirements_closure(distributions) - image
    listed = pins()
    assert not needed - set(listed), f"missing from {LIST.name}: {sorted(needed - set(listed))}"
    assert not set(listed) - needed, f"not needed in {LIST.name}: {sorted(set(listed) - needed)}"


def test_the_pins_are_the_tested_versions_and_the_check_installs_what_differs(monkeypatch):
    for name, version in pins().items():
        assert md.version(name) == version, name
    sys.path.insert(0, str(CHECK.parent))
    try:
        import wheelhouse_install as wi
    finally:
        sys.path.remove(str(CHECK.parent))
    assert wi.WHEEL_LIST == LIST
    assert {canonical(n): v for n, v in wi.pins().items()} == pins()
    assert wi.to_install(wi.pins()) == []  # this environment: nothing to install
    # the device image as last read: transformers 5.17.0, no megatron-core
    image = {"numpy": "2.4.6", "transformers": "5.17.0"}.get
    wanted = {"numpy": "2.4.6", "transformers": "5.23.0", "megatron-core": "0.19.2"}
    assert wi.to_install(wanted, image) == ["transformers==5.23.0", "megatron-core==0.19.2"]
    command = wi.install_command(["megatron-core==0.19.2"], Path("/w"), Path("/s"))
    assert command[1:] == [
        *("-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"),
        *("--upgrade", "--ignore-requires-python", "--find-links", "/w", "--target", "/s"),
        "megatron-core==0.19.2",
    ]
    assert wi.install(Path("/nowhere"), Path("/s")).startswith(f"all {len(pins())} pins")
    # a pin to install and no wheelhouse: refused, naming both
    monkeypatch.setattr(wi, "pins", lambda: {"no-such-distribution": "1.0"})
    with pytest.raises(wi.InstallError, match=r"no wheelhouse at /nowhere .*no-such-dist"):
        wi.install(Path("/nowhere"), Path("/s"))
