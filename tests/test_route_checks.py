"""Vectorised route checks (routing.checks) against a row-by-row oracle, and the micro-batch
build naming the same faults as check_sample_routes did sample by sample."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_sat.rollout.types import Sample
from megatron_sat.routing import checks
from megatron_sat.routing.checks import RouteFault, find_route_fault, layer_selection
from megatron_sat.training.batching import build_micro_batch, check_sample_routes


def oracle(routes: np.ndarray, num_experts: int, moe_layers) -> RouteFault | None:
    """Row by row in C order over [rows, MoE layers]: the first range fault, else the first
    row naming an expert twice."""
    layers = range(routes.shape[1]) if moe_layers is None else sorted(n - 1 for n in moe_layers)
    for row in range(routes.shape[0]):
        for layer in layers:
            ids = routes[row, layer].astype(np.int64)
            if (ids < 0).any() or (ids >= num_experts).any():
                return RouteFault("range", row, layer)
    for row in range(routes.shape[0]):
        for layer in layers:
            if len(set(routes[row, layer].tolist())) != routes.shape[2]:
                return RouteFault("repeat", row, layer)
    return None


def distinct_routes(rng, rows, layers, top_k, num_experts, dtype):
    base = rng.integers(0, num_experts, size=(rows, layers, 1))
    return ((base + np.arange(top_k) * (num_experts // top_k)) % num_experts).astype(dtype)


def test_layer_selection_is_a_view_when_contiguous():
    assert layer_selection(6, None) == slice(0, 6)
    assert layer_selection(6, [4, 5, 6]) == slice(3, 6)  # DeepSeek-V3's dense prefix
    assert layer_selection(6, [2, 4]) == [1, 3]
    with pytest.raises(ValueError, match=r"moe_layers \[7\] outside \[1, num_layers=6\]"):
        layer_selection(6, [1, 7])


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_the_row_by_row_oracle(seed, monkeypatch):
    """Random arrays with faults planted at random places, across chunk boundaries (chunks of
    64 rows here), uint8 and int16, every layer or a subset."""
    monkeypatch.setattr(checks, "_CHUNK_ROWS", 64)
    rng = np.random.default_rng(seed)
    dtype, num_experts = [(np.uint8, 128), (np.int16, 300)][seed % 2]
    routes = distinct_routes(rng, 40, 6, 4, num_experts, dtype)
    moe_layers = [None, [2, 3, 4], [1, 3, 6]][seed % 3]
    assert find_route_fault(routes, num_experts, moe_layers) is None
    for _ in range(3):
        row, layer, k = int(rng.integers(40)), int(rng.integers(6)), int(rng.integers(1, 4))
        routes[row, layer, k] = routes[row, layer, k - 1]  # a repeat
    if seed % 2:
        routes[int(rng.integers(40)), int(rng.integers(6)), 0] = -1  # int16 below range
    else:
        routes[int(rng.integers(40)), int(rng.integers(6)), 3] = 200  # uint8 above range
    assert find_route_fault(routes, num_experts, moe_layers) == oracle(
        routes, num_experts, moe_layers
    )
    fixed = np.where((routes < 0) | (routes >= num_experts), 0, routes).astype(dtype)
    assert find_route_fault(fixed, num_experts, moe_layers) == oracle(
        fixed, num_experts, moe_layers
    )


def test_dense_layers_are_not_checked():
    routes = np.zeros((3, 4, 2), dtype=np.uint8)  # SGLang's dense rows: expert 0 twice
    routes[:, [1, 3]] = [3, 5]
    assert find_route_fault(routes, 8, [2, 4]) is None
    assert find_route_fault(routes, 8, None) == RouteFault("repeat", 0, 0)


def _sample(index: int, routes: np.ndarray) -> Sample:
    n = routes.shape[0] + 1
    return Sample(index, index, "", "", [1] * 2, [2] * (n - 2), [-0.5] * (n - 2), [0] * (n - 2),
                  routed_experts=routes)  # fmt: skip


@pytest.mark.parametrize("kind", ["range", "repeat"])
def test_build_names_the_fault_as_the_sample_check_does(kind):
    rng = np.random.default_rng(1)
    samples = [_sample(10 + i, distinct_routes(rng, 5 + i, 4, 2, 8, np.uint8)) for i in range(3)]
    bad = samples[2].routed_experts
    if kind == "range":
        bad[3, 2, 1] = 9
    else:
        bad[3, 2, 1] = bad[3, 2, 0]
    with pytest.raises(ValueError) as want:
        check_sample_routes(samples[2], 4, 2, 8)
    with pytest.raises(ValueError) as got:
        build_micro_batch(samples, [0.0] * 3, pad_token_id=0, routing_shape=(4, 2, 8))
    assert str(got.value) == str(want.value)
    assert str(want.value).startswith("sample 12: routed_experts")
