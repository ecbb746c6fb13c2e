"""SGLang 0.5.23's own code as the reference of the conformance tests, on a CPU.

``ensure_sglang()`` installs ``sglang==0.5.23`` and ``msgspec`` (which its structs are made of;
not a dependency of this project) with ``pip install --no-deps --target`` into
``.cache/sglang-0.5.23`` (ignored by git; once, then reused; needs PyPI the first time). Only
``msgspec`` is imported from there (the folder goes at the end of ``sys.path``).

What can and cannot be imported here: the ``sglang`` package's ``__init__`` and
``srt/managers/io_struct.py`` pull in GPU-era dependencies (``srt/configs`` imports
``torchvision`` through the multimodal configs; ``http_server.py`` needs uvloop, zmq, orjson,
sgl-kernel, ...), which this environment does not have and must not get. So nothing goes
through ``import sglang``. Instead:

- the light modules are loaded from their files unchanged: ``srt/utils/auth.py``
  (``decide_request_auth``), ``srt/utils/msgspec_utils.py`` (the pydantic schema SGLang's
  FastAPI app validates request structs with), ``srt/utils/field_validators.py``;
- the request structs are SGLang's class definitions from ``io_struct.py``, executed verbatim
  (their source text, compiled here) with those helpers; no stub replaces any of them;
- ``GenerateReqInput`` (a dataclass whose methods need the whole runtime) is checked field by
  field: its field names and annotations come from its source, each annotation evaluated with
  unknown names (multimodal input types) read as ``Any``;
- the HTTP routes (path, methods, ``@auth_level``, body type) are read from
  ``srt/entrypoints/http_server.py``'s syntax tree: the decorators that register them.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import shutil
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
MSGSPEC_VERSION = "0.23.0"
ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / ".cache" / f"sglang-{SGLANG_VERSION}"
_MARKER = Path("sglang", "srt", "entrypoints", "http_server.py")

# The io_struct request/response structs the tests use (plus BaseReq, their base).
STRUCTS = (
    "BaseReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "InitWeightsUpdateGroupReqInput",
    "InitWeightsUpdateGroupReqOutput",
    "DestroyWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqOutput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromDistributedReqOutput",
    "BeginWeightUpdateReqInput",
    "BeginWeightUpdateReqOutput",
    "EndWeightUpdateReqInput",
    "EndWeightUpdateReqOutput",
)


def ensure_sglang() -> Path:
    """The ``sglang`` package directory of the side install (installing it if absent).

    Raises:
        subprocess.CalledProcessError: when pip fails (e.g. PyPI unreachable).
    """
    if str(SIDE) not in sys.path:
        sys.path.append(str(SIDE))
    if (SIDE / _MARKER).exists():
        return SIDE / "sglang"
    tmp = SIDE.with_name(f"{SIDE.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
        + ["--target", str(tmp), f"sglang=={SGLANG_VERSION}", f"msgspec=={MSGSPEC_VERSION}"],
        check=True,
    )
    try:
        os.replace(tmp, SIDE)
    except OSError:  # another process installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    if not (SIDE / _MARKER).exists():
        raise RuntimeError(f"sglang=={SGLANG_VERSION} installed without {_MARKER} in {SIDE}")
    return SIDE / "sglang"


def source(relative: str) -> str:
    """Text of a file of the sglang package, e.g. ``srt/utils/auth.py``."""
    return (ensure_sglang() / relative).read_text()


def load_module(relative: str, name: str):
    """Load one sglang file as a module of its own (no ``sglang`` package import)."""
    path = ensure_sglang() / relative
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@cache
def auth_module():
    """SGLang's ``srt/utils/auth.py`` (``decide_request_auth``, ``AuthLevel``)."""
    return load_module("srt/utils/auth.py", "_sglang_ref_auth")


def _class_sources(relative: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse(source(relative))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@cache
def structs() -> dict[str, type]:
    """SGLang's request/response structs of ``STRUCTS``, from their verbatim source."""
    ensure_sglang()
    import msgspec
    from pydantic import PlainValidator

    msgspec_utils = load_module("srt/utils/msgspec_utils.py", "_sglang_ref_msgspec_utils")
    validators = load_module("srt/utils/field_validators.py", "_sglang_ref_field_validators")
    text = source("srt/managers/io_struct.py")
    classes = _class_sources("srt/managers/io_struct.py")
    # A module of its own, so that msgspec and pydantic resolve the (postponed, as in
    # io_struct.py) annotations in its globals.
    module = types.ModuleType("_sglang_ref_io_struct")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace.update({name: getattr(typing, name) for name in typing.__all__})
    namespace.update(
        msgspec=msgspec,
        PlainValidator=PlainValidator,
        Base64Bytes=msgspec_utils.Base64Bytes,
        msgspec_struct_pydantic_core_schema=msgspec_utils.msgspec_struct_pydantic_core_schema,
        validate_optional_list_i64_1d_2d=validators.validate_optional_list_i64_1d_2d,
    )
    for name in STRUCTS:
        code = ast.get_source_segment(text, classes[name])
        exec(compile(code, f"sglang/srt/managers/io_struct.py:{name}", "exec"), namespace)
    return {name: namespace[name] for name in STRUCTS}


class _AnyForUnknown(dict):
    """Names for ``eval``: its own entries, then builtins, else ``Any``."""

    def __missing__(self, key: str) -> Any:
        return getattr(builtins, key, Any)


@dataclass(frozen=True)
class FieldSpec:
    """One field of a class read from source: its name, annotation (evaluated) and default."""

    name: str
    annotation: Any
    has_default: bool


def class_fields(relative: str, class_name: str) -> dict[str, FieldSpec]:
    """The annotated fields of a class in an sglang file, from its syntax tree (annotations
    evaluated with typing's names and SGLang's field validator; other names are ``Any``, and
    so is an annotation subscripting one)."""
    from pydantic import PlainValidator

    validators = load_module("srt/utils/field_validators.py", "_sglang_ref_field_validators")
    text = source(relative)
    node = _class_sources(relative)[class_name]
    env = {name: getattr(typing, name) for name in typing.__all__}
    env.update(
        PlainValidator=PlainValidator,
        validate_optional_list_i64_1d_2d=validators.validate_optional_list_i64_1d_2d,
    )
    out = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            expr = ast.get_source_segment(text, item.annotation)
            try:
                annotation = eval(expr, {}, _AnyForUnknown(env))
            except TypeError:  # a generic of an unknown (runtime-only) type: Any
                annotation = Any
            out[item.target.id] = FieldSpec(item.target.id, annotation, item.value is not None)
    return out


@dataclass(frozen=True)
class Route:
    """One route SGLang's HTTP server registers."""

    path: str
    methods: frozenset[str]
    auth_level: str  # "normal", "admin_optional" or "admin_force"
    function: str
    body_type: str | None = None
    node: ast.AST | None = field(default=None, compare=False, repr=False)


def _route_path(arg: ast.expr) -> str | None:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    # os.environ.get("NAME", "/default"): the default path
    if isinstance(arg, ast.Call) and len(arg.args) == 2 and isinstance(arg.args[1], ast.Constant):
        return arg.args[1].value
    return None


def _body_type(function: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """Name of the struct/dataclass FastAPI validates the JSON body against."""
    args = function.args.args
    if not args or args[0].annotation is None:
        return None
    annotation = args[0].annotation
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Annotated":
        annotation = annotation.slice.elts[0]
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Optional":
        annotation = annotation.slice
    return annotation.id if isinstance(annotation, ast.Name) else None


@cache
def routes() -> tuple[Route, ...]:
    """Every route of ``srt/entrypoints/http_server.py`` registered with ``@app.<method>`` or
    ``@app.api_route``, with its ``@auth_level`` (NORMAL when undecorated, as SGLang's
    middleware resolves it) and body type."""
    tree = ast.parse(source("srt/entrypoints/http_server.py"))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        level = "normal"
        registered = []
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            func = deco.func
            if isinstance(func, ast.Name) and func.id == "auth_level":
                level = deco.args[0].attr.lower()
            if not (isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "app"):
                continue
            path = _route_path(deco.args[0]) if deco.args else None
            if path is None:
                continue
            if func.attr == "api_route":
                methods = next(
                    (k.value for k in deco.keywords if k.arg == "methods"),
                    ast.List([ast.Constant("GET")]),
                )
                names = frozenset(e.value for e in methods.elts)
            elif func.attr in ("get", "post", "put", "delete", "patch"):
                names = frozenset({func.attr.upper()})
            else:
                continue
            registered.append((path, names))
        for path, names in registered:
            out.append(Route(path, names, level, node.name, _body_type(node), node))
    return tuple(out)


def route(path: str, method: str) -> Route | None:
    """The SGLang route serving ``method path``, or None."""
    for r in routes():
        if r.path == path and method in r.methods:
            return r
    return None


def string_constants(relative: str) -> set[str]:
    """Every string literal of an sglang file (implicit concatenations joined, as parsed)."""
    return {
        node.value
        for node in ast.walk(ast.parse(source(relative)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def dict_key_sets(node: ast.AST) -> list[frozenset[str]]:
    """The key sets of every dict literal with constant string keys under ``node``."""
    out = []
    for item in ast.walk(node):
        if (
            isinstance(item, ast.Dict)
            and item.keys
            and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in item.keys)
        ):
            out.append(frozenset(k.value for k in item.keys))
    return out


def finish_reason_key_sets() -> list[frozenset[str]]:
    """Key sets of the ``finish_reason`` objects (``BaseFinishReason.to_json`` of
    ``srt/managers/schedule_batch.py``)."""
    tree = ast.parse(source("srt/managers/schedule_batch.py"))
    out = []
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name.startswith("FINISH"):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef) and item.name == "to_json":
                    out += dict_key_sets(item)
    return out


@cache
def weight_versions_module() -> types.ModuleType:
    """SGLang's ``srt/utils/weight_versions.py`` (``WeightVersionEvent``,
    ``compute_weight_version_spans``, ``add_weight_versions_to_meta_info``, ...): its source
    executed verbatim but for its one ``sglang`` import, whose name
    (``msgspec_struct_pydantic_core_schema``) comes from ``msgspec_utils.py`` loaded from its
    file."""
    msgspec_utils = load_module("srt/utils/msgspec_utils.py", "_sglang_ref_msgspec_utils")
    tree = ast.parse(source("srt/utils/weight_versions.py"))
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"))
    ]
    module = types.ModuleType("_sglang_ref_weight_versions")
    module.msgspec_struct_pydantic_core_schema = msgspec_utils.msgspec_struct_pydantic_core_schema
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(tree, "srt/utils/weight_versions.py", "exec"), module.__dict__)
    return module


@cache
def cli_flags() -> dict[str, tuple[str, ...]]:
    """Every ``ServerArgs`` field's command-line spellings in SGLang 0.5.23, read from the field
    declarations (``srt/arg_groups/fields/*.py``) as ``arg_groups/arg_utils.py``
    ``add_cli_args_from_dataclass`` registers them: ``cli_name`` or ``--`` + the field name with
    ``-`` for ``_``, then the ``aliases``; fields with ``no_cli=True`` or without an ``Arg`` /
    help string have none. ``--config`` is added by ``server_args.py`` itself."""
    flags: dict[str, tuple[str, ...]] = {}
    for path in sorted((ensure_sglang() / "srt/arg_groups/fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            if not (isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple)):
                continue
            meta = ann.slice.elts[1] if len(ann.slice.elts) > 1 else None
            name, aliases = "--" + node.target.id.replace("_", "-"), []
            if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
                options = {k.arg: k.value for k in meta.keywords}
                if "no_cli" in options and ast.literal_eval(options["no_cli"]):
                    continue
                if "cli_name" in options:
                    name = ast.literal_eval(options["cli_name"])
                if "aliases" in options:
                    aliases = list(ast.literal_eval(options["aliases"]))
            elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                continue
            flags[node.target.id] = (name, *aliases)
    if 'add_argument(\n            "--config"' not in source("srt/server_args.py"):
        raise AssertionError("srt/server_args.py no longer adds --config as it did")
    flags["config"] = ("--config",)
    return flags


def function(relative: str, name: str, namespace: dict[str, Any]):
    """One top-level function of an sglang file, its source executed verbatim in
    ``namespace`` (which must supply the names it uses: nothing of sglang is imported)."""
    tree = ast.parse(source(relative))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    code = compile(ast.Module(body=[node], type_ignores=[]), relative, "exec")
    scope = dict(namespace)
    exec(code, scope)
    return scope[name]
