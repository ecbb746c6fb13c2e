"""megatron-core against transformers on the same checkpoint, for every architecture (Qwen3-MoE,
Mixtral, Qwen2-MoE, DeepSeek-V3), single rank: logits, bitwise HF round trip, in-memory and TE
names, errors naming tensors, shard layouts by hand. Sharded layouts: test_checkpoint_parallel."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_sat.checkpoint.hf_io import (
    export_hf_tensors,
    load_hf_into_model,
    read_hf_config,
    read_hf_tensors,
    save_model_as_hf,
)
from megatron_sat.checkpoint.hf_map import (
    canonical_mcore_name,
    hf_to_mcore,
    mcore_to_hf,
    merge_qkv,
    split_qkv,
)
from megatron_sat.checkpoint.sharding import join_tp, load_hf_tensors, split_tp
from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS, make_tiny_hf_model
from megatron_sat.models import build_gpt_model, hf_rope_theta, transformer_config_from_hf
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


# -- every architecture: Qwen3-MoE, Mixtral (tied), Qwen2-MoE, DeepSeek-V3 ----------------------

ARCHS = sorted(TINY_CONFIGS)


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, megatron_world, tmp_path_factory):
    """(architecture, HF model, checkpoint dir, megatron-core model loaded from it)."""
    arch = request.param
    hf_model = make_tiny_hf_model(arch, seed=3)
    path = tmp_path_factory.mktemp(arch)
    hf_model.save_pretrained(path)
    hf_config = read_hf_config(path)
    model = build_gpt_model(
        hf_config, transformer_config_from_hf(hf_config, moe_enable_routing_replay=False)
    )
    load_hf_into_model(model, path)
    return arch, hf_model, path, model.eval()


def test_every_architecture_matches_transformers_logits(arch_case):
    arch, hf_model, _, model = arch_case
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (3, 13))
    with torch.no_grad():
        expected = hf_model(ids).logits
        logits = model(ids, torch.arange(13).expand(3, 13), None)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4, arch


def test_every_architecture_round_trips_bitwise(arch_case, tmp_path):
    arch, hf_model, path, model = arch_case
    hf_config = read_hf_config(path)
    original = read_hf_tensors(path)
    exported = dict(export_hf_tensors(model, hf_config))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    # The written checkpoint (shards + index) loads in transformers and gives its logits.
    out = save_model_as_hf(model, hf_config, tmp_path / "out", max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


def test_transformers_in_memory_names_are_accepted(arch_case):
    """A transformers ``state_dict()`` (fused experts [E, 2I, H], Mixtral's ``.mlp.``) loads
    to the same weights as the on-disk checkpoint."""
    arch, hf_model, path, model = arch_case
    hf_config = read_hf_config(path)
    in_memory = hf_model.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in in_memory)
    twin = build_gpt_model(hf_config, transformer_config_from_hf(hf_config))
    load_hf_tensors(twin, in_memory, hf_config)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), twin.state_dict().items(), strict=True
    ):
        if not name.endswith("_extra_state"):
            assert torch.equal(a, b), name


def test_transformer_engine_names_map_like_local_names(arch_case):
    arch, _, path, model = arch_case
    hf_config = read_hf_config(path)
    renames = [
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
        (
            "self_attention.kv_layernorm.weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight",
        ),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ]

    def te_name(name: str) -> str:
        for local, te in renames:
            if name.endswith(local):
                return name[: -len(local)] + te
        m = re.fullmatch(r"(.*)mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", name)
        return f"{m[1]}mlp.experts.{m[3]}.weight{m[2]}" if m else name

    local = {n: t for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    te = {"module." + te_name(n): t for n, t in local.items()}
    assert te.keys() != {"module." + n for n in local}
    assert {canonical_mcore_name(n) for n in te} == set(local)
    assert dict(mcore_to_hf(te, hf_config)).keys() == dict(mcore_to_hf(local, hf_config)).keys()


def test_load_names_missing_extra_and_misshaped_tensors(arch_case):
    arch, _, path, model = arch_case
    hf_config = read_hf_config(path)
    tensors = read_hf_tensors(path)
    victim = sorted(k for k in tensors if ".experts.1." in k)[0]
    missing = {k: v for k, v in tensors.items() if k != victim}
    with pytest.raises(ValueError, match=re.escape(f"missing ['{victim}']")):
        load_hf_tensors(model, missing, hf_config)
    extra = dict(tensors, **{"model.layers.0.mlp.mystery.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=re.escape("unused ['model.layers.0.mlp.mystery.weight']")):
        load_hf_tensors(model, extra, hf_config)
    wrong = dict(tensors, **{"model.norm.weight": torch.ones(31)})
    with pytest.raises(ValueError, match=r"mis-shaped \['model.norm.weight'\]"):
        load_hf_tensors(model, wrong, hf_config)
    load_hf_tensors(model, tensors, hf_config)  # and the model is intact again


def test_tied_checkpoint_with_a_different_lm_head_is_refused(megatron_world):
    arch = "MixtralForCausalLM"
    hf_model = make_tiny_hf_model(arch)
    hf_config = hf_model.config.to_dict()
    assert hf_config["tie_word_embeddings"]
    model = build_gpt_model(hf_config, transformer_config_from_hf(hf_config))
    tensors = {k: v.clone() for k, v in hf_model.state_dict().items()}
    assert "model.embed_tokens.weight" in dict(export_hf_tensors(model, hf_config))
    assert "lm_head.weight" not in dict(export_hf_tensors(model, hf_config))
    tensors["lm_head.weight"] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_hf_tensors(model, tensors, hf_config)


def test_qkv_bias_grouping_by_hand():
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 1, "hidden_size": 1}
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    assert merge_qkv(q, k, v, cfg).tolist() == [0.0, 1, 10, 20, 2, 3, 11, 21]


def test_glu_tensor_parallel_shards_by_hand():
    # fc1 = [gate; up] with gate rows g0..g3, up rows u0..u3; TP2 rank r holds [g(2r..); u(2r..)].
    full = torch.tensor([[0.0], [1], [2], [3], [10], [11], [12], [13]])
    shards = [split_tp(full, 0, True, r, 2) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    assert torch.equal(join_tp(shards, 0, True), full)
    assert split_tp(full, 0, False, 1, 2).flatten().tolist() == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="does not split"):
        split_tp(full, 0, False, 0, 3)


def test_architecture_choice_and_config_refusals():
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        transformer_config_from_hf({"architectures": ["LlamaForCausalLM"]})
    base = make_tiny_hf_model("DeepseekV3ForCausalLM").config.to_dict()
    with pytest.raises(ValueError, match="rope_interleave"):
        transformer_config_from_hf(dict(base, rope_interleave=False))
    with pytest.raises(ValueError, match="topk_group"):
        transformer_config_from_hf(dict(base, topk_group=1))
    mixtral = make_tiny_hf_model("MixtralForCausalLM").config.to_dict()
    with pytest.raises(ValueError, match="sliding_window"):
        transformer_config_from_hf(dict(mixtral, sliding_window=16))


def test_rope_theta_nested_or_top_level():
    base = make_tiny_hf_model("DeepseekV3ForCausalLM").config.to_dict()
    nested = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    top = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 5e5}
    assert hf_rope_theta(nested) == hf_rope_theta(top) == 5e5
    assert transformer_config_from_hf(nested).rotary_base == 5e5
    assert transformer_config_from_hf(top).rotary_base == 5e5


@pytest.mark.parametrize("arch_case", ["DeepseekV3ForCausalLM"], indirect=True)
def test_deepseek_router_is_sigmoid_with_fp32_expert_bias(arch_case):
    arch, hf_model, path, model = arch_case
    assert arch == "DeepseekV3ForCausalLM"
    router = model.decoder.layers[1].mlp.router
    assert model.config.moe_router_score_function == "sigmoid"
    assert router.expert_bias.dtype == torch.float32
    expected = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(router.expert_bias, expected)
    assert not hasattr(model.decoder.layers[0].mlp, "router")  # first-k dense layer
