"""``rollout.engine``: validation, and the RL loop's fleet for ``vllm`` (no server needed: the
fleet only builds clients until its first push)."""

from __future__ import annotations

import pytest

from megatron_sat.config import RolloutConfig, RunConfig
from megatron_sat.rollout.fleet import RolloutFleet
from megatron_sat.rollout.vllm.client import VLLMClient
from megatron_sat.rollout.vllm.fleet import VLLMFleet
from megatron_sat.rollout.vllm.updater import VLLMWeightUpdater, layer_buckets, layer_key
from megatron_sat.training.rl import rollout_fleet


def test_engine_is_validated():
    assert RolloutConfig().engine == "sglang"
    with pytest.raises(ValueError, match="rollout.engine must be sglang or vllm"):
        RolloutConfig(engine="trt")
    with pytest.raises(ValueError, match="rollout.engine=vllm needs rollout.server_urls"):
        RolloutConfig(engine="vllm")


def test_vllm_engine_gives_a_vllm_fleet():
    cfg = RunConfig(rollout=RolloutConfig(engine="vllm", server_urls=["http://127.0.0.1:9"]))
    with rollout_fleet(cfg) as fleet:
        assert type(fleet) is VLLMFleet and fleet.updater_cls is VLLMWeightUpdater
        assert [type(c) for c in fleet.clients] == [VLLMClient]
        assert fleet.clients[0].base_url == "http://127.0.0.1:9"
    assert RolloutFleet.updater_cls is not VLLMWeightUpdater


def test_buckets_hold_whole_layers():
    import torch

    names = [
        "model.embed_tokens.weight",
        "model.layers.0.a.weight",
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.1.a.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert [layer_key(n) for n in names] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    tensors = [(n, torch.zeros(4)) for n in names]  # 16 bytes each
    buckets = [[n for n, _ in b] for b in layer_buckets(tensors, bucket_bytes=40)]
    # Layer 0 (32 bytes) never splits; a bucket closes before a layer that would overflow it.
    assert buckets == [names[:1], names[1:3], names[3:5], names[5:]]
    assert [n for b in buckets for n in b] == names


def test_rollout_dtype_with_server_urls_is_refused_not_ignored():
    # rollout.dtype is the embedded servers' --dtype; servers given by URL keep theirs
    assert RolloutConfig(server_urls=["http://127.0.0.1:9"]).dtype == "float32"
    with pytest.raises(ValueError, match=r"rollout\.dtype='bfloat16' applies to embedded"):
        RolloutConfig(dtype="bfloat16", server_urls=["http://127.0.0.1:9"])
    assert RolloutConfig(dtype="bfloat16").dtype == "bfloat16"
