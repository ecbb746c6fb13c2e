"""Prompt datasets (jsonl or parquet) read into `PromptRecord`s for the rollout pool.

Three row schemas are recognised from the first row of a file, and every later row must follow
the same one:

- ours: ``{"prompt": str | chat messages, "label": str}`` (slime's prompt/label keys);
- GSM8K: ``{"question": str, "answer": str}``, the label being the number after the final
  "####" with thousands separators removed ("#### 1,234" -> "1234");
- DAPO-Math: ``{"prompt": [{"role": str, "content": str}, ...], "reward_model":
  {"ground_truth": str}}``.

Chat-format prompts (lists of messages) become text through the tokenizer's chat template with
``add_generation_prompt=True``. Nothing is dropped or coerced silently: a bad row raises
`DatasetFormatError` (a `ValueError`) naming the file, the row (1-based line for jsonl, 1-based
row for parquet) and the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
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
    """

    prompt: str
    label: str
    source_index: int


@dataclass(frozen=True)
class _Schema:
    """Where a schema keeps its prompt and label.

    Attributes:
        name: Name used in error messages.
        prompt_key: Top-level key of the prompt.
        label_path: Keys from the row to the label ("reward_model.ground_truth" -> two keys).
        gsm8k_answer: The label field is a GSM8K solution ending in "#### <number>".
    """

    name: str
    prompt_key: str
    label_path: tuple[str, ...]
    gsm8k_answer: bool = False


_OURS = _Schema("prompt/label", "prompt", ("label",))
_GSM8K = _Schema("GSM8K", "question", ("answer",), gsm8k_answer=True)
_DAPO = _Schema("DAPO-Math", "prompt", ("reward_model", "ground_truth"))


def _detect_schema(first_row: dict[str, Any], where: str) -> _Schema:
    """Picks the schema from the keys of the first row."""
    if "question" in first_row and "answer" in first_row:
        return _GSM8K
    if "prompt" in first_row and "reward_model" in first_row:
        return _DAPO
    if "prompt" in first_row and "label" in first_row:
        return _OURS
    raise DatasetFormatError(
        f"{where}: cannot tell the schema from the keys {sorted(first_row)}; expected "
        "prompt+label, question+answer (GSM8K) or prompt+reward_model (DAPO-Math), or pass "
        "prompt_key= and label_key="
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
                if not isinstance(row, dict):
                    raise DatasetFormatError(
                        f"{where}: expected a JSON object, got {type(row).__name__}"
                    )
                yield where, row
    elif suffix == ".parquet":
        # Imported here so that jsonl-only users never pay for pyarrow.
        import pyarrow.parquet as pq

        for row_index, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}, row {row_index + 1}", row
    else:
        raise DatasetFormatError(
            f"{path}: unsupported dataset format {suffix!r}; use .jsonl or .parquet"
        )


def _get_field(row: dict[str, Any], path: tuple[str, ...], where: str) -> Any:
    """Follows `path` through nested dicts; raises naming the dotted field when it is missing."""
    value: Any = row
    for depth, key in enumerate(path):
        if not isinstance(value, dict) or key not in value:
            raise DatasetFormatError(f"{where}: missing field {'.'.join(path[: depth + 1])!r}")
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


def _check_messages(messages: list[Any], field: str, where: str) -> None:
    """Checks that `messages` is a non-empty list of {"role": str, "content": str}."""
    if not messages:
        raise DatasetFormatError(f"{where}: field {field!r} is an empty message list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetFormatError(f"{where}: field {field!r}[{i}] is not a message object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DatasetFormatError(f"{where}: field {field!r}[{i}] needs a string {key!r}")
    if not any(message["content"].strip() for message in messages):
        raise DatasetFormatError(f"{where}: field {field!r} has only blank message contents")


def _prompt_text(
    value: Any, field: str, where: str, apply_chat_template: bool | None, tokenizer: Any
) -> str:
    """Turns a prompt field (string or chat messages) into prompt text."""
    if isinstance(value, str):
        if not value.strip():  # a blank prompt would train on the template alone
            raise DatasetFormatError(f"{where}: field {field!r} is empty or whitespace only")
        if not apply_chat_template:
            text = value
        else:
            messages = [{"role": "user", "content": value}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
    elif isinstance(value, list):
        _check_messages(value, field, where)
        if apply_chat_template is False:
            raise DatasetFormatError(
                f"{where}: field {field!r} is a chat message list but apply_chat_template=False"
            )
        if tokenizer is None:
            raise DatasetFormatError(
                f"{where}: field {field!r} is a chat message list; pass tokenizer= so its chat "
                "template can turn it into text"
            )
        text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
    else:
        raise DatasetFormatError(
            f"{where}: field {field!r} must be a string or a list of chat messages, "
            f"got {type(value).__name__}"
        )
    if not isinstance(text, str):
        raise DatasetFormatError(
            f"{where}: the chat template returned {type(text).__name__}, not str"
        )
    if not text:
        raise DatasetFormatError(f"{where}: field {field!r} is empty")
    return text


def load_prompt_dataset(
    path: str | Path,
    *,
    prompt_key: str | None = None,
    label_key: str | None = None,
    apply_chat_template: bool | None = None,
    tokenizer: Any = None,
) -> list[PromptRecord]:
    """Reads every row of a jsonl or parquet prompt dataset.

    Args:
        path: A ``.jsonl`` (one JSON object per line, no blank lines) or ``.parquet`` file.
        prompt_key: Key of the prompt. Giving it or `label_key` turns schema detection off: the
            prompt is read from `prompt_key` (default "prompt") and the label verbatim from
            `label_key` (default "label"; dots walk into nested objects, e.g.
            "reward_model.ground_truth").
        label_key: Key of the label, see `prompt_key`.
        apply_chat_template: None: chat-message prompts go through the chat template, string
            prompts are used as they are. True: every prompt goes through the template, a
            string prompt as one "user" message. False: no template; a chat-message prompt is
            an error.
        tokenizer: Object with ``apply_chat_template(messages, tokenize=False,
            add_generation_prompt=True) -> str`` (a transformers tokenizer); needed whenever a
            template is applied.

    Returns:
        One `PromptRecord` per row, in file order, ``source_index`` = 0-based row position.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: apply_chat_template=True without a tokenizer.
        DatasetFormatError (a ValueError): An unsupported suffix, an empty file, an
            unrecognised schema, or a row with invalid JSON, a missing field, a non-string or
            empty prompt or label, a malformed chat message list or GSM8K answer; the message
            names the file, the row and the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset {path} does not exist")
    if apply_chat_template and tokenizer is None:
        raise ValueError(f"{path}: apply_chat_template=True needs tokenizer=")
    explicit = None
    if prompt_key is not None or label_key is not None:
        explicit = _Schema(
            "explicit keys", prompt_key or "prompt", tuple((label_key or "label").split("."))
        )

    records: list[PromptRecord] = []
    schema = explicit
    for source_index, (where, row) in enumerate(_iter_rows(path)):
        if schema is None:
            schema = _detect_schema(row, where)
        where = f"{where} ({schema.name} schema)"
        prompt_value = _get_field(row, (schema.prompt_key,), where)
        label_value = _get_field(row, schema.label_path, where)
        label_field = ".".join(schema.label_path)
        if not isinstance(label_value, str):
            raise DatasetFormatError(
                f"{where}: field {label_field!r} must be a string, got {type(label_value).__name__}"
            )
        label = _gsm8k_label(label_value, where) if schema.gsm8k_answer else label_value
        if not label.strip():
            raise DatasetFormatError(f"{where}: field {label_field!r} is empty")
        prompt = _prompt_text(
            prompt_value, schema.prompt_key, where, apply_chat_template, tokenizer
        )
        records.append(PromptRecord(prompt=prompt, label=label, source_index=source_index))
    if not records:
        raise DatasetFormatError(f"{path}: the dataset has no rows")
    return records
