"""SGLang ``/generate`` reply bodies parsed without copying the routes through the JSON parser.

At the paper's shape a token's routes are 48 layers x top-8 int32 in base64, about 2 KB of the
reply per token, against some 50 bytes for everything else (its id, its log-prob). Parsing the
whole body copies those 2 KB into a Python ``str`` and back out again; here the routes stay where
they are in the body: :func:`split_routed_experts` cuts each reply's ``meta_info.routed_experts``
string value out of the raw bytes, parses the rest (a few percent of the body) with orjson, and
returns every payload as a ``memoryview`` of the body, which
:func:`megatron_sat.routing.payload.decode_routed_experts` decodes in place.

Reply shape (SGLang 0.5.23, ``entrypoints/http_server.py`` ``generate_request`` and
``managers/tokenizer_manager.py`` ``_handle_batch_output``): one JSON object per prompt, or a JSON
list of them for a batched request, serialized by orjson (compact, UTF-8); ``meta_info`` holds
``routed_experts`` (base64 string) only when routes were asked for and the request ran.

Why the cut is exact. The key is searched as the raw bytes ``"routed_experts"`` followed by
optional JSON whitespace, ``:``, optional whitespace and ``"``. The key's opening quote must not
be escaped (it follows an even run of backslashes); its closing quote follows ``s``, so both are
string delimiters, and the first one cannot close a string (``routed_experts`` would then stand
outside any string right after one: invalid JSON, which the parse of the rest refuses). So every
match is an object key ``routed_experts`` with a string value, and no text inside another string
can match (its quotes would be escaped). The value runs to the next ``"``: base64 has neither
quotes nor backslashes, and a backslash in the value is refused. Each cut value becomes ``""`` in
the rest; after the parse, each reply whose ``meta_info.routed_experts`` is that ``""`` claims the
next cut in byte order (replies and their keys appear in document order), and a cut that no reply
claims (the key somewhere else in the body) is refused. A key spelled with ``\\u`` escapes is
not matched as bytes; it parses as an ordinary string. Only when the rest holds a ``\\u`` escape
could such a key hold ``""`` and be taken for a cut, so then the claims are checked against a full
parse of the body (slower, same result).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_KEY = b'"routed_experts"'
_AFTER_KEY = re.compile(rb'[ \t\n\r]*:[ \t\n\r]*"')
_PLACEHOLDER = ""


def split_routed_experts(
    body: bytes | bytearray,
) -> (
    tuple[dict[str, Any], memoryview | None] | tuple[list[dict[str, Any]], list[memoryview | None]]
):
    """Parse a ``/generate`` reply body, leaving the routes as views of ``body``.

    Args:
        body: the raw HTTP body of an SGLang ``/generate`` reply: one JSON object, or a JSON list
            of objects for a batched request.

    Returns:
        For an object body, ``(reply, payload)``; for a list body, ``(replies, payloads)`` with
        one payload per reply, in order. Each reply is what ``json.loads`` gives for it, except
        that ``meta_info["routed_experts"]`` is removed; its value is the payload: a read-only
        ``memoryview`` of ``body`` holding the base64 ASCII bytes (not yet validated: decode it
        with :func:`megatron_sat.routing.payload.decode_routed_experts`), or None where the reply
        carries no routes. A view keeps ``body`` alive: decode it, then drop both.

    Raises:
        TypeError: if ``body`` is not bytes or bytearray.
        ValueError: if the body is not valid JSON (orjson's message, with the byte offset), is
            not an object or a list of objects, a reply's ``meta_info`` or
            ``meta_info.routed_experts`` has the wrong type, a ``routed_experts`` value is
            unterminated or holds a backslash, or a string-valued ``routed_experts`` key stands
            anywhere but in a reply's ``meta_info`` (each message names the byte offset or the
            reply).
    """
    if not isinstance(body, (bytes, bytearray)):
        raise TypeError(f"reply body must be bytes or bytearray, got {type(body).__name__}")
    cuts = _find_cuts(body)
    view = memoryview(body).toreadonly()
    if cuts:
        parts, pos = [], 0
        for _, start, end in cuts:
            parts.append(view[pos:start])
            pos = end
        parts.append(view[pos:])
        rest = b"".join(parts)
    else:
        rest = body
    try:
        parsed = orjson.loads(rest)
    except orjson.JSONDecodeError as e:
        cut = f" (offsets in the body less its {len(cuts)} routed_experts values)" if cuts else ""
        raise ValueError(f"reply body is not valid JSON: {e}{cut}") from e
    batched = isinstance(parsed, list)
    replies = parsed if batched else [parsed]
    payloads: list[memoryview | None] = []
    claimed = 0
    for index, reply in enumerate(replies):
        payload, took = _take_payload(reply, index, batched, claimed < len(cuts))
        if took:
            _, start, end = cuts[claimed]
            payload = view[start:end]
            claimed += 1
        payloads.append(payload)
    if claimed != len(cuts):
        raise ValueError(
            f"reply body has a string-valued routed_experts key at byte {cuts[claimed][0]} "
            f"that no reply's meta_info holds (elsewhere in the body, or a duplicate key; "
            f"{len(cuts)} such keys, {claimed} claimed): refusing to guess which routes belong "
            "to which reply"
        )
    if claimed and b"\\u" in rest:
        _check_claims_against_full_parse(body, payloads)
    if batched:
        return replies, payloads
    return replies[0], payloads[0]


def split_generate_reply(
    body: bytes | bytearray,
) -> tuple[list[dict[str, Any]], list[memoryview | None]]:
    """:func:`split_routed_experts` of a ``/generate`` body as lists whether the body is one
    reply or a batch: ``(replies, payloads)``, one payload (a view of ``body``, or None) per
    reply, the reply's ``meta_info`` without ``routed_experts``. The client's one call.

    Raises:
        TypeError, ValueError: as :func:`split_routed_experts`.
    """
    replies, payloads = split_routed_experts(body)
    if isinstance(replies, list):
        return replies, payloads
    return [replies], [payloads]


def _find_cuts(body: bytes | bytearray) -> list[tuple[int, int, int]]:
    """(key offset, start, end) of every ``routed_experts`` key with a string value: the value
    is ``body[start:end]``, between its quotes."""
    cuts = []
    pos = body.find(_KEY)
    while pos != -1:
        slashes = 0
        while pos - slashes > 0 and body[pos - slashes - 1] == 0x5C:  # backslash
            slashes += 1
        after = _AFTER_KEY.match(body, pos + len(_KEY)) if slashes % 2 == 0 else None
        if after is None:  # escaped quote (inside a string), or a non-string value
            pos = body.find(_KEY, pos + 1)
            continue
        start = after.end()
        end = body.find(b'"', start)
        if end == -1:
            raise ValueError(f"routed_experts value at byte {start} is not terminated")
        if body.find(b"\\", start, end) != -1:
            raise ValueError(f"routed_experts value at byte {start} holds a backslash: not base64")
        cuts.append((pos, start, end))
        pos = body.find(_KEY, end + 1)
    return cuts


def _take_payload(reply: Any, index: int, batched: bool, can_claim: bool) -> tuple[Any, bool]:
    """Pop ``meta_info.routed_experts`` of one parsed reply: (payload, whether it is a cut)."""
    where = f"reply {index}" if batched else "reply"
    if not isinstance(reply, dict):
        raise ValueError(f"{where} is a JSON {type(reply).__name__}, not an object")
    meta = reply.get("meta_info")
    if meta is None:
        return None, False
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: meta_info is a JSON {type(meta).__name__}, not an object")
    if "routed_experts" not in meta:
        return None, False
    value = meta.pop("routed_experts")
    if value is None:
        return None, False
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: meta_info.routed_experts is a JSON {type(value).__name__}, not a string"
        )
    if value == _PLACEHOLDER and can_claim:
        return None, True
    # A key spelled with escapes (never matched as raw bytes): parsed as an ordinary string.
    return memoryview(value.encode("utf-8")).toreadonly(), False


def _check_claims_against_full_parse(
    body: bytes | bytearray, payloads: list[memoryview | None]
) -> None:
    """With ``\\u`` escapes in the rest, an escaped ``routed_experts`` key holding ``""`` could
    pass for a cut: compare every claim with a full parse (rare, slow, exact)."""
    full = orjson.loads(body)
    full = full if isinstance(full, list) else [full]
    for index, (reply, payload) in enumerate(zip(full, payloads, strict=True)):
        want = (reply.get("meta_info") or {}).get("routed_experts")
        got = None if payload is None else bytes(payload).decode("utf-8")
        if want != got:
            raise ValueError(
                f"reply {index}: meta_info.routed_experts is spelled with escapes while another "
                "routed_experts key stands elsewhere in the body: refusing to guess"
            )
