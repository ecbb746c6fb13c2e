"""Batch distribution as flat CPU tensors (training.batch_transfer): exact round trips, and
under torchrun every rank receives bitwise what scatter_object_list of pickles delivered."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_torchrun
from dist.batch_transfer import same, synthetic_batch

from megatron_sat.training.batch_transfer import decode_share, encode_share


@pytest.mark.parametrize(("experts", "route_dtype"), [(8, np.uint8), (300, np.int16)])
def test_share_round_trips_bitwise_with_compact_routes(experts, route_dtype):
    samples, advantages = synthetic_batch(12, 4, 64, layers=3, topk=2, experts=experts, seed=1)
    advantages = advantages.double() / 3  # float64 survives too
    buffer = encode_share(samples, advantages, 5)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    back, adv, version = decode_share(buffer)
    assert version == 5 and adv.dtype == torch.float64 and torch.equal(adv, advantages)
    assert len(back) == len(samples) and all(same(a, b) for a, b in zip(back, samples, strict=True))
    routes = [s.routed_experts for s in back if s.routed_experts is not None]
    assert {r.dtype for r in routes} == {np.dtype(route_dtype)}
    if route_dtype == np.uint8:  # the receiver's routes are views of the buffer, not copies
        assert all(np.shares_memory(r, buffer.numpy()) for r in routes)
    # Routes travel compact: the buffer is smaller than the int64 token ids plus int32 routes.
    route_bytes = sum(r.size for r in routes) * np.dtype(route_dtype).itemsize
    assert route_bytes < buffer.numel() < route_bytes + 64 * 1024
    assert back[1].response_ids == [] and back[2].routed_experts is None and back[3].reward is None
    empty, empty_adv, none = decode_share(encode_share([], torch.zeros(0), None))
    assert empty == [] and empty_adv.shape == (0,) and none is None


def test_a_changed_byte_or_field_is_seen():
    samples, advantages = synthetic_batch(4, 2, 16, layers=2, topk=2, experts=8)
    buffer = encode_share(samples, advantages, 0)
    bad = buffer.clone()
    bad[9 * 8] ^= 1  # the magic
    with pytest.raises(ValueError, match="bad magic"):
        decode_share(bad)
    with pytest.raises(ValueError, match="segments add up"):
        decode_share(torch.cat([buffer, torch.zeros(1, dtype=torch.uint8)]))
    other = decode_share(buffer)[0]
    other[0].rollout_log_probs[0] = np.nextafter(other[0].rollout_log_probs[0], 0.0)
    assert not same(other[0], samples[0])  # the oracle sees a one-ulp change
    samples[0].metadata = {"x": {1, 2}}
    with pytest.raises(ValueError, match="sample 1000: metadata is not JSON"):
        encode_share(samples, advantages, 0)
    with pytest.raises(ValueError, match=r"\(3,\) advantages for 4 samples"):
        encode_share(samples[1:] + samples[:1], advantages[:3], 0)


@pytest.mark.parametrize("field", ["response_versions", "rollout_log_probs"])
def test_a_per_token_list_of_another_length_is_refused_naming_the_sample(field):
    """The decoder cuts versions and log-probs at the response length: one extra version of
    sample 1001 would have become the next sample's first (found by review: staleness 5
    instead of 0 on the receiving rank, accepted by every later check)."""
    samples, advantages = synthetic_batch(4, 2, 16, layers=2, topk=2, experts=8)
    getattr(samples[1], field).append(0)
    n = len(samples[1].response_ids)
    with pytest.raises(ValueError, match=rf"sample 1001: {n + 1} {field} for {n} response tokens"):
        encode_share(samples, advantages, 0)
    with pytest.raises(ValueError, match="trainer_version must be None or >= 0"):
        encode_share(samples[:1], advantages[:1], -2)


def test_unencodable_values_are_refused_naming_the_sample():
    """What numpy or UTF-8 cannot hold fails as a ValueError naming the sample and field, not
    as a bare UnicodeEncodeError, OverflowError or TypeError (found by review)."""
    samples, advantages = synthetic_batch(3, 1, 8, layers=2, topk=2, experts=8)
    with pytest.raises(ValueError, match="advantages must be float32 or float64, got torch.bf"):
        encode_share(samples, advantages.bfloat16(), 0)
    samples[1].response_text = "ok \udcff"  # a lone surrogate
    with pytest.raises(ValueError, match="sample 1001: response_text is not UTF-8 encodable"):
        encode_share(samples, advantages, 0)
    samples[1].response_text = "ok"
    samples[2].prompt_ids = [*samples[2].prompt_ids, 2**63]
    with pytest.raises(ValueError, match="sample 1002: prompt_ids outside int64"):
        encode_share(samples, advantages, 0)


@pytest.mark.slow
@pytest.mark.parametrize("dp_ranks", ["0,0,0", "0,0,1", "0,1,1"])
def test_shares_of_one_data_parallel_rank_are_encoded_once(dp_ranks):
    """3 ranks: all on one DP rank (DP 1 under TP / EP: one broadcast), and two layouts where
    two ranks share a DP rank (one buffer sent to both concurrently, the sender's own share
    kept or sent): every rank gets bitwise what the pickled scatter gives it."""
    proc = run_torchrun(
        "tests/dist/batch_transfer.py",
        *("--num-samples", "24", "--group-size", "4", "--experts", "300"),
        *("--dp-ranks", dp_ranks),
        nproc=3,
        done="BATCH_TRANSFER_OK",
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SHARES "))
    reports = json.loads(line.removeprefix("SHARES "))
    assert [r["ok"] for r in reports] == [True, True, True]
    tokens = [r["tokens"] for r in reports]
    same = [int(x) for x in dp_ranks.split(",")]
    assert all((tokens[a] == tokens[b]) == (same[a] == same[b]) for a in range(3) for b in range(3))


@pytest.mark.slow
def test_every_rank_receives_what_the_pickled_scatter_gave():
    proc = run_torchrun(
        "tests/dist/batch_transfer.py",
        *("--num-samples", "24", "--group-size", "4", "--experts", "300"),
        done="BATCH_TRANSFER_OK",
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SHARES "))
    reports = json.loads(line.removeprefix("SHARES "))
    assert [r["ok"] for r in reports] == [True, True]
    assert all(r["tokens"] > 0 for r in reports)
