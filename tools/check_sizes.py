#!/usr/bin/env python3
"""The package's function-size budget (run by tools/test.sh).

Every function and method in ``megatron_sat/`` is at most ``LIMIT`` lines, measured as its whole
``def`` span (``end_lineno - lineno + 1``: signature, docstring, body and nested definitions;
decorators not counted). The orchestrators of ``ORCHESTRATORS`` have a stricter budget of their
own, and a function of ``ALLOWED`` a larger one, with the reason it must stay long. An entry of
either dict whose function no longer exists is an error, so a budget cannot lapse silently
through a rename or a move; so is an ``ALLOWED`` entry whose function fits ``LIMIT`` again.

Keys are ``path::Qualname``: the path relative to the repository root and the dotted name
inside the module (``Class.method``; a nested function is ``outer.inner``).

    python tools/check_sizes.py           # one line per offender, then a summary
    python tools/check_sizes.py --json    # one JSON line: over_budget, largest, stale

Exit status 1 when anything is reported. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "megatron_sat"
LIMIT = 100

# The run's two orchestrators: they say what happens in which order and delegate the rest.
ORCHESTRATORS: dict[str, int] = {
    "megatron_sat/training/trainer.py::PolicyTrainer.rl_step": 60,
    "megatron_sat/training/rl.py::_lead": 60,  # the RL loop's lead rank
}

# "path::Qualname": (max_lines, "why it must stay long"): one entry per function that cannot be
# split without making it harder to read, each with its reason.
ALLOWED: dict[str, tuple[int, str]] = {
    "megatron_sat/rollout/embedded/server.py::create_app": (
        134,
        "the embedded server's FastAPI app: one short route closure per SGLang endpoint over one "
        "shared engine state, read top to bottom against SGLang's http_server.py",
    ),
}


@dataclass(frozen=True)
class Function:
    key: str  # "megatron_sat/a/b.py::Class.method"
    line: int
    lines: int


@dataclass
class Report:
    functions: list[Function]
    over: list[tuple[Function, int, str]] = field(default_factory=list)  # (fn, budget, why)
    stale: list[str] = field(default_factory=list)  # messages about dict entries

    @property
    def ok(self) -> bool:
        return not (self.over or self.stale)

    @property
    def largest(self) -> Function | None:
        return max(self.functions, key=lambda fn: fn.lines, default=None)

    def lines(self) -> list[str]:
        out = []
        for fn, budget, why in self.over:
            path, qualname = fn.key.split("::")
            out.append(f"{path}:{fn.line} {qualname} is {fn.lines} lines (budget {budget}: {why})")
        out.extend(self.stale)
        largest = self.largest
        biggest = f"; largest {largest.key} ({largest.lines} lines)" if largest else ""
        out.append(
            f"{len(self.over)} function(s) over budget, {len(self.stale)} stale budget "
            f"entr{'y' if len(self.stale) == 1 else 'ies'} in {len(self.functions)} "
            f"functions{biggest}"
        )
        return out

    def summary(self) -> dict:
        largest = self.largest
        return {
            "over_budget": len(self.over),
            "largest": {"name": largest.key, "lines": largest.lines} if largest else None,
            "stale": len(self.stale),
            "functions": len(self.functions),
        }


def functions_of(path: Path, rel: str) -> list[Function]:
    """Every function and method of one file, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    size = child.end_lineno - child.lineno + 1
                    found.append(Function(f"{rel}::{qualname}", child.lineno, size))
                visit(child, qualname + ".")
            else:
                visit(child, prefix)  # defs under if / try / with keep their prefix

    visit(tree, "")
    return found


def check(
    root: Path,
    allowed: dict[str, tuple[int, str]] | None = None,
    orchestrators: dict[str, int] | None = None,
    limit: int = LIMIT,
    package: str = PACKAGE,
) -> Report:
    """Measure every function under ``root/package`` against the budgets."""
    root = Path(root)
    allowed = ALLOWED if allowed is None else allowed
    orchestrators = ORCHESTRATORS if orchestrators is None else orchestrators
    functions: list[Function] = []
    for path in sorted((root / package).rglob("*.py")):
        functions += functions_of(path, path.relative_to(root).as_posix())
    report = Report(functions)
    by_key: dict[str, list[Function]] = {}
    for fn in functions:
        by_key.setdefault(fn.key, []).append(fn)
    for fn in functions:
        if fn.key in orchestrators:
            budget, why = orchestrators[fn.key], "orchestrator"
        elif fn.key in allowed:
            budget, why = allowed[fn.key][0], "allow-listed"
        else:
            budget, why = limit, "default"
        if fn.lines > budget:
            report.over.append((fn, budget, why))
    for key in sorted(orchestrators):
        if key not in by_key:
            report.stale.append(
                f"{key}: orchestrator budget names no function (renamed or moved? "
                f"update ORCHESTRATORS in tools/check_sizes.py)"
            )
    for key, (max_lines, reason) in sorted(allowed.items()):
        if key not in by_key:
            report.stale.append(f"{key}: allow-list entry names no function (remove it)")
        elif all(fn.lines <= limit for fn in by_key[key]):
            size = max(fn.lines for fn in by_key[key])
            report.stale.append(
                f"{key}: allow-list entry is stale, the function is {size} lines, within "
                f"the default {limit} (remove it)"
            )
        elif not str(reason).strip():
            report.stale.append(f"{key}: allow-list entry gives no reason")
        elif max_lines <= limit:
            report.stale.append(
                f"{key}: allow-list entry's budget {max_lines} is not above {limit}"
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    args = parser.parse_args(argv)
    report = check(args.root)
    if args.json:
        print(json.dumps(report.summary()))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
