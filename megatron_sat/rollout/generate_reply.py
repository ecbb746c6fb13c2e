"""The outputs of one SGLang ``/generate`` reply body: the pure parse, wherever it runs.

``SGLangClient.fetch_reply`` reads the reply's body (``rollout.protocol``'s guard: size cap,
retry of a malformed body) and hands it here, in the calling thread or, with
``rollout.reply_parse_workers`` > 0, in a worker process (``rollout.reply_parser``, where the
whole call runs): the parse is the same function either way, so both give the same outputs bit
for bit. Two stages, whose errors the client treats apart:

1. :func:`split_generate_reply` (``routing.wire``): the body as JSON, the routes left as views of
   its bytes. ``ValueError`` / ``TypeError`` / ``UnicodeDecodeError`` here mean a body that is
   not the JSON it should be: the guard refuses it (``malformed_json``) and the client sends the
   request again.
2. :func:`parse_outputs`: each reply's fields typed and checked (ids, log-probs against the ids,
   finish reason, per-token versions), its routes decoded into the compact array
   (``routing.payload``). A reply that breaks the field contract raises ``SGLangError`` naming
   the server: the pools treat the server as failed.

The protocol's content checks (log-probs <= 0, versions pushed) stay with the client's guard,
which holds the trainer-side state (``ReplyGuard.pushed_version``) and the refusal counters.

Field names and shapes follow sglang 0.5.23 (``srt/managers/io_struct.py``,
``srt/managers/tokenizer_manager.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from megatron_sat.rollout.engine import SGLangError
from megatron_sat.rollout.sampling import GenerateOutput, RoutingSpec
from megatron_sat.rollout.weight_versions import spans_to_versions
from megatron_sat.routing.payload import decode_routed_experts
from megatron_sat.routing.wire import split_generate_reply

_FIRST, _SECOND = itemgetter(0), itemgetter(1)

# meta_info keys typed into GenerateOutput's own fields and dropped from its ``meta_info``: the
# per-token [logprob, token_id, text] triples are the bulk of a reply after the routes (about
# 50 bytes of JSON and four Python objects per token), and nothing reads them once typed.
TYPED_META_KEYS = ("output_token_logprobs",)


@dataclass(frozen=True)
class ReplyRequest:
    """What the parse of one ``/generate`` reply needs to know of its request.

    Attributes:
        where: the server's base URL (every error names ``<where>/generate``).
        prompt_lens: tokens of each prompt of the request, in order (one output each).
        routing: the served model's routing shape when routes were asked for, else None.
        routed_experts_start_len: first token position whose routes were asked for.
        return_logprob: whether ``output_token_logprobs`` were asked for.
    """

    where: str
    prompt_lens: tuple[int, ...]
    routing: RoutingSpec | None = None
    routed_experts_start_len: int = 0
    return_logprob: bool = True


def parse_generate_body(body: bytes | bytearray, request: ReplyRequest) -> list[GenerateOutput]:
    """Both stages (module docstring) of one reply body: its outputs, unchecked by the guard.

    Raises:
        ValueError, TypeError, UnicodeDecodeError: from :func:`split_generate_reply` (a body
            that is not the expected JSON); the client refuses it as ``malformed_json``.
        SGLangError: from :func:`parse_outputs`.
    """
    items, payloads = split_generate_reply(body)
    return parse_outputs(items, payloads, request)


def parse_outputs(
    items: list[dict[str, Any]], payloads: list[memoryview | None], request: ReplyRequest
) -> list[GenerateOutput]:
    """The outputs of a reply already split by ``routing.wire.split_generate_reply``, one per
    prompt of ``request.prompt_lens``. Each output's ``meta_info`` is the reply's less
    ``routed_experts`` (decoded into ``routed_experts``) and :data:`TYPED_META_KEYS`.

    Raises:
        SGLangError: naming ``<where>/generate``, for a reply of another length than the batch,
            a missing or malformed field, an unfinished request, missing routes, routes of
            another shape or out of range, or ``weight_versions`` spans that do not cover the
            output tokens.
    """
    where = f"{request.where}/generate"
    if len(items) != len(request.prompt_lens):
        raise SGLangError(f"{where}: {len(items)} outputs for {len(request.prompt_lens)}")
    return [
        _parse_output(item, payload, prompt_len, request, where)
        for item, payload, prompt_len in zip(items, payloads, request.prompt_lens, strict=True)
    ]


def _parse_output(
    item: dict[str, Any],
    payload: memoryview | None,
    prompt_len: int,
    request: ReplyRequest,
    where: str,
) -> GenerateOutput:
    try:
        meta = item["meta_info"]
        output_ids = _token_ids(item["output_ids"], where)
        finish = meta["finish_reason"]
        weight_version = str(meta["weight_version"])
    except (KeyError, TypeError) as e:
        raise SGLangError(f"{where}: malformed output, missing {e}: {item!r:.300}") from e
    if not isinstance(finish, dict) or "type" not in finish:
        raise SGLangError(f"{where}: request did not finish (finish_reason={finish!r})")
    logprobs: list[float] = []
    if request.return_logprob:
        entries = meta.get("output_token_logprobs")
        if entries is None or len(entries) != len(output_ids):
            count = None if entries is None else len(entries)
            raise SGLangError(
                f"{where}: output_token_logprobs has {count} entries for "
                f"{len(output_ids)} output tokens"
            )
        logprobs = _entry_logprobs(entries, output_ids, where)
    routed = None
    routing = request.routing
    # A request aborted before it ran has no routing; the caller retries it anyway.
    if routing is not None and not (payload is None and finish["type"] == "abort"):
        if payload is None:
            raise SGLangError(
                f"{where}: no routed_experts in the response; start the server with "
                "--enable-return-routed-experts"
            )
        start_len = request.routed_experts_start_len
        try:
            routed = decode_routed_experts(
                payload,
                num_tokens=max(0, prompt_len + len(output_ids) - 1 - start_len),
                num_layers=routing.num_layers,
                top_k=routing.top_k,
                num_experts=routing.num_experts,
            )
        except ValueError as e:
            raise SGLangError(f"{where}: {e}") from e
    output = GenerateOutput(
        output_ids=output_ids,
        output_token_logprobs=logprobs,
        finish_reason=str(finish["type"]),
        weight_version=weight_version,
        routed_experts=routed,
        prompt_tokens=_count(meta, "prompt_tokens", prompt_len, where),
        completion_tokens=_count(meta, "completion_tokens", len(output_ids), where),
        meta_info=meta,
        output_token_versions=_token_versions(meta, len(output_ids), where),
    )
    for key in TYPED_META_KEYS:
        meta.pop(key, None)
    return output


def _count(meta: dict[str, Any], key: str, default: int, where: str) -> int:
    """``meta[key]`` (``default`` when absent), a JSON integer; else SGLangError naming it."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SGLangError(f"{where}: meta_info.{key} is {value!r:.50}, not an integer")
    return value


def _token_ids(values: Any, where: str) -> list[int]:
    """``output_ids`` as ints; anything else (floats, bools, strings) is a malformed reply,
    never rounded into a token id. orjson gives exact ``int``s, so one pass over the types in C
    (``bool`` is a type of its own) decides the common case; anything else takes the per-item
    check."""
    if type(values) is list and set(map(type, values)) <= {int}:
        return values
    if not isinstance(values, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in values
    ):
        raise SGLangError(f"{where}: output_ids must be a list of integers: {values!r:.120}")
    return values


def _entry_logprobs(entries: list[Any], output_ids: list[int], where: str) -> list[float]:
    """The log-probs of SGLang's ``output_token_logprobs`` entries ``[logprob, token_id, text]``
    (``srt/managers/tokenizer_manager.py`` ``detokenize_logprob_tokens``; text is null unless
    ``return_text_in_logprobs``), each entry's token checked against ``output_ids``.

    The common case is decided column-wise in C: the first two columns cut with ``map`` (the
    log-probs through ``float`` as the loop converts them), the tokens compared with
    ``output_ids`` as lists and their types checked (``bool`` is a type of its own). Anything
    else (an entry too short or not a list, a conversion that fails, a token that differs or
    is not an ``int``) goes to :func:`_entry_logprobs_per_item`, the per-entry loop, so what is
    accepted and every message (naming the first bad entry) are the loop's.

    Raises:
        SGLangError: naming the first entry that is not ``[logprob, token_id, ...]`` or whose
            token is not ``output_ids``' at its position.
    """
    if type(entries) is list:
        try:
            logprobs = list(map(float, map(_FIRST, entries)))
            tokens = list(map(_SECOND, entries))
        except (TypeError, ValueError, IndexError, KeyError):
            pass
        else:
            if tokens == output_ids and set(map(type, tokens)) <= {int}:
                return logprobs
    return _entry_logprobs_per_item(entries, output_ids, where)


def _entry_logprobs_per_item(entries: Any, output_ids: list[int], where: str) -> list[float]:
    """:func:`_entry_logprobs` one entry at a time (the reference; names the first bad one)."""
    logprobs: list[float] = []
    for pos, (entry, token) in enumerate(zip(entries, output_ids, strict=True)):
        try:
            logprob, entry_token = float(entry[0]), entry[1]
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise SGLangError(
                f"{where}: output_token_logprobs[{pos}] = {entry!r:.80} is not "
                f"[logprob, token_id, ...] ({e})"
            ) from e
        if entry_token != token or isinstance(entry_token, bool):
            raise SGLangError(
                f"{where}: output_token_logprobs[{pos}] is for token {entry_token!r}, "
                f"output_ids[{pos}] is {token}"
            )
        logprobs.append(logprob)
    return logprobs


def _token_versions(meta: dict[str, Any], num_tokens: int, where: str) -> list[str] | None:
    """The version of each output token from SGLang 0.5.23's ``meta_info["weight_versions"]``
    spans (``rollout.weight_versions``); None when the server sends none (an SGLang before
    the spans), where the request's ``weight_version`` stands for every token.

    Raises:
        SGLangError: naming the server when the spans do not cover the output tokens.
    """
    spans = meta.get("weight_versions")
    if spans is None:
        return None
    try:
        return spans_to_versions(spans, num_tokens)
    except (ValueError, KeyError, TypeError) as e:
        raise SGLangError(f"{where}: weight_versions {spans!r:.300}: {e}") from e
