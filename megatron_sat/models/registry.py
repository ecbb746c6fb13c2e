"""Architecture registry: the HF ``architectures`` name picks the model family.

Each family is one small module (``qwen3_moe``, ``mixtral``, ``qwen2_moe``, ``deepseek_v3``)
with a ``transformer_config(hf_config, layout, **overrides)`` that derives megatron-core's
``TransformerConfig`` from ``config.json``. The checkpoint name maps are chosen by the same name
(:mod:`megatron_sat.checkpoint.archs`). This module holds what the families share: the layout
(:class:`ModelLayout`), the parallel/CPU fields of the config, the one public
:func:`transformer_config_from_hf` and the ``GPTModel`` builder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_sat.platform.fusions import DeviceFusions, device_fusions

# HF architectures name -> module of megatron_sat.models that derives its TransformerConfig.
ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def architecture_of(hf_config: Mapping[str, Any]) -> str:
    """The one supported HF architecture name listed in ``config.json``'s ``architectures``.

    Raises:
        ValueError: when none, or more than one, of the listed names is supported.
    """
    archs = list(hf_config.get("architectures") or [])
    known = [a for a in archs if a in ARCHITECTURES]
    if len(known) != 1:
        raise ValueError(
            f"config.json architectures={archs}: expected exactly one of {sorted(ARCHITECTURES)}"
        )
    return known[0]


def family_module(hf_config: Mapping[str, Any]):
    """The ``megatron_sat.models.<family>`` module for ``hf_config`` (see :data:`ARCHITECTURES`)."""
    return importlib.import_module(
        f"megatron_sat.models.{ARCHITECTURES[architecture_of(hf_config)]}"
    )


@dataclass(frozen=True)
class ModelLayout:
    """How a model is split over ranks and run: the non-architecture ``TransformerConfig`` fields.

    Attributes:
        tensor_model_parallel_size, expert_model_parallel_size, pipeline_model_parallel_size:
            Megatron parallel sizes; sequence parallelism is switched on whenever TP > 1 (MoE
            requires it).
        expert_tensor_parallel_size: TP degree of the experts (None: megatron-core's default,
            the TP size; 1 lets TP2 x EP2 run on 2 ranks).
        params_dtype: parameter dtype (``train.params_dtype``: bfloat16 by default on CUDA,
            float32 on the CPU). Routers compute in float32 either way (``moe_router_dtype``).
        moe_token_dispatcher_type: ``alltoall`` or ``allgather``.
        moe_enable_routing_replay: give every router a megatron-core ``RouterReplay`` (R3).
        recompute_granularity: None, ``full`` or ``selective`` (megatron-core's activation
            recompute; R3 replays the same routes in the recomputed forward,
            ``routing.replay``).
        recompute_num_layers: layers per recomputed chunk under ``full`` (uniform method).
        fusions: the layer spec and fusions (``platform.fusions``); None: this process's,
            ``device_fusions()`` (a test passes another machine's decision).
    """

    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    params_dtype: torch.dtype = torch.float32
    moe_token_dispatcher_type: str = "alltoall"
    moe_enable_routing_replay: bool = True
    recompute_granularity: str | None = None
    recompute_num_layers: int = 1
    fusions: DeviceFusions | None = None


_LAYOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelLayout))


def transformer_config_from_hf(
    hf_config: Mapping[str, Any], layout: ModelLayout | None = None, **kwargs: Any
):
    """The one place that derives megatron-core's ``TransformerConfig`` from ``config.json``.

    The family (by ``architectures``) supplies the architecture fields; ``layout`` and any
    :class:`ModelLayout` field given by keyword (e.g. ``tensor_model_parallel_size=2``) the
    layout; the remaining keywords are further ``TransformerConfig`` fields, applied last.

    Raises:
        ValueError: for an unsupported architecture or a config value the family cannot map
            (named).
    """
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAYOUT_FIELDS}
    layout = dataclasses.replace(layout or ModelLayout(), **given)
    return family_module(hf_config).transformer_config(hf_config, layout, **kwargs)


def hf_rope_theta(hf_config: Mapping[str, Any]) -> float:
    """RoPE base from ``rope_parameters.rope_theta`` (transformers 5) or top-level ``rope_theta``.

    Raises:
        ValueError: when neither is present, or the RoPE type is not ``default`` (scaled RoPE
            variants are not mapped yet).
    """
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported (only default)")
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def build_gpt_model(hf_config: Mapping[str, Any], config, **kwargs: Any):
    """Build this rank's megatron-core ``GPTModel`` for ``hf_config`` (dispatch by architecture).

    A family with its own layer spec defines ``build_gpt_model`` (DeepSeek-V3's MLA); the others
    use :func:`build_generic_gpt_model`. Model-parallel state must be initialised.
    """
    module = family_module(hf_config)
    builder = getattr(module, "build_gpt_model", build_generic_gpt_model)
    with _tensor_cuda_is_identity_on_cpu():
        return builder(hf_config, config, **kwargs)


@contextlib.contextmanager
def _tensor_cuda_is_identity_on_cpu():
    """While a model is built on a machine without CUDA, ``Tensor.cuda()`` returns the tensor.

    megatron-core 0.19.2's ``LanguageModule.setup_embeddings_and_output_layer`` runs
    ``weight.data = weight.data.cuda()`` before all-reducing the tied embedding between the
    first and the last pipeline stage (tied embeddings at PP > 1), which raises "Torch not
    compiled with CUDA enabled" on the CPU. Scoped to model construction; nothing is patched
    when CUDA is available. (Belongs with the CPU shims of :mod:`megatron_sat.platform`.)
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def torch_rms_final_norm(block_spec):
    """The local block spec with its final norm made megatron-core's ``WrappedTorchNorm``
    (torch's RMSNorm) where megatron-core put apex's ``FusedLayerNorm`` (returns the spec).

    megatron-core 0.19.2's ``get_gpt_decoder_block_spec`` gives the local spec's final norm
    ``gpt_layer_specs.LNImpl``, which is ``FusedLayerNorm`` whenever ``import apex`` succeeds,
    and ``FusedLayerNorm`` asserts "(RMSNorm) is not supported in FusedLayerNorm"; the per-layer
    norms are already torch's (``LocalSpecProvider.layer_norm(rms_norm=True)``). So a CUDA
    machine with apex and without transformer-engine could not build any model here (every
    family is RMSNorm). Without apex the final norm is ``WrappedTorchNorm`` already: unchanged.
    """
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if block_spec.layer_norm is FusedLayerNorm:
        block_spec.layer_norm = WrappedTorchNorm
    return block_spec


def keep_router_fp32(model: torch.nn.Module) -> list[str]:
    """Make every MoE router's weight (and bias) and its ``expert_bias`` / token-count buffers
    float32 in place, whatever ``params_dtype`` the model was built with; returns the names of
    the tensors it converted.

    megatron-core builds the router weight in ``params_dtype`` and only computes in
    ``moe_router_dtype``; generic casts (``Float16Module``, ``module.bfloat16()``) would also
    turn ``expert_bias`` bf16, where DeepSeek-V3's bias updates of ~1e-3 round away. The
    mixed-precision optimizer keeps float32 parameters as their own main parameters, so the
    router is then trained and exported in float32. Call before the DDP wrapper is built (it
    buckets parameters by dtype).
    """
    from megatron.core.transformer.moe.router import Router

    converted = []
    for name, module in model.named_modules():
        if not isinstance(module, Router):
            continue
        for attr in ("weight", "bias", "expert_bias", "local_tokens_per_expert"):
            tensor = getattr(module, attr, None)
            if torch.is_tensor(tensor) and tensor.dtype != torch.float32:
                tensor.data = tensor.data.float()
                converted.append(f"{name}.{attr}")
    return converted


def require(hf_config: Mapping[str, Any], key: str) -> Any:
    """``hf_config[key]``; raises ``ValueError`` naming the key when it is absent or null."""
    value = hf_config.get(key)
    if value is None:
        raise ValueError(f"config.json has no {key!r}")
    return value


def common_transformer_kwargs(hf_config: Mapping[str, Any], layout: ModelLayout) -> dict[str, Any]:
    """``TransformerConfig`` fields shared by every family: sizes, norms, SwiGLU, the layout,
    the device's settings (CPU initialisation, layer spec and fusions:
    ``platform.fusions.DeviceFusions``), routers in float32, no aux loss, dropout from
    config.json. ``pipeline_dtype`` is the parameter dtype when PP > 1.

    Raises:
        ValueError: for ``hidden_act`` other than ``silu``, a vocabulary that does not split
            evenly over the tensor-parallel ranks (megatron-core does not pad it here), or
            TP > 1 on CUDA without transformer-engine (naming the package).
    """
    tp = layout.tensor_model_parallel_size
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}: only silu (SwiGLU) is mapped")
    vocab = int(require(hf_config, "vocab_size"))
    if vocab % tp:
        raise ValueError(f"vocab_size={vocab} is not divisible by tensor_model_parallel_size={tp}")
    fusions = layout.fusions or device_fusions()
    if tp > 1 and fusions.device_type == "cuda" and not fusions.transformer_engine:
        # MoE needs sequence parallelism at TP > 1, and the local spec's norm
        # (megatron-core's WrappedTorchNorm) asserts it off; on the CPU a shim lifts that
        # (platform.device._patch_torch_norm_sequence_parallel), on CUDA TE's norms are the way.
        raise ValueError(
            f"tensor_model_parallel_size={tp} on CUDA needs transformer-engine (megatron-core's "
            "local norm refuses sequence parallelism), but transformer_engine.pytorch does not "
            f"import ({dict(fusions.off)['transformer_engine']}): install "
            "transformer_engine[pytorch] as docs/gpu.md says, or use tensor_model_parallel_size=1"
        )
    num_heads = int(require(hf_config, "num_attention_heads"))
    hidden = int(require(hf_config, "hidden_size"))
    kwargs: dict[str, Any] = dict(
        num_layers=int(require(hf_config, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=num_heads,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(hf_config.get("attention_dropout") or 0.0),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=layout.moe_token_dispatcher_type,
        moe_enable_routing_replay=layout.moe_enable_routing_replay,
        params_dtype=layout.params_dtype,
        bf16=layout.params_dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        sequence_parallel=tp > 1,
        # Router logits, scores and top-k in float32 whatever params_dtype is: bf16 router
        # logits tie and flip experts (the train-rollout mismatch R3 exists to remove).
        moe_router_dtype="fp32",
        # CPU initialisation on the CPU (TP runs bit-identical to TP=1); the spec
        # (transformer_impl) and each fusion by what imports (platform.fusions).
        **fusions.transformer_config_fields(),
    )
    if layout.pipeline_model_parallel_size > 1:
        kwargs["pipeline_dtype"] = layout.params_dtype
    if layout.expert_tensor_parallel_size is not None:
        kwargs["expert_tensor_parallel_size"] = layout.expert_tensor_parallel_size
    if layout.recompute_granularity is not None:
        kwargs["recompute_granularity"] = layout.recompute_granularity
        if layout.recompute_granularity == "full":
            kwargs.update(
                recompute_method="uniform", recompute_num_layers=layout.recompute_num_layers
            )
    return kwargs


def moe_layer_freq(pattern: list[int]) -> list[int] | int:
    """megatron-core's ``moe_layer_freq`` for a per-layer MoE pattern (1 = MoE, 0 = dense):
    the integer 1 when every layer is MoE, else the list itself."""
    return 1 if all(pattern) else list(pattern)


def build_generic_gpt_model(
    hf_config: Mapping[str, Any],
    config,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    use_transformer_engine: bool | None = None,
    spec_hook: Callable[[Any, bool], Any] | None = None,
):
    """A megatron-core ``GPTModel`` for any registered family on this rank.

    The transformer-engine layer spec when the config says so (``transformer_impl``, set by
    ``platform.fusions``: CUDA and TE imports; with TE also grouped-GEMM experts,
    ``TEGroupedMLP``, when ``moe_grouped_gemm``), the local spec otherwise;
    ``spec_hook(block_spec, use_transformer_engine)`` may return an adjusted block
    spec (the family's extension point). RoPE's base comes from config.json
    (:func:`hf_rope_theta`; MLA reads ``config.rotary_base``).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if use_transformer_engine is None:
        use_transformer_engine = config.transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, normalization="RMSNorm"
    )
    if not use_transformer_engine:
        spec = torch_rms_final_norm(spec)
    if spec_hook is not None:
        spec = spec_hook(spec, use_transformer_engine)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=int(hf_config["vocab_size"]),
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=hf_rope_theta(hf_config),
    )
