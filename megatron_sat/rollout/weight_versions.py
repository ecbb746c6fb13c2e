"""Per-token weight versions from an engine's ``weight_versions`` spans, shared by the SGLang
and vLLM clients.

Both engines describe which weights produced each output token as spans ``{"version", "start",
"end"}``, ``[start, end)`` over the output tokens, in order:

- SGLang 0.5.23 (``srt/utils/weight_versions.py``): ``compute_weight_version_spans`` folds the
  request's weight-update events into spans in the scheduler, and
  ``add_weight_versions_to_meta_info`` puts them in ``meta_info["weight_versions"]`` (clipped
  to the returned tokens; an output without tokens has the one span ``[v, 0, 0)``) and sets
  ``meta_info["weight_version"]`` to the last span's version.
- vLLM 0.32+ (``/inference/v1/generate``): ``choices[0].weight_versions``, the same shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def spans_to_versions(spans: Sequence[dict[str, Any]], num_tokens: int) -> list[str]:
    """Weight-version spans as one version per output token.

    Args:
        spans: ``{"version", "start", "end"}`` dicts, contiguous from 0; an empty span
            (``start == end``) is allowed (SGLang's span of an output without tokens).
        num_tokens: the output's token count, which the spans must cover exactly.

    Returns:
        ``num_tokens`` version strings.

    Raises:
        ValueError: when a bound is not an int, the spans are not contiguous from 0, reach
            past ``num_tokens`` (checked before anything is expanded: a malformed reply cannot
            make rank 0 allocate its ``end``), do not cover ``num_tokens``, or their integer
            versions decrease (weights only move forward); KeyError / TypeError for a span that
            is not such a dict.
    """
    versions: list[str] = []
    last: int | None = None
    for span in spans:
        start, end = span["start"], span["end"]
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in (start, end)):
            raise ValueError(f"weight_versions span bounds must be integers: {span}")
        if start != len(versions) or end < start:
            raise ValueError(f"weight_versions spans are not contiguous: {span}")
        if end > num_tokens:
            raise ValueError(f"weight_versions span {span} reaches past the {num_tokens} tokens")
        version = str(span["version"])
        number = int(version) if version.lstrip("-").isdigit() else None
        if number is not None and last is not None and number < last:
            raise ValueError(f"weight_versions run backwards: {span} after version {last}")
        last = number if number is not None else last
        versions += [version] * (end - start)
    if len(versions) != num_tokens:
        raise ValueError(f"spans cover {len(versions)} of {num_tokens} tokens")
    return versions
