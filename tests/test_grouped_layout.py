"""The grouped-GEMM expert layout (transformer-engine's ``TEGroupedMLP``, on with TE by
``platform.fusions``) through the HF name map, the loader, the exporter and the weight push.

A CPU cannot build ``TEGroupedMLP`` (its ``GroupedLinear`` is TE's CUDA module), so the tests
put in its place a module with exactly the parameters it holds, taken from the sources:
megatron-core 0.19.2 ``transformer/moe/experts.py`` (``TEGroupedMLP``: ``linear_fc1`` a
column-parallel grouped linear hidden -> 2 * ffn for the gated unit, ``linear_fc2`` a
row-parallel one ffn -> hidden, one GEMM per local expert); transformer-engine 2.x
``pytorch/module/grouped_linear.py`` (``GroupedLinear`` registers ``weight{i}`` of shape
[out_features, in_features], per TP rank); megatron-core's own
``extensions/transformer_engine._set_expert_parameter_attributes`` (called here as it is) for
the ``tensor_model_parallel`` / ``partition_dim`` / ``allreduce`` marks the sharding code reads;
and an ``_extra_state`` entry per linear, as every TE module has in its state dict. Everything
but the kernels runs for real: names, shapes, TP marks, load, export, push.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sat.checkpoint.hf_io import read_hf_tensors
from megatron_sat.checkpoint.hf_map import NameMap, canonical_mcore_name, hf_to_mcore, mcore_to_hf
from megatron_sat.checkpoint.sharding import export_hf_tensors, load_hf_tensors, local_tensors
from megatron_sat.models import build_gpt_model, transformer_config_from_hf
from megatron_sat.models.qwen3_moe import num_experts_of
from megatron_sat.weight_sync.megatron_push import push_megatron_weights


class GroupedLinearStandIn(torch.nn.Module):
    """The parameters of megatron-core's ``TE{Column,Row}ParallelGroupedLinear`` (see module
    docstring): ``weight0..weight{num_gemms-1}``, each [out, in] of this TP rank."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, mode: str) -> None:
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes

        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.full((out_features, in_features), float("nan")))
            self.register_parameter(f"weight{i}", weight)
        _set_expert_parameter_attributes(self, mode, use_expert_pgs=False)

    def get_extra_state(self):  # TE's fp8 metadata slot: present in every TE state dict
        return None

    def set_extra_state(self, state) -> None:
        pass


class GroupedMLPStandIn(torch.nn.Module):
    def __init__(self, num_local_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = GroupedLinearStandIn(num_local_experts, hidden, 2 * ffn, "column")
        self.linear_fc2 = GroupedLinearStandIn(num_local_experts, ffn, hidden, "row")


def to_grouped_layout(model: torch.nn.Module) -> int:
    """Swap every MoE layer's ``SequentialMLP`` for the grouped stand-in (weights NaN until
    loaded); returns the number of layers swapped."""
    swapped = 0
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        config = layer.mlp.config
        layer.mlp.experts = GroupedMLPStandIn(
            len(layer.mlp.local_expert_indices), config.hidden_size, config.moe_ffn_hidden_size
        )
        swapped += 1
    return swapped


@pytest.fixture(scope="module")
def models(megatron_world, tiny_checkpoint, tiny_hf_config):
    """(sequential, grouped) models of the tiny checkpoint: the grouped one loaded through the
    grouped names, the sequential one as every CPU run loads it."""
    config = transformer_config_from_hf(tiny_hf_config)
    sequential = build_gpt_model(tiny_hf_config, config).eval()
    grouped = build_gpt_model(tiny_hf_config, config).eval()
    assert to_grouped_layout(grouped) == tiny_hf_config["num_hidden_layers"]
    hf = read_hf_tensors(tiny_checkpoint)
    load_hf_tensors(sequential, hf, tiny_hf_config)
    load_hf_tensors(grouped, hf, tiny_hf_config)
    return sequential, grouped, hf


def test_grouped_names_map_to_the_per_expert_hf_names(tiny_hf_config):
    canonical = canonical_mcore_name("module.decoder.layers.1.mlp.experts.linear_fc1.weight3")
    assert canonical == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    names = NameMap(tiny_hf_config)
    assert names.rule_for(canonical)[1] == [
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    ]
    fc2 = canonical_mcore_name("decoder.layers.0.mlp.experts.linear_fc2.weight7")
    assert names.rule_for(fc2)[1] == ["model.layers.0.mlp.experts.7.down_proj.weight"]


def test_grouped_shards_have_the_sequential_shapes_and_tp_marks(models, tiny_hf_config):
    sequential, grouped, _ = models
    hidden, ffn = tiny_hf_config["hidden_size"], tiny_hf_config["moe_intermediate_size"]
    seq = {u.canonical: u for u in local_tensors(sequential)}
    grp = {u.canonical: u for u in local_tensors(grouped)}
    assert seq.keys() == grp.keys()  # _extra_state skipped, every weight under its HF twin
    experts = [k for k in grp if ".local_experts." in k]
    num_experts = num_experts_of(tiny_hf_config)
    assert len(experts) == tiny_hf_config["num_hidden_layers"] * num_experts * 2  # fc1, fc2
    for key in experts:
        g, s = grp[key], seq[key]
        fc1 = key.endswith("linear_fc1.weight")
        assert tuple(g.tensor.shape) == ((2 * ffn, hidden) if fc1 else (hidden, ffn))
        assert tuple(g.tensor.shape) == tuple(s.tensor.shape)
        assert (g.tp_dim, g.glu, g.expert) == (0 if fc1 else 1, fc1, True)
        assert (g.tp_dim, g.glu, g.expert, g.num_local_experts) == (
            s.tp_dim,
            s.glu,
            s.expert,
            s.num_local_experts,
        )
    assert any(k.endswith("_extra_state") for k in grouped.state_dict())


def test_hf_grouped_hf_round_trip_is_bitwise(models, tiny_hf_config):
    _, grouped, hf = models
    exported = dict(export_hf_tensors(grouped, tiny_hf_config))
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
    # The full-tensor map that checkpoint/convert.py uses, on the grouped state dict's names.
    names = [n for n in grouped.state_dict() if not n.endswith("_extra_state")]
    mcore = hf_to_mcore(hf, names, tiny_hf_config)
    assert mcore["decoder.layers.0.mlp.experts.linear_fc1.weight2"].shape == (32, 32)
    assert torch.equal(
        mcore["decoder.layers.0.mlp.experts.linear_fc1.weight2"],
        torch.cat(
            [
                hf["model.layers.0.mlp.experts.2.gate_proj.weight"],
                hf["model.layers.0.mlp.experts.2.up_proj.weight"],
            ]
        ),
    )
    back = dict(mcore_to_hf(mcore, tiny_hf_config))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


class RecordingUpdater:
    """The updater interface ``push_megatron_weights`` drives, recording what it is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, torch.Tensor]] = []

    def update(self, named_tensors, weight_version: str):
        self.sent = [(name, tensor.clone()) for name, tensor in named_tensors]
        self.version = weight_version
        return None


def test_weight_push_sends_the_same_hf_tensors_from_both_layouts(models, tiny_hf_config):
    sequential, grouped, _ = models
    pushed = {}
    for name, model in (("sequential", sequential), ("grouped", grouped)):
        updater = RecordingUpdater()
        push_megatron_weights(model, tiny_hf_config, updater, weight_version="v1")
        pushed[name] = updater.sent
    seq, grp = dict(pushed["sequential"]), dict(pushed["grouped"])
    assert len(grp) == len(pushed["grouped"])  # no name twice
    assert seq.keys() == grp.keys()
    assert all(torch.equal(seq[k], grp[k]) and seq[k].dtype == grp[k].dtype for k in seq)

    # Layers stay contiguous in the push order (the vLLM updater's buckets are whole layers).
    def layer_runs(order):
        layers = [n.split(".")[2] for n, _ in order if n.startswith("model.layers.")]
        return [x for i, x in enumerate(layers) if i == 0 or layers[i - 1] != x]

    assert layer_runs(pushed["grouped"]) == layer_runs(pushed["sequential"]) == ["0", "1"]
