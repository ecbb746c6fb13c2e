#!/usr/bin/env python
"""Write docs/configuration.md, the configuration reference, from the config dataclasses.

    python tools/gen_config_reference.py            # (re)write docs/configuration.md
    python tools/gen_config_reference.py --check    # exit 1 when the file is out of date

The reference is generated so that it cannot drift from the code: it walks ``RunConfig`` (from
``megatron_sat.config``) and its nested dataclass sections with ``dataclasses.fields``, in the
order the YAML nests them, and writes one section per config section with a table of field,
type, default and description.

Where the descriptions come from, first match wins, per field:

1. the ``Attributes:`` section of the class docstring (Google style, as every config class
   writes it; ``a, b, c: text`` documents several fields at once);
2. a string literal right after the field (an attribute docstring);
3. ``#`` comment lines directly above the field, or a comment at the end of its line.

The text of the docstring before its sections becomes the section's introduction, and its
``Raises:`` section a note on what the section refuses. Fields found nowhere get "-" and are
listed on stderr (and by ``--missing``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"

# Google-style section headers that end the free text of a docstring.
_SECTION = re.compile(
    r"^(Attributes|Args|Arguments|Raises|Returns|Yields|Note|Notes|Example|Examples|See Also):\s*$"
)
_ENTRY = re.compile(
    r"^(?P<names>[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:\s*(?P<text>.*)$"
)


@dataclasses.dataclass
class Section:
    """One config section: its dotted path, class, intro, refusals and field rows."""

    path: str
    cls: type
    intro: str
    raises: str
    rows: list[tuple[str, str, str, str]]  # (dotted field, type, default, description)


def _docstring(cls: type) -> str:
    doc = cls.__doc__ or ""
    # a dataclass without a docstring gets its signature as __doc__: "Name(a: int = 1, ...)"
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return inspect.cleandoc(doc)


def _split_sections(doc: str) -> tuple[str, dict[str, list[str]]]:
    """The free text before the first section, and each section's indented body lines."""
    free: list[str] = []
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        header = _SECTION.match(line)
        if header:
            current = sections.setdefault(header.group(1), [])
        elif current is None:
            free.append(line)
        elif line.strip() and not line.startswith(" "):
            current = None  # text back at the left margin ends the section
            free.append(line)
        else:
            current.append(line)
    return "\n".join(free).strip(), sections


def _entries(body: list[str]) -> list[tuple[list[str], str]]:
    """``name: text`` entries of a section body (continuation lines indented further)."""
    body = textwrap.dedent("\n".join(body)).splitlines()
    entries: list[tuple[list[str], list[str]]] = []
    for line in body:
        if not line.strip():
            continue
        match = None if line.startswith(" ") else _ENTRY.match(line)
        if match:
            names = [n.strip() for n in match.group("names").split(",")]
            entries.append((names, [match.group("text")]))
        elif entries:
            entries[-1][1].append(line.strip())
    return [(names, " ".join(t for t in text if t)) for names, text in entries]


def _source_descriptions(cls: type) -> dict[str, str]:
    """Attribute docstrings and ``#`` comments of the class body, by field name."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # 1-based line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#:").strip()
    out: dict[str, str] = {}
    body = ast.parse(source).body[0].body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        after = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            out[name] = " ".join(inspect.cleandoc(after.value.value).split())
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        text = " ".join(t for t in above if t) or comments.get(node.end_lineno, "")
        if text:
            out[name] = text
    return out


def _md(text: str) -> str:
    """Docstring text as one table-safe Markdown line (RST ``literal`` -> `literal`)."""
    text = " ".join(text.split())
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r":(?:class|func|meth|mod|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("|", "\\|")


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value if not isinstance(value, tuple) else list(value))
    return repr(value)


def _section_class(f: dataclasses.Field) -> type | None:
    """The dataclass a field nests (a config section), or None for a plain field."""
    for candidate in (f.default_factory, f.default):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
        if dataclasses.is_dataclass(candidate) and not isinstance(candidate, type):
            return type(candidate)
    return None


def collect(root: type, path: str = "") -> tuple[list[Section], list[str]]:
    """Sections of ``root`` (its plain fields first, then each nested section, depth first)
    and the dotted names of the fields that have no description."""
    doc = _docstring(root)
    intro, parts = _split_sections(doc)
    described: dict[str, str] = {}
    for names, text in _entries(parts.get("Attributes", [])):
        shared = f" (one entry for {', '.join(f'`{n}`' for n in names)})" if len(names) > 1 else ""
        for name in names:
            described[name] = text + shared
    from_source = _source_descriptions(root)
    raises = " ".join(
        f"`{names[0]}`: {text}" if text else f"`{names[0]}`"
        for names, text in _entries(parts.get("Raises", []))
    )
    rows: list[tuple[str, str, str, str]] = []
    nested: list[tuple[str, type]] = []
    missing: list[str] = []
    for f in dataclasses.fields(root):
        dotted = f"{path}.{f.name}" if path else f.name
        sub = _section_class(f)
        if sub is not None:
            nested.append((dotted, sub))
            continue
        text = described.get(f.name) or from_source.get(f.name, "")
        if not text:
            missing.append(dotted)
        rows.append((dotted, _type_name(f.type), _default(f), text))
    sections = [Section(path, root, intro, raises, rows)] if rows or not path else []
    for dotted, sub in nested:
        more, more_missing = collect(sub, dotted)
        sections += more
        missing += more_missing
    return sections, missing


HEADER = """\
# Configuration reference

<!-- Generated by `python tools/gen_config_reference.py` from the config dataclasses: do not
edit by hand. `python tools/gen_config_reference.py --check` (run by tests/test_docs.py) fails
when this file is out of date. -->

Every run is one `RunConfig` (`megatron_sat.config`). A YAML file nests the sections below
(`rollout: {group_size: 8}`), and command-line overrides use their dotted paths
(`rollout.group_size=8`, appended to `megatron-sat train` or `examples/run_cpu.sh`); override
values are parsed as YAML scalars (`8`, `0.2`, `true`, `[a, b]`, `null`). An unknown field is
refused, and each field is validated where its class defines it (`ValueError` naming
`section.field`). `megatron-sat train --config FILE --dry-run` prints the resolved
configuration; a run writes it to `<run_dir>/config.yaml`. How to use these settings:
[usage.md](usage.md) and [launch.md](launch.md).
"""


def render(sections: list[Section]) -> str:
    out = [HEADER]
    names = ["top level" if not s.path else f"`{s.path}`" for s in sections]
    out.append("Sections: " + ", ".join(f"[{n}](#{_anchor(s)})" for n, s in zip(names, sections)))
    out.append("")
    for section in sections:
        title = f"`{section.path}`" if section.path else "Top level"
        out.append(f"## {title} ({section.cls.__name__})")
        out.append("")
        if section.intro:
            out.append(_md(section.intro).replace("\\|", "|"))
            out.append("")
        if section.raises:
            out.append(f"Raises {_md(section.raises).replace(chr(92) + '|', '|')}")
            out.append("")
        out.append("| field | type | default | description |")
        out.append("| --- | --- | --- | --- |")
        for dotted, type_name, default, text in section.rows:
            cells = [f"`{dotted}`", f"`{_md(type_name)}`", f"`{_md(default)}`", _md(text) or "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _anchor(section: Section) -> str:
    """GitHub's heading anchor of a section's title."""
    title = (
        f"{section.path} ({section.cls.__name__})"
        if section.path
        else (f"Top level ({section.cls.__name__})")
    )
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def generate() -> tuple[str, list[str]]:
    """The reference's text and the fields without a description."""
    sys.path.insert(0, str(ROOT))
    from megatron_sat.config import RunConfig

    sections, missing = collect(RunConfig)
    return render(sections), missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    parser.add_argument(
        "--missing", action="store_true", help="list the fields without a description"
    )
    args = parser.parse_args(argv)
    text, missing = generate()
    if args.missing:
        print("\n".join(missing) if missing else "every field has a description")
        return 0
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            print(
                f"{args.out} is out of date with the config dataclasses: run "
                "python tools/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if missing:
        print(f"fields without a description: {', '.join(missing)}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
