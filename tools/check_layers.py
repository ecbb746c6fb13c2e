#!/usr/bin/env python3
"""The package's import layers and its import cycles (run by tools/test.sh).

The layer order is README.md's: the fenced block between ``<!-- layers -->`` and
``<!-- /layers -->`` in its "## Layout" section names one layer per line (a folder ``x/`` or a
module ``x.py`` of the package), top to bottom. A module may import only modules of its own
layer or of a layer listed below it, at any place (module level, inside a function, under
``TYPE_CHECKING``). A folder line ``x/`` covers ``megatron_sat/x/**`` and ``megatron_sat/x.py``;
a module line ``x.py`` covers ``megatron_sat/x.py``. A module no line covers is an error, so a
new folder must be declared. The package's own ``__init__.py`` is exempt.

It also reports every import cycle between the package's modules, over all imports that run
(lazy ones included), with the names each import of the cycle brings in. An import under
``if TYPE_CHECKING:`` never runs, so it is no edge of a cycle (a module may name the type of
the object that calls it), but it still must point down the layers.

    python tools/check_layers.py           # one line per violation and per cycle, then a summary
    python tools/check_layers.py --json    # one JSON line: upward_imports, cycles, undeclared

Exit status 1 when anything is reported. Reads only README.md and ``megatron_sat/``; standard
library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "megatron_sat"
BEGIN, END = "<!-- layers -->", "<!-- /layers -->"
SECTION = "## Layout"
_LAYER_TOKEN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(/|\.py)$")


class LayersError(Exception):
    """README.md has no usable layers block."""


@dataclass(frozen=True)
class Layer:
    label: str  # as written: "training/" or "cli.py"
    name: str  # "training" or "cli"
    is_folder: bool
    rank: int  # 0 = the top


@dataclass(frozen=True)
class Import:
    """One import statement's reference from module ``source`` to module ``target``."""

    source: str
    target: str
    line: int
    names: tuple[str, ...]
    type_only: bool = False  # under ``if TYPE_CHECKING:``: checked for layers, never run


@dataclass
class Report:
    modules: dict[str, Path]  # dotted name -> path relative to the root
    layers: list[Layer]
    upward: list[tuple[Import, Layer, Layer]] = field(default_factory=list)  # (imp, src, tgt)
    cycles: list[list[Import]] = field(default_factory=list)
    undeclared: list[str] = field(default_factory=list)  # top-level names of the package

    @property
    def ok(self) -> bool:
        return not (self.upward or self.cycles or self.undeclared)

    def lines(self) -> list[str]:
        out = []
        for imp, src, tgt in self.upward:
            out.append(
                f"{self.modules[imp.source].as_posix()}:{imp.line} imports {imp.target} "
                f"(layer {tgt.label} is above {src.label})"
            )
        for name in self.undeclared:
            out.append(
                f"{PACKAGE}/{name}: in no layer of README.md's {BEGIN} block "
                f"(add a line for it to the layer order)"
            )
        for cycle in self.cycles:
            hops = " -> ".join(
                f"{self.modules[imp.source].as_posix()}:{imp.line} imports {imp.target} "
                f"({', '.join(imp.names)})"
                for imp in cycle
            )
            out.append(f"import cycle: {hops}")
        out.append(
            f"{len(self.upward)} upward import(s), {len(self.cycles)} import cycle(s), "
            f"{len(self.undeclared)} undeclared module(s) in {len(self.modules)} modules "
            f"over {len(self.layers)} layers"
        )
        return out

    def summary(self) -> dict:
        return {
            "upward_imports": len(self.upward),
            "cycles": len(self.cycles),
            "undeclared": len(self.undeclared),
            "modules": len(self.modules),
        }


def parse_layers(readme: str) -> list[Layer]:
    """The layers block of README text's "## Layout" section, top layer first."""
    lines = readme.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == SECTION)
    except StopIteration:
        raise LayersError(f"README.md has no '{SECTION}' section") from None
    stop = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = [line.strip() for line in lines[start + 1 : stop]]
    if BEGIN not in section or END not in section[section.index(BEGIN) :]:
        raise LayersError(f"README.md's '{SECTION}' section has no {BEGIN} ... {END} block")
    block = section[section.index(BEGIN) + 1 : section.index(END, section.index(BEGIN))]
    layers: list[Layer] = []
    seen: set[str] = set()
    for text in block:
        if not text or text.startswith("```") or text.split()[0] == f"{PACKAGE}/":
            continue
        match = _LAYER_TOKEN.match(text.split()[0])
        if not match:
            continue  # a continuation of the line above
        name, kind = match.groups()
        if name in seen:
            raise LayersError(f"README.md's layers block names {name} twice")
        seen.add(name)
        layers.append(Layer(match.group(0), name, kind == "/", len(layers)))
    if not layers:
        raise LayersError(f"README.md's {BEGIN} block names no layer")
    return layers


def find_modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> path relative to ``root`` for every .py file of the package."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = rel
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of the package's modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(
    module: str, path: Path, modules: dict[str, Path], package: str = PACKAGE
) -> list[Import]:
    """Every reference from ``module`` (file ``path``) to another module of the package, at
    any nesting (functions, ``if TYPE_CHECKING:``, try blocks)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_init = path.name == "__init__.py"
    found: list[Import] = []
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }

    def add(target: str | None, line: int, names: tuple[str, ...]) -> None:
        if target is not None and target != module:
            found.append(Import(module, target, line, names, id(node) in type_only))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    add(_resolve(alias.name, modules), node.lineno, (alias.name,))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = module.split(".") if is_init else module.split(".")[:-1]
                up = node.level - 1
                if up > len(here) - 1:
                    continue  # beyond the package: not ours
                base_parts = here[: len(here) - up] + (
                    node.module.split(".") if node.module else []
                )
                base = ".".join(base_parts)
            else:
                base = node.module or ""
            if not (base == package or base.startswith(package + ".")):
                continue
            by_target: dict[str | None, list[str]] = {}
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if alias.name != "*" and sub in modules else _resolve(base, modules)
                by_target.setdefault(target, []).append(alias.name)
            for target, names in by_target.items():
                add(target, node.lineno, tuple(names))
    return sorted(found, key=lambda imp: (imp.line, imp.target))


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` as an ``if`` test."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def layer_of(module: str, layers: list[Layer], modules: dict[str, Path], package: str = PACKAGE):
    """The layer covering ``module``, or None (the package's own __init__ also gives None)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    is_file = len(parts) == 2 and modules[module].name != "__init__.py"
    for layer in layers:
        if layer.name == parts[1] and (layer.is_folder or is_file):
            return layer
    return None


def find_cycles(edges: dict[str, dict[str, list[Import]]]) -> list[list[Import]]:
    """Import cycles: for every edge inside a strongly connected component, the shortest cycle
    through it; each distinct cycle once, rotated to start at its smallest module name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 10 * len(edges) + 1000))
    try:
        for v in sorted(edges):
            if v not in index:
                strongconnect(v)
    finally:
        sys.setrecursionlimit(old_limit)

    def shortest_path(src: str, dst: str, inside: set[str]) -> list[str]:
        previous = {src: src}
        queue = deque([src])
        while queue:
            v = queue.popleft()
            if v == dst:
                break
            for w in sorted(edges.get(v, {})):
                if w in inside and w not in previous:
                    previous[w] = v
                    queue.append(w)
        path = [dst]
        while path[-1] != src:
            path.append(previous[path[-1]])
        return path[::-1]

    cycles: dict[tuple[str, ...], list[Import]] = {}
    for component in components:
        for u in sorted(component):
            for v in sorted(edges[u]):
                if v not in component:
                    continue
                ring = [u, *shortest_path(v, u, component)[:-1]]  # u -> v -> ... -> (u)
                start = ring.index(min(ring))
                ring = ring[start:] + ring[:start]
                key = tuple(ring)
                if key not in cycles:
                    hops = zip(ring, ring[1:] + ring[:1])
                    cycles[key] = [edges[a][b][0] for a, b in hops]
    return [cycles[key] for key in sorted(cycles, key=lambda k: (len(k), k))]


def check(root: Path, readme: Path | None = None, package: str = PACKAGE) -> Report:
    """Check the package under ``root`` against the layers of ``readme`` (root/README.md)."""
    root = Path(root)
    layers = parse_layers((readme or root / "README.md").read_text(encoding="utf-8"))
    modules = find_modules(root, package)
    report = Report(modules, layers)
    edges: dict[str, dict[str, list[Import]]] = {}
    undeclared: set[str] = set()
    for module, rel in modules.items():
        source_layer = layer_of(module, layers, modules, package)
        if source_layer is None and module != package:
            top = rel.parts[1] + ("/" if len(rel.parts) > 2 else "")
            undeclared.add(top)
        for imp in imports_of(module, root / rel, modules, package):
            if not imp.type_only:
                edges.setdefault(module, {}).setdefault(imp.target, []).append(imp)
            target_layer = layer_of(imp.target, layers, modules, package)
            if (
                source_layer is not None
                and target_layer is not None
                and target_layer.rank < source_layer.rank
            ):
                report.upward.append((imp, source_layer, target_layer))
    report.undeclared = sorted(undeclared)
    report.cycles = find_cycles(edges)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    args = parser.parse_args(argv)
    try:
        report = check(args.root)
    except LayersError as err:
        print(f"check_layers: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.summary()))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
