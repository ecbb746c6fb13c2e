"""The fast route decoder against the stdlib one it replaced.

Oracle: ``_decode_routed_experts_stdlib`` in bench/data_path.py, the decoder of
``routing.payload`` as it was before pybase64 (json.loads + ``base64.b64decode(validate=True)``
+ numpy), kept there verbatim for the bench's ratio. The fast decoder must refuse every
malformed payload the old one refuses with the same message, and decode bit-identically.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from megatron_sat.routing.payload import decode_routed_experts, encode_routed_experts
from megatron_sat.routing.wire import split_routed_experts

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "data_path.py"


def _load_reference():
    spec = importlib.util.spec_from_file_location("_bench_data_path", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._decode_routed_experts_stdlib


decode_stdlib = _load_reference()


def _b64(values, dtype="<i4") -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


GOOD = _b64(np.arange(2 * 3 * 2).reshape(2, 3, 2) % 7)  # [2, 3, 2] ids < 7
SHAPE = {"num_tokens": 2, "num_layers": 3, "top_k": 2, "num_experts": 8}

# (case id, payload, decoder keyword arguments)
MALFORMED = [
    ("wrong_char", GOOD[:5] + "*" + GOOD[6:], SHAPE),
    ("non_ascii_str", GOOD[:5] + "é" + GOOD[6:], SHAPE),
    ("newline", GOOD[:8] + "\n" + GOOD[8:], SHAPE),
    ("url_safe_char", GOOD[:5] + "-" + GOOD[6:], SHAPE),
    ("bad_padding_missing", "AAA", SHAPE),
    ("bad_padding_discontinuous", "AA=A", SHAPE),
    ("bad_padding_leading", "=AAA" + GOOD, SHAPE),
    ("excess_after_padding", "AA==" + GOOD, SHAPE),
    ("length_4n_plus_1", GOOD + "A", SHAPE),
    ("truncated", GOOD[:-4], SHAPE),
    ("not_multiple_of_int32", _b64(np.zeros(5, np.uint8), np.uint8), SHAPE),
    ("extra_bytes", GOOD + _b64([0, 0]), SHAPE),
    ("wrong_count_layers", _b64(np.zeros((2, 4, 2))), SHAPE),
    ("negative_id", _b64([[[0, 1], [2, -1], [3, 4]], [[0, 1], [2, 3], [4, 5]]]), SHAPE),
    ("id_equals_num_experts", _b64([[[0, 1], [2, 3], [4, 5]], [[0, 1], [8, 3], [4, 5]]]), SHAPE),
    ("int32_min", _b64([[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4, -(2**31)]]]), SHAPE),
    (
        "int16_range_over_256_experts",
        _b64([[[0, 300]], [[299, 300]]]),
        {"num_tokens": 2, "num_layers": 1, "top_k": 2, "num_experts": 300},
    ),
    (
        "int16_negative_over_256_experts",
        _b64([[[0, 3]], [[-7, 1]]]),
        {"num_tokens": 2, "num_layers": 1, "top_k": 2, "num_experts": 300},
    ),
    ("negative_num_tokens", GOOD, {**SHAPE, "num_tokens": -1}),
    ("zero_experts", GOOD, {**SHAPE, "num_experts": 0}),
    ("too_many_experts", GOOD, {**SHAPE, "num_experts": 40000}),
]


def _message(fn, payload, kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(payload, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    "payload,kwargs", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
def test_refuses_malformed_with_the_old_message(payload, kwargs, as_bytes):
    expected = _message(decode_stdlib, payload, kwargs)
    if as_bytes:
        if not payload.isascii():
            # A str payload's non-ASCII text cannot come from a body's bytes as such; the
            # body's UTF-8 bytes are refused as characters outside the alphabet.
            payload = payload.encode()
            expected = _message(decode_stdlib, payload, kwargs)
        else:
            payload = memoryview(payload.encode())
    assert _message(decode_routed_experts, payload, kwargs) == expected


def test_messages_name_the_fault():
    """Spot-check the words themselves (the oracle could drift with the stdlib)."""
    bad = MALFORMED
    by_id = {c[0]: c for c in bad}
    assert _message(decode_routed_experts, *by_id["wrong_char"][1:]) == (
        "routed_experts payload is not valid base64: Only base64 data is allowed"
    )
    assert _message(decode_routed_experts, *by_id["length_4n_plus_1"][1:]).endswith(
        "number of data characters (65) cannot be 1 more than a multiple of 4"
    )
    assert _message(decode_routed_experts, *by_id["negative_id"][1:]) == (
        "routed_experts id out of range [0, 8): min -1, max 5; "
        "first bad entry at [token, layer, k]=[0, 1, 1]"
    )
    assert _message(decode_routed_experts, *by_id["id_equals_num_experts"][1:]) == (
        "routed_experts id out of range [0, 8): min 0, max 8; "
        "first bad entry at [token, layer, k]=[1, 1, 0]"
    )


def test_refuses_a_payload_that_is_not_text():
    with pytest.raises(TypeError, match="must be str or bytes-like, got list"):
        decode_routed_experts([1, 2], **SHAPE)


@pytest.mark.parametrize(
    "num_tokens,num_layers,top_k,num_experts",
    [(257, 48, 8, 128), (1, 48, 8, 256), (33, 4, 8, 300), (5, 2, 3, 32768), (0, 48, 8, 128)],
)
def test_decodes_bit_identically(num_tokens, num_layers, top_k, num_experts):
    rng = np.random.default_rng(num_tokens * 1000 + num_experts)
    ids = rng.integers(0, num_experts, size=(num_tokens, num_layers, top_k))
    if ids.size:
        ids.flat[0], ids.flat[-1] = 0, num_experts - 1  # both ends of the range
    payload = encode_routed_experts(ids)
    shape = dict(num_tokens=num_tokens, num_layers=num_layers, top_k=top_k)
    want = decode_stdlib(payload, **shape, num_experts=num_experts)
    for given in (payload, payload.encode(), memoryview(b"xx" + payload.encode())[2:]):
        got = decode_routed_experts(given, **shape, num_experts=num_experts)
        assert got.dtype == want.dtype == (np.uint8 if num_experts <= 256 else np.int16)
        assert got.shape == want.shape == (num_tokens, num_layers, top_k)
        assert got.tobytes() == want.tobytes()
        assert np.array_equal(got.astype(np.int64), ids)
        assert got.flags.c_contiguous and got.flags.writeable


def test_result_does_not_alias_the_payload():
    body = bytearray(encode_routed_experts(np.full((3, 2, 2), 5)).encode())
    got = decode_routed_experts(
        memoryview(body), num_tokens=3, num_layers=2, top_k=2, num_experts=8
    )
    body[:4] = b"////"  # the caller reuses its buffer
    assert got.tolist() == np.full((3, 2, 2), 5).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_agrees_on_random_mutations(seed):
    """Single-character mutations of a valid payload: accepted or refused alike, same text."""
    rng = np.random.default_rng(seed)
    payload = encode_routed_experts(rng.integers(0, 128, size=(6, 48, 8)))
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=*- \n"
    for _ in range(50):
        pos = int(rng.integers(0, len(payload)))
        mutated = payload[:pos] + alphabet[int(rng.integers(0, len(alphabet)))] + payload[pos + 1 :]
        shape = dict(num_tokens=6, num_layers=48, top_k=8, num_experts=128)
        try:
            want = decode_stdlib(mutated, **shape)
        except ValueError as e:
            assert _message(decode_routed_experts, mutated, shape) == str(e)
        else:
            assert decode_routed_experts(mutated, **shape).tobytes() == want.tobytes()


# ---- reply bodies: routes cut out of the raw bytes (routing.wire) -------------------------------


def _reply(seed: int, *, routes: bool = True, text: str = "", num_tokens: int = 5) -> dict:
    """A reply shaped as SGLang 0.5.23 serializes it (tokenizer_manager._handle_batch_output)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 150_000, size=num_tokens).tolist()
    meta = {
        "id": f"req-{seed}",
        "finish_reason": {"type": "length", "length": num_tokens},
        "prompt_tokens": 7,
        "weight_version": "3",
        "completion_tokens": num_tokens,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.25 * i, t, None] for i, t in enumerate(ids)],
        "e2e_latency": 0.5,
    }
    if routes:
        meta["routed_experts"] = encode_routed_experts(
            rng.integers(0, 128, size=(7 + num_tokens - 1, 48, 8))
        )
    return {"text": text, "output_ids": ids, "meta_info": meta}


TRICKY_TEXT = [
    "",
    'the "routed_experts" key',
    '{"routed_experts":"AAAA"}',
    '\\"routed_experts":"',
    "routed_experts\\",
    'ends with a backslash \\\\"routed_experts":"AAAA',
    "é \u001b \n\t control and non-ASCII",
]


def _check_split(replies: list[dict], body: bytes, batched: bool) -> None:
    want = json.loads(body)
    want = want if batched else [want]
    got, payloads = split_routed_experts(body)
    got, payloads = (got, payloads) if batched else ([got], [payloads])
    assert len(got) == len(payloads) == len(want)
    for reply, payload, expected in zip(got, payloads, want, strict=True):
        routes = expected["meta_info"].pop("routed_experts", None)
        assert reply == expected
        if routes is None:
            assert payload is None
        else:
            assert isinstance(payload, memoryview) and payload.readonly
            assert bytes(payload) == routes.encode()


@pytest.mark.parametrize("text", TRICKY_TEXT)
@pytest.mark.parametrize("dumps", ["orjson", "json_spaced"])
def test_split_single_reply_equals_json_loads(text, dumps):
    reply = _reply(1, text=text)
    reply["meta_info"]["note"] = text  # the text again, before and after the routes
    reply["routed_experts"] = 3  # a top-level key of the same name, not a string
    body = orjson.dumps(reply) if dumps == "orjson" else json.dumps(reply, indent=1).encode()
    _check_split([reply], body, batched=False)


@pytest.mark.parametrize("text", TRICKY_TEXT)
def test_split_batched_reply_equals_json_loads(text):
    replies = [_reply(2, text=text), _reply(3, routes=False, text=text), _reply(4, text=text)]
    replies[1]["meta_info"]["routed_experts"] = None
    replies.append(_reply(5, routes=False))
    replies.append(_reply(6, num_tokens=0))  # an empty payload still is one
    replies[-1]["meta_info"]["routed_experts"] = ""
    _check_split(replies, orjson.dumps(replies), batched=True)


def test_split_payload_decodes_in_place():
    reply = _reply(7, num_tokens=9)
    body = orjson.dumps(reply)
    parsed, payload = split_routed_experts(body)
    shape = dict(num_tokens=7 + 9 - 1, num_layers=48, top_k=8, num_experts=128)
    got = decode_routed_experts(payload, **shape)
    want = decode_stdlib(json.loads(body)["meta_info"]["routed_experts"], **shape)
    assert got.tobytes() == want.tobytes() and got.dtype == np.uint8
    assert "routed_experts" not in parsed["meta_info"]


def test_split_without_routes_returns_none():
    reply = _reply(8, routes=False)
    parsed, payload = split_routed_experts(orjson.dumps(reply))
    assert payload is None and parsed == reply


def test_split_escaped_key_spelling_parses_as_json_does():
    body = orjson.dumps(_reply(9, routes=False, text="x\u0001")).replace(
        b'"e2e_latency"', b'"routed\\u005fexperts":"AAAA","e2e_latency"'
    )
    parsed, payload = split_routed_experts(body)
    assert bytes(payload) == b"AAAA" and "routed_experts" not in parsed["meta_info"]


# Bodies the split refuses (body, the start of the message): every one a malformed reply.
MALFORMED_BODIES = [
    (b"", "reply body is not valid JSON: "),
    (b'{"text": "a", "meta_info": {', "reply body is not valid JSON: "),
    (
        b'{"meta_info": {"routed_experts": "AAAA", }}',
        "reply body is not valid JSON: ",
    ),
    (
        b'{"meta_info": {"routed_experts": "AAAA',
        "routed_experts value at byte 34 is not terminated",
    ),
    (
        b'{"meta_info": {"routed_experts": "AA\\"AA"}}',
        "routed_experts value at byte 34 holds a backslash: not base64",
    ),
    (b'{"meta_info": {"routed_experts": 7}}', "reply: meta_info.routed_experts is a JSON int"),
    (b'{"meta_info": [1]}', "reply: meta_info is a JSON list, not an object"),
    (b'[{"meta_info": {}}, 3]', "reply 1 is a JSON int, not an object"),
    (b'"routed_experts"', "reply is a JSON str, not an object"),
    (
        b'{"meta_info": {}, "x": {"routed_experts": "AAAA"}}',
        "reply body has a string-valued routed_experts key at byte 24 that no reply's",
    ),
    (
        b'{"meta_info": {"routed_experts": "AAAA", "routed_experts": "BBBB"}}',
        "reply body has a string-valued routed_experts key at byte 41 that no reply's",
    ),
    (b'{"a": "x"routed_experts":"AAAA"}', "reply body is not valid JSON: "),
    (
        b'{"meta_info": {"routed\\u005fexperts": ""}, "x": {"routed_experts": "AAAA"}}',
        "reply 0: meta_info.routed_experts is spelled with escapes while another",
    ),
]


@pytest.mark.parametrize("body,message", MALFORMED_BODIES)
def test_split_refuses_malformed_bodies(body, message):
    with pytest.raises(ValueError) as info:
        split_routed_experts(body)
    assert str(info.value).startswith(message)


def test_split_refuses_a_body_that_is_not_bytes():
    with pytest.raises(TypeError, match="reply body must be bytes or bytearray, got str"):
        split_routed_experts('{"meta_info": {}}')


# ---- the SGLang client's path: body bytes -> compact routes (rollout.client) --------------------


def _mock_client(bodies: list[bytes]):
    import httpx

    from megatron_sat.rollout.client import SGLangClient

    client = SGLangClient("http://sglang.test")
    replies = iter(bodies)
    client._http = httpx.Client(
        base_url=client.base_url,
        transport=httpx.MockTransport(lambda request: httpx.Response(200, content=next(replies))),
    )
    return client


def test_client_decodes_routes_from_the_body_bytes():
    """A batched reply: each output's routes are what the stdlib path decodes from the parsed
    JSON (bit-identical, uint8), and no output's meta_info keeps the base64 string."""
    from megatron_sat.rollout.sampling import RoutingSpec, SamplingParams

    replies = [_reply(11, num_tokens=4), _reply(12, num_tokens=6)]
    body = orjson.dumps(replies)
    client = _mock_client([body])
    routing = RoutingSpec(num_layers=48, top_k=8, num_experts=128)
    outs = client.generate([[1] * 7, [2] * 7], SamplingParams(max_new_tokens=6), routing=routing)
    for out, reply in zip(outs, json.loads(body), strict=True):
        want = decode_stdlib(
            reply["meta_info"]["routed_experts"],
            num_tokens=7 + len(reply["output_ids"]) - 1,
            num_layers=48,
            top_k=8,
            num_experts=128,
        )
        held = out.routed_experts
        assert held.dtype == np.uint8 and (held.base is None or held.base.flags.owndata)
        assert out.routed_experts.tobytes() == want.tobytes()
        assert "routed_experts" not in out.meta_info
        assert out.output_ids == reply["output_ids"]


def test_client_names_the_server_for_a_malformed_body():
    from megatron_sat.rollout.client import SGLangError
    from megatron_sat.rollout.sampling import RoutingSpec, SamplingParams

    bad = orjson.dumps(_reply(13)).replace(b'"routed_experts":"', b'"routed_experts":"*', 1)
    routing = RoutingSpec(num_layers=48, top_k=8, num_experts=128)

    def client(body: bytes):
        # a malformed body is refused and sent again (rollout.protocol): one body per attempt
        out = _mock_client([body] * 2)
        out.max_retries, out.retry_backoff_s = 1, 0.0
        return out

    with pytest.raises(SGLangError, match=r"http://sglang.test/generate: .*not valid base64"):
        client(bad).generate([1] * 7, SamplingParams(max_new_tokens=5), routing=routing)
    with pytest.raises(
        SGLangError, match=r"http://sglang.test/generate: reply is not JSON \(reply body is not"
    ):
        client(b"{").generate([1] * 7, SamplingParams(max_new_tokens=5))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"output_ids": [3.9, True]}, "output_ids must be a list of integers"),
        ({"output_ids": "ab"}, "output_ids must be a list of integers"),
        ({"logprobs": [[None, 5]]}, r"output_token_logprobs\[0\] = \[None, 5\] is not"),
        ({"logprobs": [[-0.1, True]]}, r"output_token_logprobs\[0\] is for token True"),
    ],
)
def test_malformed_outputs_are_named_not_coerced(change, message):
    """A breaker's finds: float or bool token ids were rounded into ids, and a null log-prob
    raised a bare TypeError naming no server."""
    from megatron_sat.rollout.client import SGLangError
    from megatron_sat.rollout.sampling import SamplingParams

    ids = change.get("output_ids", [5])
    entries = change.get("logprobs", [[-0.1, 5]])
    reply = {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "0",
            "output_token_logprobs": entries,
        },
    }
    client = _mock_client([orjson.dumps(reply)])
    with pytest.raises(SGLangError, match=rf"http://sglang.test/generate: {message}"):
        client.generate([1], SamplingParams(max_new_tokens=1))
