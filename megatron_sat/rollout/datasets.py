"""Prompt datasets (jsonl or parquet) read into `PromptRecord`s for the rollout pool.

Without explicit keys, three row schemas are recognised from the first row of a file, and every
later row must follow the same one:

- verl (DAPO-Math-17k is shared this way): a parquet (or jsonl) row as verl's
  ``examples/data_preprocess`` scripts write it: ``data_source``, ``prompt`` (chat messages),
  ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info: {...}``. The label is
  ``reward_model.ground_truth``; the metadata is every column but ``prompt``, as verl hands
  ``data_source``, ``reward_model`` and ``extra_info`` to its reward function;
- prompt/label: ``{"prompt": str | chat messages, "label": str, "metadata"?: {...}}`` (slime's
  prompt/label row, its ``metadata`` object being the metadata);
- GSM8K: ``{"question": str, "answer": str}``, the label being the number after the final
  "####" with thousands separators removed ("#### 1,234" -> "1234").

With explicit keys (slime's ``--input-key``, ``--label-key``, ``--metadata-key``, ``--tool-key``;
``data.input_key`` and so on in the run config) detection is off and the keys say where each
part is. Chat-format prompts (lists of messages) become text through the tokenizer's chat
template with ``add_generation_prompt=True`` (plus any ``apply_chat_template_kwargs``, e.g.
Qwen3's ``enable_thinking``). Metadata must be JSON (it travels with the sample to the trainer
ranks and into the rollout pool's checkpoint): parquet's numpy arrays and scalars become lists
and numbers, a parquet map column becomes an object (its keys must be strings, no key twice);
bytes, dates, non-string keys and non-finite floats are refused. Nothing is dropped
or coerced silently: a bad row raises `DatasetFormatError` (a `ValueError`) naming the file, the
row (1-based line for jsonl, 1-based row for parquet) and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GSM8K's final answers are integers; a decimal part is accepted so that variants still load.
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


class DatasetFormatError(ValueError):
    """A dataset file or one of its rows is malformed; the message names file, row and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset.

    Attributes:
        prompt: Text fed to the tokenizer (chat template already applied where one was).
        label: Ground-truth answer for the reward function, non-empty.
        source_index: 0-based position of the row in its file (line index for jsonl).
        metadata: JSON object handed to the reward function with every sample of this prompt
            (``Sample.metadata``): verl's columns but the prompt, slime's metadata key (plus
            ``tools`` when a tool key is set), else empty.
    """

    prompt: str
    label: str
    source_index: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Schema:
    """Where a schema keeps its prompt, label and metadata.

    Attributes:
        name: Name used in error messages.
        prompt_path: Keys from the row to the prompt.
        label_path: Keys from the row to the label ("reward_model.ground_truth" -> two keys).
        gsm8k_answer: The label field is a GSM8K solution ending in "#### <number>".
        metadata_is_row: The metadata is the whole row but the prompt (verl); else it is the
            object under ``metadata_key``.
        metadata_key: Top-level key of the metadata object.
        metadata_required: A row without ``metadata_key`` is an error (an explicit key) rather
            than empty metadata.
    """

    name: str
    prompt_path: tuple[str, ...]
    label_path: tuple[str, ...]
    gsm8k_answer: bool = False
    metadata_is_row: bool = False
    metadata_key: str = "metadata"
    metadata_required: bool = False


_OURS = _Schema("prompt/label", ("prompt",), ("label",))
_GSM8K = _Schema("GSM8K", ("question",), ("answer",), gsm8k_answer=True)
_VERL = _Schema("verl", ("prompt",), ("reward_model", "ground_truth"), metadata_is_row=True)


def _detect_schema(first_row: dict[str, Any], where: str) -> _Schema:
    """Picks the schema from the keys of the first row."""
    if "question" in first_row and "answer" in first_row:
        return _GSM8K
    if "prompt" in first_row and "reward_model" in first_row:
        return _VERL
    if "prompt" in first_row and "label" in first_row:
        return _OURS
    raise DatasetFormatError(
        f"{where}: cannot tell the schema from the keys {sorted(first_row)}; expected "
        "prompt+label, question+answer (GSM8K) or prompt+reward_model (verl), or name the keys "
        "(data.input_key and data.label_key, slime's --input-key and --label-key)"
    )


def _explicit_schema(
    input_key: str | None, label_key: str | None, metadata_key: str | None
) -> _Schema | None:
    """The schema the explicit keys describe; None when detection decides.

    A metadata key alone keeps detection on and replaces the detected schema's metadata."""
    if input_key is None and label_key is None:
        return None
    return _Schema(
        "explicit keys",
        tuple((input_key or "prompt").split(".")),
        tuple((label_key or "label").split(".")),
        metadata_key=metadata_key or "metadata",
        metadata_required=metadata_key is not None,
    )


def _iter_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields (location, row) with location "<path>, line N" or "<path>, row N" (1-based)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as f:  # decoded per line, so an encoding error has its line
            for line_number, raw in enumerate(f, start=1):
                where = f"{path}, line {line_number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetFormatError(
                        f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}: "
                        f"{e.reason}); jsonl files are UTF-8"
                    ) from e
                if not line.strip():
                    # A blank line is either a truncated write or a hand edit; both deserve a look.
                    raise DatasetFormatError(
                        f"{where}: blank line (jsonl needs one JSON object per line)"
                    )
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetFormatError(
                        f"{where}: invalid JSON ({e.msg} at column {e.colno})"
                    ) from e
                except ValueError as e:  # e.g. an integer over Python's 4300-digit limit
                    raise DatasetFormatError(f"{where}: unreadable JSON ({e})") from e
                if not isinstance(row, dict):
                    raise DatasetFormatError(
                        f"{where}: expected a JSON object, got {type(row).__name__}"
                    )
                yield where, row
    elif suffix == ".parquet":
        # Imported here so that jsonl-only users never pay for pyarrow.
        import pyarrow.parquet as pq

        for row_index, row in enumerate(_parquet_rows(pq.read_table(path), path)):
            yield f"{path}, row {row_index + 1}", row
    else:
        raise DatasetFormatError(
            f"{path}: unsupported dataset format {suffix!r}; use .jsonl or .parquet"
        )


def _parquet_rows(table: Any, path: Path) -> list[dict[str, Any]]:
    """The rows of the pyarrow table ``table`` as dicts; a map column's value becomes a dict
    (pyarrow's default is a list of (key, value) pairs, which would reach the reward function
    as a list).

    Raises:
        DatasetFormatError: a map value holds one key twice (naming the row).
    """
    try:
        return table.to_pylist(maps_as_pydicts="strict")
    except KeyError:  # pyarrow's "strict": a duplicate key; find its row
        for row_index in range(table.num_rows):
            try:
                table.slice(row_index, 1).to_pylist(maps_as_pydicts="strict")
            except KeyError as e:
                raise DatasetFormatError(
                    f"{path}, row {row_index + 1}: a map column holds a key twice ({e})"
                ) from e
        raise


def _get_field(row: dict[str, Any], path: tuple[str, ...], where: str) -> Any:
    """Follows `path` through nested dicts; raises naming the dotted field when it is missing."""
    value: Any = row
    for depth, key in enumerate(path):
        if not isinstance(value, dict) or key not in value:
            hint = ""
            if len(path) > 1 and ".".join(path) in row:
                hint = " (the row has a key with the dots in its name; dots walk into objects)"
            raise DatasetFormatError(
                f"{where}: missing field {'.'.join(path[: depth + 1])!r}{hint}"
            )
        value = value[key]
    return value


def _gsm8k_label(answer: str, where: str) -> str:
    """Extracts the number after the final "####" of a GSM8K solution, without commas."""
    _, marker, tail = answer.rpartition("####")
    if not marker:
        raise DatasetFormatError(f"{where}: field 'answer' has no '#### <number>' final answer")
    number = tail.strip().replace(",", "")
    if not _NUMBER_RE.fullmatch(number):
        raise DatasetFormatError(
            f"{where}: field 'answer' ends in '#### {tail.strip()}', not a number"
        )
    return number


def json_value(value: Any, field_name: str, where: str) -> Any:
    """`value` as plain JSON (dict with str keys, list, str, int, float, bool, None).

    Parquet readers hand out numpy arrays and scalars where JSON has lists and numbers: those
    are converted (``tolist`` / ``item``), tuples become lists. Whatever JSON would change or
    cannot hold is refused rather than guessed at.

    Raises:
        DatasetFormatError: naming ``where`` and the dotted/indexed field, for bytes, dates,
            objects with non-string keys, non-finite floats (JSON has none) and any other type.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DatasetFormatError(f"{where}: field {field_name!r} is {value} (not JSON)")
        return value
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise DatasetFormatError(
                    f"{where}: field {field_name!r} has the key {key!r} "
                    f"({type(key).__name__}); JSON keys are strings"
                )
            out[key] = json_value(item, f"{field_name}.{key}", where)
        return out
    if isinstance(value, (list, tuple)):
        return [json_value(item, f"{field_name}[{i}]", where) for i, item in enumerate(value)]
    module = type(value).__module__
    if module == "numpy" and hasattr(value, "tolist"):  # ndarray and numpy scalars
        return json_value(value.tolist(), field_name, where)
    raise DatasetFormatError(
        f"{where}: field {field_name!r} is {type(value).__name__} ({value!r:.60}), which metadata "
        "cannot hold (it must be JSON: objects, lists, strings, numbers, booleans, null)"
    )


def _metadata(row: dict[str, Any], schema: _Schema, where: str) -> dict[str, Any]:
    """The row's metadata object (see `_Schema`), as JSON."""
    if schema.metadata_is_row:
        return {
            key: json_value(value, key, where)
            for key, value in row.items()
            if key != schema.prompt_path[0]
        }
    if schema.metadata_key not in row:
        if schema.metadata_required:
            raise DatasetFormatError(f"{where}: missing field {schema.metadata_key!r}")
        return {}
    value = row[schema.metadata_key]
    if value is None and not schema.metadata_required:
        return {}  # a parquet column of objects is null in the rows without one
    if not isinstance(value, dict):
        raise DatasetFormatError(
            f"{where}: field {schema.metadata_key!r} must be an object, got {type(value).__name__}"
        )
    return json_value(value, schema.metadata_key, where)


def _tools(row: dict[str, Any], tool_key: str | None, where: str) -> list[Any] | None:
    """The row's tool schemas under ``tool_key`` (a list, or a JSON string of one, as slime
    reads them); None when there is no tool key or the row has none."""
    if tool_key is None or row.get(tool_key) is None:
        return None
    tools = row[tool_key]
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DatasetFormatError(
                f"{where}: field {tool_key!r} is a string but not JSON ({e.msg})"
            ) from e
    tools = json_value(tools, tool_key, where)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DatasetFormatError(f"{where}: field {tool_key!r} must be a list of tool objects")
    return tools


def _check_messages(messages: list[Any], field_name: str, where: str) -> None:
    """Checks that `messages` is a non-empty list of {"role": str, "content": str}."""
    if not messages:
        raise DatasetFormatError(f"{where}: field {field_name!r} is an empty message list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetFormatError(f"{where}: field {field_name!r}[{i}] is not a message object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DatasetFormatError(
                    f"{where}: field {field_name!r}[{i}] needs a string {key!r}"
                )
    if not any(message["content"].strip() for message in messages):
        raise DatasetFormatError(f"{where}: field {field_name!r} has only blank message contents")


@dataclass(frozen=True)
class _Template:
    """How prompts become text: see `load_prompt_dataset`'s arguments of the same names."""

    apply_chat_template: bool | None
    tokenizer: Any
    kwargs: dict[str, Any]


def _prompt_text(
    value: Any, field_name: str, where: str, template: _Template, tools: list[Any] | None
) -> str:
    """Turns a prompt field (string or chat messages) into prompt text."""
    if isinstance(value, str):
        if not value.strip():  # a blank prompt would train on the template alone
            raise DatasetFormatError(f"{where}: field {field_name!r} is empty or whitespace only")
        messages = [{"role": "user", "content": value}] if template.apply_chat_template else None
    elif isinstance(value, list):
        _check_messages(value, field_name, where)
        if template.apply_chat_template is False:
            raise DatasetFormatError(
                f"{where}: field {field_name!r} is a chat message list but "
                "apply_chat_template=False"
            )
        if template.tokenizer is None:
            raise DatasetFormatError(
                f"{where}: field {field_name!r} is a chat message list; pass tokenizer= so its "
                "chat template can turn it into text"
            )
        messages = value
    else:
        raise DatasetFormatError(
            f"{where}: field {field_name!r} must be a string or a list of chat messages, "
            f"got {type(value).__name__}"
        )
    if messages is None:
        if tools is not None:
            raise DatasetFormatError(
                f"{where}: the row has tools but its string prompt does not go through the chat "
                "template (which is what renders tools); set apply_chat_template=True"
            )
        return value
    extra = dict(template.kwargs)
    if tools is not None:
        extra["tools"] = tools
    text = template.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **extra
    )
    if not isinstance(text, str):
        raise DatasetFormatError(
            f"{where}: the chat template returned {type(text).__name__}, not str"
        )
    if not text:
        raise DatasetFormatError(f"{where}: field {field_name!r} is empty")
    return text


def _read_label(row: dict[str, Any], schema: _Schema, where: str) -> str:
    """The row's label (GSM8K's final number for that schema), a non-empty string."""
    label_value = _get_field(row, schema.label_path, where)
    label_field = ".".join(schema.label_path)
    if not isinstance(label_value, str):
        raise DatasetFormatError(
            f"{where}: field {label_field!r} must be a string, got {type(label_value).__name__}"
        )
    label = _gsm8k_label(label_value, where) if schema.gsm8k_answer else label_value
    if not label.strip():
        raise DatasetFormatError(f"{where}: field {label_field!r} is empty")
    return label


def load_prompt_dataset(
    path: str | Path,
    *,
    input_key: str | None = None,
    label_key: str | None = None,
    metadata_key: str | None = None,
    tool_key: str | None = None,
    apply_chat_template: bool | None = None,
    apply_chat_template_kwargs: dict[str, Any] | None = None,
    tokenizer: Any = None,
) -> list[PromptRecord]:
    """Reads every row of a jsonl or parquet prompt dataset.

    Args:
        path: A ``.jsonl`` (one JSON object per line, no blank lines) or ``.parquet`` file.
        input_key: Key of the prompt (slime's ``--input-key``, verl's ``data.prompt_key``).
            Giving it or `label_key` turns schema detection off: the prompt is read from
            `input_key` (default "prompt") and the label verbatim from `label_key` (default
            "label"). In both, dots walk into nested objects ("x.question",
            "reward_model.ground_truth"), so a key with a dot in its name cannot be named.
        label_key: Key of the label, see `input_key` (slime's ``--label-key``).
        metadata_key: Key of the metadata object (slime's ``--metadata-key``), then required in
            every row. None: a detected verl row gives every column but the prompt; any other
            row (explicit keys included) its "metadata" object when it has one, else empty.
        tool_key: Key of the row's tool schemas (slime's ``--tool-key``; a list, or a JSON
            string of one), passed to the chat template as ``tools=`` and kept as
            ``metadata["tools"]`` (a row whose metadata has its own "tools" is refused); a row
            without it has no tools. None: no tools are read.
        apply_chat_template: None: chat-message prompts go through the chat template, string
            prompts are used as they are. True: every prompt goes through the template, a
            string prompt as one "user" message (slime's ``--apply-chat-template``). False: no
            template; a chat-message prompt is an error.
        apply_chat_template_kwargs: Extra keyword arguments of every chat template call (slime's
            ``--apply-chat-template-kwargs``, verl's ``data.apply_chat_template_kwargs``), e.g.
            ``{"enable_thinking": False}``.
        tokenizer: Object with ``apply_chat_template(messages, tokenize=False,
            add_generation_prompt=True, **kwargs) -> str`` (a transformers tokenizer); needed
            whenever a template is applied.

    Returns:
        One `PromptRecord` per row, in file order, ``source_index`` = 0-based row position.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: apply_chat_template=True without a tokenizer.
        DatasetFormatError (a ValueError): An unsupported suffix, an empty file, an
            unrecognised schema, or a row with invalid JSON, a missing field, a non-string or
            empty prompt or label, a malformed chat message list, GSM8K answer or tool list, or
            metadata that is not JSON; the message names the file, the row and the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset {path} does not exist")
    if apply_chat_template and tokenizer is None:
        raise ValueError(f"{path}: apply_chat_template=True needs tokenizer=")
    template = _Template(apply_chat_template, tokenizer, dict(apply_chat_template_kwargs or {}))
    records: list[PromptRecord] = []
    schema = _explicit_schema(input_key, label_key, metadata_key)
    for source_index, (where, row) in enumerate(_iter_rows(path)):
        if schema is None:
            schema = _detect_schema(row, where)
            if metadata_key is not None:
                schema = dataclasses.replace(
                    schema, metadata_is_row=False, metadata_key=metadata_key, metadata_required=True
                )
        where = f"{where} ({schema.name} schema)"
        label = _read_label(row, schema, where)
        metadata = _metadata(row, schema, where)
        tools = _tools(row, tool_key, where)
        if tools is not None:
            if "tools" in metadata:
                raise DatasetFormatError(
                    f"{where}: the row's metadata has its own 'tools', which data.tool_key="
                    f"{tool_key!r} would overwrite with the row's tool schemas; rename one"
                )
            metadata["tools"] = tools
        prompt_value = _get_field(row, schema.prompt_path, where)
        prompt_field = ".".join(schema.prompt_path)
        prompt = _prompt_text(prompt_value, prompt_field, where, template, tools)
        records.append(PromptRecord(prompt, label, source_index, metadata))
    if not records:
        raise DatasetFormatError(f"{path}: the dataset has no rows")
    return records
