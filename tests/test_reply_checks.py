"""The SGLang client's column-wise reply checks against the per-token loops they replaced.

Oracles: ``_entry_logprobs_per_item`` (rollout.generate_reply) and ``ReplyGuard._name_bad_logprob``
(rollout.protocol) are the per-token loops as they were before the column-wise paths, and
``_token_ids_per_item`` / ``_token_versions_per_token`` below restate the replaced code. Every
input, well formed or not, must give the same result: the same values of the same types, or
the same exception with the same message.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import orjson
import pytest

from megatron_sat.rollout.engine import SGLangError
from megatron_sat.rollout.generate_reply import (
    _entry_logprobs,
    _entry_logprobs_per_item,
    _token_ids,
)
from megatron_sat.rollout.pool import parse_weight_version, token_versions
from megatron_sat.rollout.protocol import ProtocolViolation, ReplyGuard
from megatron_sat.rollout.sampling import GenerateOutput

WHERE = "http://s/generate"


def _outcome(fn, *args):
    """(kind, value): the return value with each item's type, or the exception's type and
    message."""
    try:
        value = fn(*args)
    except Exception as e:  # the oracle compares any exception
        return "raised", (type(e), str(e))
    if isinstance(value, list):
        return "returned", [(type(v), v if not isinstance(v, float) else _bits(v)) for v in value]
    return "returned", value


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _token_ids_per_item(values, where):
    """rollout.generate_reply._token_ids before its column-wise path (verbatim)."""
    if not isinstance(values, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in values
    ):
        raise SGLangError(f"{where}: output_ids must be a list of integers: {values!r:.120}")
    return values


IDS = [5, 7, 9]
ENTRIES = {
    "well_formed": [[-0.5, 5, None], [-1.25, 7, None], [0.0, 9, None]],
    "two_items": [[-0.5, 5], [-1.25, 7], [0.0, 9]],
    "text_given": [[-0.5, 5, "a"], [-1.25, 7, "b"], [0.0, 9, None]],
    "mixed_lengths": [[-0.5, 5, None], [-1.25, 7], [0.0, 9, None, 1]],
    "one_item": [[-0.5, 5, None], [-1.25], [0.0, 9, None]],
    "empty_entry": [[-0.5, 5, None], [], [0.0, 9, None]],
    "null_entry": [[-0.5, 5, None], None, [0.0, 9, None]],
    "int_entry": [[-0.5, 5, None], 3, [0.0, 9, None]],
    "str_entry": [[-0.5, 5, None], "ab", [0.0, 9, None]],
    "dict_entry": [[-0.5, 5, None], {"0": -1.0, "1": 7}, [0.0, 9, None]],
    "null_logprob": [[-0.5, 5, None], [None, 7, None], [0.0, 9, None]],
    "str_logprob": [[-0.5, 5, None], ["-1.25", 7, None], [0.0, 9, None]],
    "bad_str_logprob": [[-0.5, 5, None], ["x", 7, None], [0.0, 9, None]],
    "bool_logprob": [[-0.5, 5, None], [True, 7, None], [0.0, 9, None]],
    "int_logprob": [[-0.5, 5, None], [0, 7, None], [0.0, 9, None]],
    "list_logprob": [[-0.5, 5, None], [[-1.0], 7, None], [0.0, 9, None]],
    "huge_int_logprob": [[-0.5, 5, None], [10**400, 7, None], [0.0, 9, None]],
    "bool_token": [[-0.5, 5, None], [-1.25, True, None], [0.0, 9, None]],
    "float_token": [[-0.5, 5, None], [-1.25, 7.0, None], [0.0, 9, None]],
    "str_token": [[-0.5, 5, None], [-1.25, "7", None], [0.0, 9, None]],
    "other_token": [[-0.5, 5, None], [-1.25, 8, None], [0.0, 9, None]],
    "later_bad_logprob_after_bad_token": [[-0.5, 6, None], [None, 7, None], [0.0, 9, None]],
    "bad_logprob_before_bad_token": [[None, 5, None], [-1.25, 8, None], [0.0, 9, None]],
    "nan_inf": [[float("nan"), 5, None], [float("inf"), 7, None], [-0.0, 9, None]],
}


@pytest.mark.parametrize("case", sorted(ENTRIES))
def test_entry_logprobs_match_the_per_entry_loop(case):
    entries = ENTRIES[case]
    assert _outcome(_entry_logprobs, entries, IDS, WHERE) == _outcome(
        _entry_logprobs_per_item, entries, IDS, WHERE
    )


def test_entry_logprobs_fast_path_hand_values():
    """The column-wise path's own values (not only agreement): the floats bit for bit, the
    text column ignored; a bool token is named, not taken for 1."""
    got = _entry_logprobs([[-0.5, 5, None], [-1.25, 7, "x"]], [5, 7], WHERE)
    assert [_bits(v) for v in got] == [_bits(-0.5), _bits(-1.25)]
    with pytest.raises(SGLangError, match=r"output_token_logprobs\[1\] is for token True, out"):
        _entry_logprobs([[-0.5, 5, None], [-1.25, True, None]], [5, 1], WHERE)


def test_entry_logprobs_of_a_random_orjson_reply_are_bit_identical():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 200_000, size=4096).tolist()
    logprobs = np.concatenate(
        [-rng.exponential(2.0, 4090), [0.0, -0.0, -1e-300, -5e-324, -1e308, 1e-5]]
    )
    body = orjson.dumps([[lp, t, None] for lp, t in zip(logprobs.tolist(), ids, strict=True)])
    entries = orjson.loads(body)
    assert _outcome(_entry_logprobs, entries, ids, WHERE) == _outcome(
        _entry_logprobs_per_item, entries, ids, WHERE
    )


@pytest.mark.parametrize(
    "values",
    [
        [],
        [1, 2, 3],
        [1, True],
        [1, 2.0],
        [1, "2"],
        [1, None],
        "ab",
        None,
        (1, 2),
        [2**70],
        {"a": 1},
    ],
    ids=repr,
)
def test_token_ids_match_the_per_item_check(values):
    assert _outcome(_token_ids, values, WHERE) == _outcome(_token_ids_per_item, values, WHERE)


def _guard_outcome(logprobs, fast: bool):
    guard = ReplyGuard("http://s")
    out = GenerateOutput([1] * len(logprobs), logprobs, "stop", "0", None, 1, len(logprobs))
    try:
        if fast:
            guard.check_output(out)
        else:
            guard._name_bad_logprob(WHERE, logprobs)
    except Exception as e:  # the oracle compares any exception
        kind = e.kind if isinstance(e, ProtocolViolation) else None
        return type(e), str(e), kind, dict(guard.refused)
    return None, dict(guard.refused)


@pytest.mark.parametrize(
    "logprobs",
    [
        [],
        [-0.5, 0.0, -0.0],
        [5e-5, 1e-4],  # within the tolerance
        [-0.5, 1.5e-4],
        [-0.5, math.nan, 3.0],
        [-0.5, 3.0, math.nan],
        [-math.inf],
        [-0.5, math.inf],
        [-0.5, True],
        [-0.5, 0, -1],
        [-0.5, "x"],
        [None],
    ],
    ids=repr,
)
def test_guard_logprob_check_matches_the_per_token_loop(logprobs):
    assert _guard_outcome(logprobs, fast=True) == _guard_outcome(logprobs, fast=False)


def _token_versions_per_token(out, server):
    """The pools' per-token parse before :func:`token_versions` (verbatim)."""
    parse_weight_version(out.weight_version, server)
    return [parse_weight_version(v, server) for v in out.token_versions()]


@pytest.mark.parametrize(
    ("weight_version", "per_token", "num_tokens"),
    [
        ("3", None, 4),
        ("3", None, 0),
        ("default", None, 0),
        ("default", None, 2),
        ("4", ["3", "3", "4"], 3),
        ("4", ["3", "x", "4", "y"], 4),
        ("4", ["3", "4"], 3),  # one version short
        ("-1", ["-1"], 1),
    ],
)
def test_token_versions_match_the_per_token_parse(weight_version, per_token, num_tokens):
    out = GenerateOutput([1] * num_tokens, [], "stop", weight_version, None, 1, num_tokens)
    out.output_token_versions = per_token
    assert _outcome(token_versions, out, "u") == _outcome(_token_versions_per_token, out, "u")


def test_a_well_formed_reply_takes_the_column_wise_path(monkeypatch):
    """The loops are the fallback only: a well-formed reply never reaches them."""
    import megatron_sat.rollout.generate_reply as generate_reply

    def loop(*args):
        raise AssertionError("the per-entry loop ran for a well-formed reply")

    monkeypatch.setattr(generate_reply, "_entry_logprobs_per_item", loop)
    monkeypatch.setattr(ReplyGuard, "_name_bad_logprob", loop)
    entries = ENTRIES["well_formed"]
    assert generate_reply._entry_logprobs(entries, IDS, WHERE) == [-0.5, -1.25, 0.0]
    out = GenerateOutput(IDS, [-0.5, -1.25, 0.0], "stop", "0", None, 1, 3)
    assert ReplyGuard("http://s").check_output(out) is out
