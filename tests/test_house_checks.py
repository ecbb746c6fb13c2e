"""tools/check_layers.py and tools/check_sizes.py on small synthetic packages."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_layers = _load("check_layers")
check_sizes = _load("check_sizes")

LAYERS = ["cli.py", "training/", "config/", "platform/"]


def make_package(root: Path, files: dict[str, str], layers: list[str] = LAYERS) -> Path:
    """``root/megatron_sat`` with ``files`` (path -> source) and a README whose layers block
    lists ``layers`` top to bottom."""
    block = "\n".join(f"  {layer:<14} some words" for layer in layers)
    (root / "README.md").write_text(
        "# pkg\n\n## Layout\n\n<!-- layers -->\n```\nmegatron_sat/\n"
        f"{block}\n```\n<!-- /layers -->\n\n## Next\n"
    )
    files = {"megatron_sat/__init__.py": "", **files}
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def upward(report) -> list[tuple[str, int, str, str, str]]:
    return [
        (report.modules[imp.source].as_posix(), imp.line, imp.target, src.label, tgt.label)
        for imp, src, tgt in report.upward
    ]


def cycles(report) -> list[list[tuple[str, int, str, tuple[str, ...]]]]:
    return [
        [(imp.source, imp.line, imp.target, imp.names) for imp in cycle] for cycle in report.cycles
    ]


# --- check_layers -------------------------------------------------------------------------


def test_layers_parsed_top_to_bottom_and_continuations_skipped():
    readme = textwrap.dedent(
        """\
        ## Layout
        ```
        megatron_sat/
          other/  not the layers block
        ```
        <!-- layers -->
        ```
        megatron_sat/
          cli.py       top
          training/    the loop,
                       (continued) more words
          config/      bottom
        ```
        <!-- /layers -->
        ## Next
        """
    )
    layers = check_layers.parse_layers(readme)
    assert [(layer.label, layer.rank) for layer in layers] == [
        ("cli.py", 0),
        ("training/", 1),
        ("config/", 2),
    ]


def test_missing_layers_block_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("## Layout\n\nno block\n\n## Next\n<!-- layers -->\n")
    (tmp_path / "megatron_sat").mkdir()
    with pytest.raises(check_layers.LayersError, match="no <!-- layers -->"):
        check_layers.check(tmp_path)


def test_upward_import_detected_with_its_line(tmp_path):
    make_package(
        tmp_path,
        {
            # config/ covers the single module config.py
            "megatron_sat/config.py": """\
                import os

                from megatron_sat.training.loop import run
            """,
            "megatron_sat/training/__init__.py": "",
            "megatron_sat/training/loop.py": """\
                import megatron_sat.platform.device
                from megatron_sat import platform

                def run():
                    pass
            """,
            "megatron_sat/platform/__init__.py": "",
            "megatron_sat/platform/device.py": "",
            # downward, and from a layer's own __init__: fine
            "megatron_sat/cli.py": "from megatron_sat.training import loop\n",
        },
    )
    report = check_layers.check(tmp_path)
    assert upward(report) == [
        ("megatron_sat/config.py", 3, "megatron_sat.training.loop", "config/", "training/")
    ]
    assert report.cycles == [] and report.undeclared == [] and not report.ok
    assert report.lines()[0] == (
        "megatron_sat/config.py:3 imports megatron_sat.training.loop "
        "(layer training/ is above config/)"
    )
    assert report.summary()["upward_imports"] == 1


def test_lazy_and_type_checking_imports_detected(tmp_path):
    make_package(
        tmp_path,
        {
            "megatron_sat/cli.py": "",
            "megatron_sat/platform/__init__.py": "",
            "megatron_sat/platform/device.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from megatron_sat.training import loop


                def pick():
                    try:
                        import megatron_sat.cli as cli
                    except ImportError:
                        return None
                    return cli
            """,
            "megatron_sat/training/__init__.py": "",
            "megatron_sat/training/loop.py": "",
        },
    )
    report = check_layers.check(tmp_path)
    assert upward(report) == [
        (
            "megatron_sat/platform/device.py",
            4,
            "megatron_sat.training.loop",
            "platform/",
            "training/",
        ),
        ("megatron_sat/platform/device.py", 9, "megatron_sat.cli", "platform/", "cli.py"),
    ]


def test_relative_imports_resolved(tmp_path):
    make_package(
        tmp_path,
        {
            "megatron_sat/platform/__init__.py": "",
            "megatron_sat/platform/device.py": "",
            "megatron_sat/training/__init__.py": "from .loop import run\n",
            "megatron_sat/training/sub/__init__.py": "",
            "megatron_sat/training/sub/step.py": """\
                from . import helper
                from .. import loop
                from ...platform import device
                from ...config import Config
            """,
            "megatron_sat/training/sub/helper.py": "",
            "megatron_sat/training/loop.py": "def run():\n    from ..cli import main\n",
            "megatron_sat/config.py": "class Config:\n    pass\n",
            "megatron_sat/cli.py": "",
        },
    )
    modules = check_layers.find_modules(tmp_path)
    step = "megatron_sat.training.sub.step"
    assert [
        (imp.line, imp.target, imp.names)
        for imp in check_layers.imports_of(step, tmp_path / modules[step], modules)
    ] == [
        (1, "megatron_sat.training.sub.helper", ("helper",)),
        (2, "megatron_sat.training.loop", ("loop",)),
        (3, "megatron_sat.platform.device", ("device",)),
        (4, "megatron_sat.config", ("Config",)),
    ]
    init = "megatron_sat.training"
    assert [
        imp.target for imp in check_layers.imports_of(init, tmp_path / modules[init], modules)
    ] == ["megatron_sat.training.loop"]
    report = check_layers.check(tmp_path)
    assert upward(report) == [
        ("megatron_sat/training/loop.py", 2, "megatron_sat.cli", "training/", "cli.py")
    ]
    assert report.cycles == []


def test_cycle_detected_with_the_names_it_imports(tmp_path):
    make_package(
        tmp_path,
        {
            "megatron_sat/training/__init__.py": "",
            "megatron_sat/training/a.py": "from megatron_sat.training.b import B, helper\n",
            "megatron_sat/training/b.py": """\
                class B:
                    pass


                def helper():
                    from megatron_sat.training import c
            """,
            "megatron_sat/training/c.py": "from . import a\n",
            "megatron_sat/training/d.py": "from megatron_sat.training import a\n",  # no cycle
        },
    )
    report = check_layers.check(tmp_path)
    assert cycles(report) == [
        [
            ("megatron_sat.training.a", 1, "megatron_sat.training.b", ("B", "helper")),
            ("megatron_sat.training.b", 6, "megatron_sat.training.c", ("c",)),
            ("megatron_sat.training.c", 1, "megatron_sat.training.a", ("a",)),
        ]
    ]
    assert report.upward == [] and not report.ok
    assert report.lines()[0] == (
        "import cycle: megatron_sat/training/a.py:1 imports megatron_sat.training.b (B, helper)"
        " -> megatron_sat/training/b.py:6 imports megatron_sat.training.c (c)"
        " -> megatron_sat/training/c.py:1 imports megatron_sat.training.a (a)"
    )
    assert report.summary() == {"upward_imports": 0, "cycles": 1, "undeclared": 0, "modules": 6}


def test_undeclared_folder_and_module_refused(tmp_path):
    make_package(
        tmp_path,
        {
            "megatron_sat/training/__init__.py": "",
            "megatron_sat/experiments/__init__.py": "",
            "megatron_sat/experiments/sweep.py": "from megatron_sat.training import x\n",
            "megatron_sat/loose.py": "",
            # cli.py is a module line: it does not cover a folder cli/
            "megatron_sat/cli/__init__.py": "",
        },
    )
    report = check_layers.check(tmp_path)
    assert report.undeclared == ["cli/", "experiments/", "loose.py"]
    assert report.upward == [] and not report.ok
    assert "megatron_sat/experiments/: in no layer" in "\n".join(report.lines())


def test_clean_package_passes_and_cli(tmp_path, capsys):
    make_package(
        tmp_path,
        {
            "megatron_sat/cli.py": "from megatron_sat.config import C\n",
            "megatron_sat/config.py": "import json\nC = 1\n",
        },
    )
    assert check_layers.check(tmp_path).ok
    assert check_layers.main(["--root", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "upward_imports": 0,
        "cycles": 0,
        "undeclared": 0,
        "modules": 3,
    }


# --- check_sizes --------------------------------------------------------------------------


def function(name: str, lines: int, indent: str = "", decorators: int = 0) -> str:
    """A def spanning exactly ``lines`` lines (docstring included), after ``decorators``."""
    body = [f'{indent}    """Doc."""'] + [f"{indent}    x = {i}" for i in range(lines - 2)]
    deco = [f"{indent}@staticmethod"] * decorators
    return "\n".join([*deco, f"{indent}def {name}():", *body]) + "\n"


def test_function_over_101_lines_detected(tmp_path):
    make_package(
        tmp_path,
        {
            "megatron_sat/a.py": function("fits", 100) + function("long", 101),
            "megatron_sat/b/c.py": "class K:\n" + function("method", 102, "    ", decorators=3),
        },
    )
    report = check_sizes.check(tmp_path, allowed={}, orchestrators={})
    assert [(fn.key, fn.line, fn.lines, budget) for fn, budget, _ in report.over] == [
        ("megatron_sat/a.py::long", 101, 101, 100),
        ("megatron_sat/b/c.py::K.method", 5, 102, 100),
    ]
    assert report.stale == [] and not report.ok
    assert report.lines()[0] == "megatron_sat/a.py:101 long is 101 lines (budget 100: default)"
    assert report.summary()["largest"] == {"name": "megatron_sat/b/c.py::K.method", "lines": 102}


def test_nested_functions_measured_on_their_own(tmp_path):
    source = "def outer():\n" + function("inner", 101, "    ")
    make_package(tmp_path, {"megatron_sat/a.py": source})
    report = check_sizes.check(tmp_path, allowed={}, orchestrators={})
    assert [(fn.key, fn.lines) for fn, _, _ in report.over] == [
        ("megatron_sat/a.py::outer", 102),
        ("megatron_sat/a.py::outer.inner", 101),
    ]


def test_allow_list_and_its_stale_entries(tmp_path):
    make_package(
        tmp_path,
        {
            "megatron_sat/a.py": function("kept", 150)
            + function("over", 130)
            + function("shrunk", 40),
        },
    )
    allowed = {
        "megatron_sat/a.py::kept": (150, "one state machine"),
        "megatron_sat/a.py::over": (120, "one state machine"),
        "megatron_sat/a.py::shrunk": (140, "was long"),
        "megatron_sat/a.py::gone": (140, "was long"),
    }
    report = check_sizes.check(tmp_path, allowed=allowed, orchestrators={})
    assert [(fn.key, fn.lines, budget, why) for fn, budget, why in report.over] == [
        ("megatron_sat/a.py::over", 130, 120, "allow-listed")
    ]
    assert report.stale == [
        "megatron_sat/a.py::gone: allow-list entry names no function (remove it)",
        "megatron_sat/a.py::shrunk: allow-list entry is stale, the function is 40 lines, "
        "within the default 100 (remove it)",
    ]


def test_orchestrator_budget_and_missing_key_refused(tmp_path):
    make_package(
        tmp_path,
        {"megatron_sat/training/rl.py": "class T:\n" + function("rl_step", 61, "    ")},
    )
    orchestrators = {
        "megatron_sat/training/rl.py::T.rl_step": 60,
        "megatron_sat/training/rl.py::_lead": 60,
    }
    report = check_sizes.check(tmp_path, allowed={}, orchestrators=orchestrators)
    assert [(fn.key, fn.lines, budget, why) for fn, budget, why in report.over] == [
        ("megatron_sat/training/rl.py::T.rl_step", 61, 60, "orchestrator")
    ]
    assert report.stale == [
        "megatron_sat/training/rl.py::_lead: orchestrator budget names no function "
        "(renamed or moved? update ORCHESTRATORS in tools/check_sizes.py)"
    ]
    assert report.summary()["stale"] == 1 and not report.ok


def test_the_tools_run_on_this_repository():
    """The command-line wrappers on the real package (their verdict is not gating yet)."""
    for tool, keys in [
        ("check_layers", {"upward_imports", "cycles"}),
        ("check_sizes", {"over_budget", "largest"}),
    ]:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tools" / f"{tool}.py"), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode in (0, 1), proc.stderr
        assert keys <= json.loads(proc.stdout).keys()


def test_type_checking_import_is_no_cycle_but_still_must_point_down(tmp_path):
    """An import under ``if TYPE_CHECKING:`` never runs: a module naming the type of its
    caller makes no cycle, but the import is still checked against the layers."""
    make_package(
        tmp_path,
        {
            "megatron_sat/cli.py": "main = None\n",
            "megatron_sat/training/__init__.py": "",
            "megatron_sat/training/a.py": "from megatron_sat.training.b import helper\n",
            "megatron_sat/training/b.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from megatron_sat.training.a import A
                    from megatron_sat.cli import main


                def helper(a: "A") -> None:
                    pass
            """,
        },
    )
    report = check_layers.check(tmp_path)
    assert cycles(report) == []
    assert upward(report) == [
        ("megatron_sat/training/b.py", 5, "megatron_sat.cli", "training/", "cli.py"),
    ]
