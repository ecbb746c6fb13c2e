"""Per-token weight versions from SGLang 0.5.23's ``meta_info["weight_versions"]`` spans, with
SGLang's own span code as the truth (``srt/utils/weight_versions.py``, loaded by
``tests/sglang_reference.py``): the scheduler's ``record_weight_version_events`` /
``truncate_weight_version_events`` / ``compute_weight_version_spans`` and the tokenizer
manager's ``add_weight_versions_to_meta_info`` make the reply; our SGLang client must turn it
into the version of every token, and our embedded server must span its outputs as SGLang does.
"""

from __future__ import annotations

import httpx
import pytest
import sglang_reference as ref

from megatron_sat.rollout.client import SamplingParams, SGLangClient, SGLangError
from megatron_sat.rollout.embedded.server import version_spans
from megatron_sat.rollout.weight_versions import spans_to_versions

# (update events as (old version, output tokens when the push landed), version at the end,
# output tokens, the version of every token written out by hand).
CASES = [
    ([], "4", 3, ["4", "4", "4"]),
    ([], "4", 0, []),
    ([("1", 2)], "2", 5, ["1", "1", "2", "2", "2"]),
    ([("1", 1), ("2", 3)], "3", 4, ["1", "2", "2", "3"]),
    # A push after the last token: every token is the old version's.
    ([("1", 3)], "2", 3, ["1", "1", "1"]),
    # Two pushes at the same point (the second pushed nothing new to this request).
    ([("1", 2), ("2", 2)], "3", 4, ["1", "1", "3", "3"]),
    # The request was cut back (retracted) to 2 tokens after pushes at 3 and 5.
    ([("1", 3), ("2", 5)], "3", 2, ["1", "1"]),
]


@pytest.fixture(scope="module")
def sglang():
    return ref.weight_versions_module()


def sglang_meta(sglang, events, current, num_tokens) -> dict:
    """The meta_info SGLang 0.5.23 builds for an output: its scheduler's events (truncated to
    the kept tokens, as ``Req`` does on retraction), spans, then the tokenizer manager's
    fields."""
    recorded = [sglang.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in events]
    kept = sglang.truncate_weight_version_events(recorded, num_tokens)
    spans = sglang.compute_weight_version_spans(kept, current, num_tokens)
    meta: dict = {}
    sglang.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=num_tokens)
    return meta


@pytest.mark.parametrize(("events", "current", "num_tokens", "want"), CASES)
def test_client_reads_sglang_spans_per_token(sglang, events, current, num_tokens, want):
    meta = sglang_meta(sglang, events, current, num_tokens)
    output_ids = list(range(10, 10 + num_tokens))
    reply = {
        "output_ids": output_ids,
        "meta_info": {
            **meta,
            "finish_reason": {"type": "length", "length": num_tokens},
            "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        },
    }
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=reply))
    client = SGLangClient("http://sglang.test")
    client._http = httpx.Client(base_url="http://sglang.test", transport=transport)
    (out,) = client.generate([1, 2], SamplingParams(max_new_tokens=max(num_tokens, 1)))
    assert out.token_versions() == want
    # SGLang's weight_version is the last span's: the version that finished the request.
    assert out.weight_version == meta["weight_version"]
    assert spans_to_versions(meta["weight_versions"], num_tokens) == want


@pytest.mark.parametrize(("events", "current", "num_tokens", "want"), CASES)
def test_embedded_server_spans_as_sglang(sglang, events, current, num_tokens, want):
    meta = sglang_meta(sglang, events, current, num_tokens)
    assert version_spans(events, current, num_tokens) == meta["weight_versions"]


def test_spans_that_do_not_cover_the_output_are_an_error_naming_the_server():
    reply = {
        "output_ids": [5, 6, 7],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 3},
            "weight_version": "2",
            "weight_versions": [{"version": "2", "start": 0, "end": 2}],
            "output_token_logprobs": [[-0.5, t, None] for t in (5, 6, 7)],
        },
    }
    client = SGLangClient("http://sglang.test")
    client._http = httpx.Client(
        base_url="http://sglang.test",
        transport=httpx.MockTransport(lambda request: httpx.Response(200, json=reply)),
    )
    with pytest.raises(SGLangError, match=r"sglang.test/generate: weight_versions .* 2 of 3"):
        client.generate([1], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        # a huge end is refused before anything is expanded (it cost 480 MB at 3e7 before)
        ([{"version": "1", "start": 0, "end": 10**10}], "reaches past the 5 tokens"),
        ([{"version": "1", "start": 0, "end": 2.7}], "bounds must be integers"),
        ([{"version": "1", "start": 0, "end": True}], "bounds must be integers"),
        (
            [{"version": "1", "start": 0, "end": 2}, {"version": "0", "start": 2, "end": 5}],
            "run backwards",
        ),
        ([{"version": "1", "start": 1, "end": 5}], "not contiguous"),
    ],
)
def test_malformed_spans_are_refused(spans, message):
    from megatron_sat.rollout.weight_versions import spans_to_versions

    with pytest.raises(ValueError, match=message):
        spans_to_versions(spans, 5)


def test_spans_across_a_push_and_sglangs_empty_span():
    from megatron_sat.rollout.weight_versions import spans_to_versions

    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
    assert spans_to_versions(spans, 5) == ["1", "1", "2", "2", "2"]
    assert spans_to_versions([{"version": "3", "start": 0, "end": 0}], 0) == []
