"""The layer spec and fusions follow what imports (``platform.fusions``), for every state of
transformer-engine, apex and grouped_gemm: present, absent, broken (stub modules,
``tests/import_stubs.py``). The model path itself runs in fresh processes
(``tests/stubbed_build.py``) because megatron-core decides at import time what TE and apex give.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from import_stubs import StubFinder

from megatron_sat.platform import fusions as fusions_module
from megatron_sat.platform.fusions import (
    BrokenInstallError,
    decide_fusions,
    probe_apex_wgrad,
    probe_transformer_engine,
)

STATES = ("present", "absent", "broken")


def _states(te: str, apex: str, grouped_gemm: str) -> dict[str, str]:
    apex_top = "present" if apex == "broken" else apex  # apex imports, its CUDA extension not
    broken = {
        "transformer_engine": "broken:OSError",
        "fused_weight_gradient_mlp_cuda": "broken:ImportError",
    }
    return {
        "transformer_engine": broken["transformer_engine"] if te == "broken" else te,
        "apex": apex_top,
        "fused_weight_gradient_mlp_cuda": (
            broken["fused_weight_gradient_mlp_cuda"] if apex == "broken" else apex
        ),
        "grouped_gemm": grouped_gemm,
    }


@pytest.fixture
def stubs():
    """Install a StubFinder for the test; removed (with what it served) afterwards."""
    installed: list[StubFinder] = []

    def install(states: dict[str, str], **kwargs) -> StubFinder:
        finder = StubFinder(states, **kwargs).install()
        installed.append(finder)
        return finder

    yield install
    for finder in installed:
        finder.uninstall()


def test_probes_tell_present_absent_and_broken(stubs):
    stubs(_states("present", "present", "absent"))
    te, apex = probe_transformer_engine(), probe_apex_wgrad()
    assert (te.state, te.detail, apex.state) == ("present", "2.20.2", "present")

    stubs(_states("absent", "absent", "absent"))
    te, apex = probe_transformer_engine(), probe_apex_wgrad()
    assert (te.state, apex.state) == ("absent", "absent")
    assert "No module named 'transformer_engine'" in te.detail

    stubs(_states("broken", "broken", "absent"))
    te, apex = probe_transformer_engine(), probe_apex_wgrad()
    assert (te.state, apex.state) == ("broken", "broken")
    assert te.detail.startswith("OSError: libcudart.so.12")
    assert apex.detail.startswith("ImportError: fused_weight_gradient_mlp_cuda: undefined symbol")


def test_te_without_its_torch_extension_or_too_old_is_broken(stubs):
    # TE's core wheel without transformer_engine_torch: the import fails on *another* module.
    stubs({"transformer_engine": "broken:ModuleNotFoundError"})
    probe = probe_transformer_engine()
    assert probe.state == "broken" and "transformer_engine_torch" in probe.detail
    stubs({"transformer_engine": "present"}, te_version="2.5.0")
    probe = probe_transformer_engine()
    assert probe.state == "broken"
    assert probe.detail == "version 2.5.0 is older than the 2.6 megatron-sat needs"


@pytest.mark.parametrize("te,apex,grouped_gemm", list(itertools.product(STATES, repeat=3)))
def test_decision_for_every_combination(stubs, te, apex, grouped_gemm):
    finder = stubs(_states(te, apex, grouped_gemm))
    probes = probe_transformer_engine(), probe_apex_wgrad()
    for device in ("cuda", "cpu"):
        if "broken" in (te, apex):
            with pytest.raises(BrokenInstallError) as err:
                decide_fusions(device, *probes)
            message = str(err.value)
            named = {
                "transformer_engine[pytorch] is installed": te == "broken",
                "apex (built with --cuda_ext) is installed": apex == "broken",
            }
            assert {k: k in message for k in named} == named
            assert "docs/gpu.md" in message
            continue
        got = decide_fusions(device, *probes)
        cuda = device == "cuda"
        want_te, want_wgrad = cuda and te == "present", cuda and apex == "present"
        assert (got.transformer_engine, got.apply_rope_fusion) == (want_te, want_te)
        assert (got.moe_grouped_gemm, got.moe_permute_fusion) == (want_te, want_te)
        assert got.gradient_accumulation_fusion == want_wgrad
        assert got.bias_activation_fusion == got.masked_softmax_fusion == cuda
        fields = got.transformer_config_fields()
        assert fields["transformer_impl"] == ("transformer_engine" if want_te else "local")
        assert fields["use_cpu_initialization"] is not cuda
        assert fields["moe_router_fusion"] is False  # its fused top-k skips RouterReplay
        off = dict(got.off)
        assert set(off) == {f for f in fusions_module._CHOICES if not getattr(got, f)}
        if cuda and apex == "absent":
            assert off["gradient_accumulation_fusion"].startswith(
                "apex's fused_weight_gradient_mlp_cuda does not import"
            )
        if not cuda:
            assert set(off.values()) == {"no CUDA"}
    # megatron-core 0.19 has no use for grouped_gemm: nothing imports it, whatever its state.
    assert not [n for n in finder.requested if n.startswith("grouped_gemm")]


def test_broken_install_is_refused_at_startup(stubs):
    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed

    stubs(_states("broken", "absent", "absent"))
    fusions_module._decided.cache_clear()
    try:
        with pytest.raises(BrokenInstallError, match=r"transformer_engine\[pytorch\] is installed"):
            init_distributed(ParallelConfig())
    finally:
        fusions_module._decided.cache_clear()  # the next test probes this machine again


def test_summary_is_printed_once_with_each_reason(stubs, capsys, monkeypatch):
    stubs(_states("present", "absent", "absent"))
    decision = decide_fusions("cuda", probe_transformer_engine(), probe_apex_wgrad())
    monkeypatch.setattr(fusions_module, "_announced", set())
    assert fusions_module.announce_fusions(decision, rank=1) is False
    assert fusions_module.announce_fusions(decision) is True
    assert fusions_module.announce_fusions(decision) is False
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "megatron-sat: layer spec and fusions on cuda:"
    assert lines[1:5] == [
        "  transformer_engine: on",
        "  apply_rope_fusion: on",
        "  moe_grouped_gemm: on",
        "  moe_permute_fusion: on",
    ]
    assert lines[5].startswith(
        "  gradient_accumulation_fusion: off (apex's fused_weight_gradient_mlp_cuda does not "
        "import (the output layer, megatron-core's ColumnParallelLinear, needs it): "
        "ModuleNotFoundError"
    )
    assert len(lines) == 9


def test_this_machine_takes_the_local_spec_without_fusions():
    if torch.cuda.is_available():
        pytest.skip("CPU decision")
    got = fusions_module.device_fusions()
    assert got.device_type == "cpu" and not got.transformer_engine
    assert got.transformer_config_fields()["transformer_impl"] == "local"


def test_tensor_parallel_on_cuda_without_te_is_refused_naming_it(stubs):
    from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS
    from megatron_sat.models import transformer_config_from_hf

    stubs(_states("absent", "present", "absent"))
    decision = decide_fusions("cuda", probe_transformer_engine(), probe_apex_wgrad())
    hf = dict(TINY_CONFIGS["Qwen3MoeForCausalLM"], architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 on CUDA needs") as err:
        transformer_config_from_hf(hf, tensor_model_parallel_size=2, fusions=decision)
    assert "transformer_engine[pytorch]" in str(err.value)
    assert "No module named 'transformer_engine'" in str(err.value)


def test_local_final_norm_is_torch_rms_even_when_apex_imports():
    # megatron-core gives the local spec's final norm apex's FusedLayerNorm whenever apex
    # imports, which refuses RMSNorm (found by the apex-present / TE-absent build above).
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_sat.models.registry import torch_rms_final_norm

    spec = torch_rms_final_norm(
        TransformerBlockSubmodules(layer_specs=[], layer_norm=FusedLayerNorm)
    )
    assert spec.layer_norm is WrappedTorchNorm
    kept = TransformerBlockSubmodules(layer_specs=[], layer_norm=WrappedTorchNorm)
    assert torch_rms_final_norm(kept).layer_norm is WrappedTorchNorm
