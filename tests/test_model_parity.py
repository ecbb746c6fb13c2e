"""Megatron-core Qwen3-MoE against transformers on the same checkpoint, and the HF name map."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_sat.checkpoint.hf_io import (
    export_hf_tensors,
    load_hf_into_model,
    read_hf_tensors,
    save_model_as_hf,
)
from megatron_sat.checkpoint.hf_map import hf_to_mcore, merge_qkv, split_qkv
from megatron_sat.models import build_gpt_model, transformer_config_from_hf
from megatron_sat.routing.replay import capture_routing


@pytest.fixture(scope="module")
def mcore_model(megatron_world, tiny_checkpoint, tiny_hf_config):
    config = transformer_config_from_hf(tiny_hf_config)
    model = build_gpt_model(tiny_hf_config, config)
    load_hf_into_model(model, tiny_checkpoint)
    return model.eval()


def _hf_routes(hf_model, ids):
    routes = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out, i=i: routes.__setitem__(i + 1, out[2].detach())
        )
        for i, layer in enumerate(hf_model.model.layers)
    ]
    with torch.no_grad():
        logits = hf_model(ids).logits
    for hook in hooks:
        hook.remove()
    return logits, routes


def test_logits_and_topk_match_transformers(mcore_model, tiny_checkpoint):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (3, 17))
    positions = torch.arange(17).expand(3, 17)
    hf_logits, hf_routes = _hf_routes(hf_model, ids)
    with torch.no_grad(), capture_routing(mcore_model) as used:
        logits = mcore_model(ids, positions, None)
    assert (logits - hf_logits).abs().max().item() <= 1e-4
    for layer, hf_idx in hf_routes.items():
        # HF rows are batch-major [b * S + s]; megatron-core's router sees [s * B + b].
        hf_map = torch.zeros(3 * 17, 8, dtype=torch.bool).scatter_(1, hf_idx, True)
        hf_map = hf_map.reshape(3, 17, 8).transpose(0, 1).reshape(-1, 8)
        assert torch.equal(used[layer], hf_map), f"layer {layer} routes differ"


def test_hf_round_trip_is_bitwise(mcore_model, tiny_checkpoint, tiny_hf_config, tmp_path):
    original = read_hf_tensors(tiny_checkpoint)
    exported = dict(export_hf_tensors(mcore_model, tiny_hf_config))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    out = save_model_as_hf(
        mcore_model, tiny_hf_config, tmp_path / "out", tokenizer_dir=tiny_checkpoint
    )
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, original["lm_head.weight"])
    with pytest.raises(FileExistsError):
        save_model_as_hf(mcore_model, tiny_hf_config, out)


def test_qkv_grouping_by_hand():
    # 4 heads, 2 groups, head_dim 1, hidden 1: rows per group are [q, q, k, v].
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 1, "hidden_size": 1}
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    qkv = merge_qkv(q, k, v, cfg)
    assert qkv.flatten().tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, cfg), (q, k, v), strict=True))


def test_unknown_and_missing_tensors_are_named(mcore_model, tiny_checkpoint, tiny_hf_config):
    tensors = read_hf_tensors(tiny_checkpoint)
    names = [n for n, _ in mcore_model.named_parameters()]
    extra = dict(tensors, **{"model.layers.0.mlp.shared_expert.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers.0.mlp.shared_expert.weight"):
        hf_to_mcore(extra, names, tiny_hf_config)
    missing = {
        k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"
    }
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.3.up_proj.weight"):
        hf_to_mcore(missing, names, tiny_hf_config)
