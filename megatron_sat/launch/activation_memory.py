"""Activation bytes one trainer rank holds for backward: per decoder layer by recompute
granularity, per micro-batch for the logits and the loss (pure functions, no torch).

Every figure is a sum of named tensors that autograd keeps alive between a micro-batch's
forward and its backward, counted as distinct storages (a view costs the storage it keeps
alive), for megatron-core 0.19's ``TransformerLayer`` with a ``MoELayer`` (alltoall token
dispatcher, R3 ``RouterReplay``) or a dense ``MLP``. The basis is Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, Table 2),
the formula of Megatron-LM's ``megatron/training/theoretical_memory_usage.py``
(``sbh (18 + 4 ffn / h)`` per layer under selective recompute and SP), extended here to GQA,
QK-norm, top-k experts and the two kernel sets a run builds:

- ``"local"``: megatron-core's local spec, as built without CUDA or transformer-engine (the
  CPU path): torch RMSNorm upcasting to float32 (it keeps the float32 input and the
  normalised float32 output), unfused RoPE (cos / sin per layer), unfused core attention
  (query, GQA-expanded key and value, float32 softmax and bf16 probabilities, [s, s] per head),
  unfused SwiGLU (``glu`` of ``transformer/mlp.py``: the gate half's storage, silu, the
  ``x_linear + glu_linear_offset`` copy, the product, and the product weighted by the router
  probabilities). Measured term by term with ``torch.autograd.graph.saved_tensors_hooks``
  (``bench/trainer_memory.py``).
- ``"transformer_engine"``: the TE spec on CUDA (flash attention: query, key, value, output and
  the float32 log-sum-exp; TE norms fused into the QKV / FC1 GEMMs keep the bf16 input, the
  bf16 normalised output and the float32 rstd; fused RoPE keeps only its frequencies; fused
  weighted SwiGLU keeps its input and the probabilities). From the sources, not measurable on
  a CPU: the device check compares it with the peak it measures.

Division over the layout: tensor parallelism divides heads, expert and dense FFN widths and the
vocabulary; sequence parallelism divides the tokens of the norms, the residual stream and the
router (``sequence_parallel``, on whenever TP > 1 here); context parallelism divides every
token count; the alltoall dispatcher gives each expert-parallel rank ``tokens x top_k`` expert
rows on average (balanced routes: R3 replays the rollout's, which can be less even, a named
assumption of the plan); expert-TP divides the expert FFN width.

Under ``"full"`` recompute megatron-core checkpoints chunks of ``recompute_num_layers`` layers
(``recompute_method="uniform"``) and keeps only each chunk's input; during the backward one
chunk is recomputed at a time, so its layers' ``"none"`` activations are held once more
(:attr:`DecoderActivations.recompute_bytes`). Under ``"selective"`` (megatron-core's default
``recompute_modules=["core_attn"]``) the core attention keeps only its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GRANULARITIES = ("none", "selective", "full")
KERNELS = ("transformer_engine", "local")
BF16, FP32, INT64 = 2, 4, 8
# Index tensors (int64, one per routed row) that the alltoall dispatcher's permute /
# unpermute and the router keep: measured 5 on megatron-core 0.19 (sorted indices, the
# permutation map and the scatter indices of unpermute).
DISPATCH_INDEX_TENSORS = 5


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a decoder that set its activations.

    Attributes:
        hidden: hidden size h.
        num_heads, num_kv_heads, head_dim: attention heads a, query groups g, head size d.
        qk_layernorm: RMSNorm on queries and keys per head (Qwen3).
        vocab: vocabulary V.
        moe_layers: per decoder layer, True for a MoE layer.
        dense_ffn: FFN width of the dense layers (0 without any).
        moe_ffn: FFN width f of one routed expert.
        num_experts, top_k: routed experts E and experts per token k.
        shared_expert_ffn: FFN width of the shared expert (Qwen2-MoE), 0 without.
    """

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_layernorm: bool
    vocab: int
    moe_layers: tuple[bool, ...]
    dense_ffn: int
    moe_ffn: int
    num_experts: int
    top_k: int
    shared_expert_ffn: int = 0

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelDims:
        """The dims of a parsed HF ``config.json`` (Qwen3-MoE, Qwen2-MoE, Mixtral).

        Raises:
            ValueError: for another architecture (naming ``architectures``; DeepSeek-V3's MLA
                has no formula here) or a missing field (naming it).
        """
        archs = list(cfg.get("architectures") or [])

        def need(key: str) -> int:
            if cfg.get(key) is None:
                raise ValueError(f"config.json: {key} is missing (needed for activations)")
            return int(cfg[key])

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        common = dict(
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=need("vocab_size"),
            top_k=need("num_experts_per_tok"),
        )
        if "Qwen3MoeForCausalLM" in archs or "Qwen2MoeForCausalLM" in archs:
            num_layers, step = need("num_hidden_layers"), int(cfg.get("decoder_sparse_step", 1))
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
            qwen2 = "Qwen2MoeForCausalLM" in archs
            return cls(
                **common,
                qk_layernorm=not qwen2,
                moe_layers=moe,
                dense_ffn=int(cfg.get("intermediate_size") or 0) if not all(moe) else 0,
                moe_ffn=need("moe_intermediate_size"),
                num_experts=int(cfg.get("num_experts") or need("num_local_experts")),
                shared_expert_ffn=(
                    int(cfg.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
                ),
            )
        if "MixtralForCausalLM" in archs:
            return cls(
                **common,
                qk_layernorm=False,
                moe_layers=(True,) * need("num_hidden_layers"),
                dense_ffn=0,
                moe_ffn=need("intermediate_size"),
                num_experts=need("num_local_experts"),
            )
        raise ValueError(
            f"architectures={archs}: no activation formula (known: Qwen3MoeForCausalLM, "
            "Qwen2MoeForCausalLM, MixtralForCausalLM)"
        )


@dataclass(frozen=True)
class ActivationLayout:
    """The parallel sizes that divide activations (megatron-core's names).

    Attributes:
        tp, cp, ep, etp: tensor, context, expert and expert-tensor parallel sizes.
        sequence_parallel: norms, residual and router on 1 / TP of the tokens.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ActivationLayout.{name} must be >= 1, got {getattr(self, name)}")


def _check(kernels: str, granularity: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"train.recompute_granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )


def attention_terms(
    dims: ModelDims,
    layout: ActivationLayout,
    *,
    tokens: int,
    seq_len: int,
    kernels: str,
    granularity: str,
) -> dict[str, int]:
    """Bytes of the tensors one attention block keeps for backward, by name.

    Args:
        dims, layout: the model and its parallel sizes.
        tokens, seq_len: the micro-batch as the model sees it: ``tokens`` tokens (rows x
            padded length, before the CP split) in rows of at most ``seq_len`` tokens (the
            quadratic and per-sequence terms take every row at that length: an upper bound
            for a token-budget micro-batch).
        kernels: ``"local"`` or ``"transformer_engine"`` (module docstring).
        granularity: ``"none"`` or ``"selective"`` (``"full"`` keeps none of them: see
            :func:`decoder_activations`).

    Returns:
        name -> bytes on this rank; the block's total is the sum.
    """
    _check(kernels, granularity)
    s = seq_len // layout.cp
    tokens = tokens // layout.cp
    sp = layout.tp if layout.sequence_parallel else 1
    h, d = dims.hidden, dims.head_dim
    a, g = dims.num_heads // layout.tp, max(dims.num_kv_heads // layout.tp, 1)
    qkv_out = tokens * (a + 2 * g) * d * BF16  # the fused QKV output, [s, b, (a + 2g) d]
    t: dict[str, int] = {}
    if kernels == "local":
        t["input_norm_fp32_in_out"] = tokens // sp * (2 * h * FP32 + FP32)
        t["qkv_input"] = tokens // sp * h * BF16
        if dims.qk_layernorm:
            t["qk_norm_fp32_in_out"] = tokens * (a + g) * (2 * d * FP32 + FP32)
        t["rope_cos_sin"] = 4 * s * d * BF16  # cos and sin for q and for k, per layer
        if granularity == "none":
            # baddbmm keeps q and the expanded k, bmm the expanded v (a view of the QKV
            # output when nothing is expanded) and the bf16 probabilities; softmax its float32
            # output. Scores are [rows, a, s, s]: quadratic in the sequence.
            expanded = 2 * tokens * a * d * BF16
            t["core_attention_qkv"] = expanded + (tokens * a * d * BF16 if a != g else qkv_out)
            t["core_attention_scores"] = tokens * a * s * (FP32 + BF16)
        else:  # checkpointed core attention keeps its inputs: q, k and v (a QKV view)
            t["core_attention_inputs"] = tokens * (a + g) * d * BF16 + qkv_out
        t["proj_input"] = tokens * a * d * BF16
        return t
    # transformer-engine: LayerNormLinear keeps its input, its output (all-gathered again in
    # the backward under SP) and rstd.
    t["input_norm_qkv"] = tokens // sp * (2 * h * BF16 + FP32)
    t["qkv_output"] = qkv_out  # value is a view of it; q/k norms keep their inputs in it
    if dims.qk_layernorm:
        t["qk_norm"] = tokens * (a * d * BF16 + (a + g) * FP32)  # the q reshape copies
    t["rope_q_k"] = tokens * (a + g) * d * BF16  # fused RoPE outputs, flash attention's inputs
    t["flash_output"] = tokens * a * d * BF16  # also linear_proj's input (same storage)
    if granularity == "none":
        t["flash_softmax_lse"] = tokens * a * FP32
    return t


def mlp_terms(
    dims: ModelDims, layout: ActivationLayout, *, tokens: int, seq_len: int, kernels: str, moe: bool
) -> dict[str, int]:
    """Bytes of the tensors one MLP block (MoE or dense) keeps for backward, by name.

    Arguments as :func:`attention_terms`; ``moe`` selects the MoE layer (router, alltoall
    dispatcher, routed experts: ``top_k`` rows per token on this rank on average, expert
    width / expert-TP) or the dense MLP (width / TP).
    """
    _check(kernels, "none")
    tokens = tokens // layout.cp
    sp = layout.tp if layout.sequence_parallel else 1
    local_tokens = tokens // sp
    h = dims.hidden
    # SwiGLU per row of width w: local keeps FC1's output (4w), silu, the offset copy and the
    # product (2w each); TE's fused SwiGLU keeps its input (4w); both keep FC2's input (2w).
    glu = 12 if kernels == "local" else 6  # bytes per unit of width, FC2 input included
    t: dict[str, int] = {}
    if kernels == "local":
        t["pre_mlp_norm_fp32_in_out"] = local_tokens * (2 * h * FP32 + FP32)
        t["norm_output"] = local_tokens * h * BF16
    else:
        t["pre_mlp_norm"] = local_tokens * (2 * h * BF16 + FP32)
    if not moe:
        width = dims.dense_ffn // layout.tp
        # local: no probability product, so FC2's input is the product itself (2 bytes less);
        # FC1's input is the norm output counted above (TE: inside pre_mlp_norm)
        t["dense_swiglu"] = tokens * width * (glu - 2 if kernels == "local" else glu)
        return t
    k, e = dims.top_k, dims.num_experts
    routed = local_tokens * k  # expert rows this rank computes (balanced over EP)
    t["router_scores_fp32"] = local_tokens * (e * FP32 + k * (FP32 + INT64))
    t["dispatch_indices"] = routed * DISPATCH_INDEX_TENSORS * INT64
    t["expert_inputs"] = routed * (h * BF16 + FP32)  # permuted tokens and their probabilities
    t["expert_swiglu"] = routed * (dims.moe_ffn // layout.etp) * glu
    if dims.shared_expert_ffn:
        width = dims.shared_expert_ffn // layout.tp
        t["shared_expert"] = tokens * width * (glu - 2 if kernels == "local" else glu)
    return t


@dataclass(frozen=True)
class DecoderActivations:
    """Activations of this rank's decoder layers for one micro-batch.

    Attributes:
        saved_bytes: kept from the forward to the backward (every layer of the stage).
        recompute_bytes: held on top during the backward by the recompute of one chunk
            (``"full"``: ``recompute_num_layers`` layers' ``"none"`` activations; else 0).
        per_layer: saved bytes of each layer of the stage.
    """

    saved_bytes: int
    recompute_bytes: int
    per_layer: tuple[int, ...]


def layer_bytes(
    dims: ModelDims,
    layout: ActivationLayout,
    *,
    layer: int,
    tokens: int,
    seq_len: int,
    kernels: str,
    granularity: str,
) -> int:
    """Bytes decoder layer ``layer`` (0-based) keeps without full recompute (``"none"`` or
    ``"selective"``)."""
    kw = dict(tokens=tokens, seq_len=seq_len, kernels=kernels)
    return sum(attention_terms(dims, layout, granularity=granularity, **kw).values()) + sum(
        mlp_terms(dims, layout, moe=dims.moe_layers[layer], **kw).values()
    )


def decoder_activations(
    dims: ModelDims,
    layout: ActivationLayout,
    *,
    layers: range,
    tokens: int,
    seq_len: int,
    kernels: str,
    granularity: str,
    recompute_num_layers: int = 1,
) -> DecoderActivations:
    """The decoder's activations on this rank for one micro-batch of ``tokens`` tokens in rows
    of at most ``seq_len``.

    Args:
        layers: the 0-based decoder layers of this pipeline stage.
        recompute_num_layers: layers per checkpointed chunk under ``"full"``.
        (others as :func:`attention_terms`)

    Also counted once per stage: the frequencies fused / checkpointed RoPE keeps (float32
    [s, d]) and, for local core attention without recompute, its [s, s] causal mask (bool).
    """
    _check(kernels, granularity)
    if recompute_num_layers < 1:
        raise ValueError(f"train.recompute_num_layers must be >= 1, got {recompute_num_layers}")
    s = seq_len // layout.cp
    shared = 0
    if kernels == "transformer_engine" or granularity == "full":
        shared += s * dims.head_dim * FP32  # RoPE frequencies, one tensor for every layer
    if kernels == "local" and granularity == "none":
        shared += s * s  # the causal mask the local softmax keeps
    kw = dict(tokens=tokens, seq_len=seq_len, kernels=kernels)
    if granularity != "full":
        per = tuple(
            layer_bytes(dims, layout, layer=i, granularity=granularity, **kw) for i in layers
        )
        return DecoderActivations(sum(per) + shared, 0, per)
    sp = layout.tp if layout.sequence_parallel else 1
    chunk_input = tokens // layout.cp // sp * dims.hidden * BF16
    num_chunks = math.ceil(len(layers) / recompute_num_layers)
    per = tuple(
        chunk_input if (i - layers.start) % recompute_num_layers == 0 else 0 for i in layers
    )
    full = [layer_bytes(dims, layout, layer=i, granularity="none", **kw) for i in layers]
    heaviest = max(
        (
            sum(full[c : c + recompute_num_layers])
            for c in range(0, len(full), recompute_num_layers)
        ),
        default=0,
    )
    return DecoderActivations(num_chunks * chunk_input + shared, heaviest, per)


@dataclass(frozen=True)
class OutputActivations:
    """The last stage's output layer and loss for one micro-batch.

    Attributes:
        saved_bytes: kept for backward: the final norm's, the output layer's input, the float32
            copy of the logits that megatron-core's vocab-parallel cross entropy turns into its
            softmax in place (and, with an entropy bonus, the entropy's two float32 tensors).
        transient_bytes: alive at the peak on top of them: the bf16 logits next to their
            float32 copy in the forward (in the backward the bf16 logit gradient next to the
            float32 one).
    """

    saved_bytes: int
    transient_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Saved plus transient bytes."""
        return self.saved_bytes + self.transient_bytes


def output_activations(
    dims: ModelDims,
    layout: ActivationLayout,
    *,
    tokens: int,
    seq_len: int,
    kernels: str,
    entropy: bool = False,
) -> OutputActivations:
    """Logits and loss of one micro-batch on this rank (vocabulary split over TP; the output
    layer all-gathers the sequence under SP, so its logits cover every token of the rank's
    CP share).

    Per token: final norm (local: float32 input and output + rstd; TE: bf16 input + rstd), the
    output layer's input (bf16, SP-sharded), labels and input ids (int64), the loss mask;
    per token and vocabulary entry of the shard: 4 bytes saved (float32 logits / softmax),
    2 transient (bf16 logits), 8 more saved with an entropy bonus (``exp`` and the shifted
    logits of ``training.logprobs.vocab_parallel_entropy``) and 4 transient (its float copy).
    """
    _check(kernels, "none")
    del seq_len  # nothing here depends on the row length
    tokens = tokens // layout.cp
    sp = layout.tp if layout.sequence_parallel else 1
    h, v = dims.hidden, dims.vocab // layout.tp
    norm = 2 * h * FP32 + FP32 if kernels == "local" else h * BF16 + FP32
    saved = tokens // sp * (norm + h * BF16) + tokens * (2 * INT64 + 1) + tokens * v * FP32
    transient = tokens * v * BF16
    if entropy:
        saved += tokens * v * 2 * FP32
        transient += tokens * v * FP32
    return OutputActivations(saved, transient)
