"""The rollout pool's host memory (rollout.pool_memory) with hand-computed numbers, its config
checks, and its line in the launch plan's memory report."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sat.config import load_config
from megatron_sat.launch.plan import format_plan, resolve_plan
from megatron_sat.rollout.pool_memory import pool_batches, pool_memory

RECIPE = Path(__file__).resolve().parents[1] / "examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml"
PAPER = dict(storage="rank0_host", samples_per_batch=256 * 16, tokens_per_sample=8400)


def test_paper_shape_at_lag_8():
    """fixed_lag at lag 8 holds batches v .. v + 8: 9 x 4096 samples x 8400 tokens =
    309,657,600 tokens; routes 48 x 8 uint8 = 384 B/token -> 118,908,518,400 B; with the 80 B
    of lists per token, 464 B/token -> 143,681,126,400 B."""
    m = pool_memory(mode="fixed_lag", lag=8, routing_shape=(48, 8, 128), **PAPER)
    assert (m.batches, m.route_bytes_per_token) == (9, 384)
    assert m.tokens == 309_657_600
    assert m.route_bytes == 118_908_518_400
    assert m.total_bytes == 143_681_126_400


def test_batches_and_route_widths():
    assert [pool_batches("sync", 8), pool_batches("bounded", 0), pool_batches("bounded", 3)] == [
        1,
        1,
        4,
    ]
    wide = pool_memory(mode="sync", lag=1, routing_shape=(61, 8, 300), **PAPER)
    assert wide.route_bytes_per_token == 61 * 8 * 2  # int16 ids above 256 experts
    assert wide.total_bytes == 4096 * 8400 * (976 + 80)
    bare = pool_memory(mode="sync", lag=1, routing_shape=None, **PAPER)
    assert bare.route_bytes == 0 and bare.total_bytes == 4096 * 8400 * 80


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="rollout.pool_storage must be one of"):
        pool_memory(**{**PAPER, "storage": "disk"}, mode="sync", lag=1, routing_shape=None)
    with pytest.raises(ValueError, match="rollout.mode must be sync, fixed_lag or bounded"):
        pool_memory(mode="eager", lag=1, routing_shape=None, **PAPER)
    with pytest.raises(ValueError, match="rollout.lag must be >= 0"):
        pool_batches("bounded", -1)
    with pytest.raises(ValueError, match="rollout.pool_storage must be one of"):
        load_config(RECIPE, ["rollout.pool_storage=mmap"])
    with pytest.raises(ValueError, match="rollout.pool_host_memory_gib must be > 0 or null"):
        load_config(RECIPE, ["rollout.pool_host_memory_gib=0"])


def test_launch_plan_reports_and_bounds_the_pool():
    """The recipe (sync, 256 x 16, prompts up to 512 and responses up to 8192 tokens) holds one
    batch: 4096 x 8704 x 464 B = 15.4 GiB (prompts count: their routes and ids are held too);
    its lag-8 asynchronous variant at 8.4k tokens per sample 133.8 GiB, which a 100 GiB limit
    refuses."""
    text = format_plan(resolve_plan(load_config(RECIPE)))
    line = next(x for x in text.splitlines() if x.startswith("rollout pool host memory"))
    assert "up to 1 batch(es) x 4096 samples x 8,704 tokens" in line
    assert round(4096 * 8704 * 464 / 2**30, 1) == 15.4 and "= 15.4 GiB (routes 12.8 GiB)" in line
    lag8 = ["rollout.mode=fixed_lag", "rollout.lag=8", "rollout.pool_tokens_per_sample=8400"]
    text = format_plan(resolve_plan(load_config(RECIPE, lag8)))
    assert "up to 9 batch(es) x 4096 samples x 8,400 tokens" in text
    assert "= 133.8 GiB (routes 110.7 GiB)" in text
    with pytest.raises(ValueError, match="rollout.pool_host_memory_gib=100: the pool holds up to"):
        resolve_plan(load_config(RECIPE, [*lag8, "rollout.pool_host_memory_gib=100"]))
