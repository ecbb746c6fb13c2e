"""The declarative map format and the rule snippets the architectures share.

A :class:`Rule` ties one megatron-core tensor, named in the canonical local-spec scheme with
``{l}`` (global layer index) and ``{e}`` (global expert id) placeholders, to the Hugging Face
on-disk tensors it is made of, and says how:

- ``copy``: one HF tensor, same layout.
- ``qkv``: megatron-core's grouped ``linear_qkv`` [G * (Q/G + 2) * D, ...] from HF
  ``q_proj`` [Q * D, ...], ``k_proj`` [G * D, ...], ``v_proj`` [G * D, ...] (weights or biases):
  per query group g, its Q/G query heads, then its key head, then its value head.
- ``glu``: megatron-core's gated ``linear_fc1`` [2I, H] = ``[gate_proj; up_proj]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = ("copy", "qkv", "glu")
_PLACEHOLDER = re.compile(r"\{(l|e)\}")


@dataclass(frozen=True)
class Rule:
    """One megatron-core tensor <-> the HF tensors it is built from.

    Attributes:
        mcore: canonical megatron-core name template (``decoder.layers.{l}.mlp...``).
        hf: HF on-disk name templates, in the order the ``kind`` expects (qkv: q, k, v; glu:
            gate, up).
        kind: ``copy``, ``qkv`` or ``glu``.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rule {self.mcore}: kind {self.kind!r} not in {KINDS}")
        wanted = {"copy": 1, "qkv": 3, "glu": 2}[self.kind]
        if len(self.hf) != wanted:
            raise ValueError(f"rule {self.mcore}: kind {self.kind} needs {wanted} HF names")

    @property
    def pattern(self) -> re.Pattern[str]:
        """Regex over canonical megatron-core names, with groups ``l`` and ``e``."""
        parts = _PLACEHOLDER.split(self.mcore)
        regex = "".join(f"(?P<{p}>\\d+)" if i % 2 else re.escape(p) for i, p in enumerate(parts))
        return re.compile(regex)


@dataclass(frozen=True)
class ArchMap:
    """The name map of one architecture.

    Attributes:
        architecture: HF ``architectures`` name.
        rules: one rule per megatron-core tensor kind; every megatron-core tensor must match
            exactly one.
        memory_renames: (old, new) substrings turning transformers' in-memory names into the
            on-disk ones (Mixtral keeps ``.mlp.`` in memory, ``.block_sparse_moe.`` on disk).
            Fused in-memory experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
            [E, H, I]) are split into the expert rules' on-disk names.
    """

    architecture: str
    rules: tuple[Rule, ...]
    memory_renames: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        seen = [r.mcore for r in self.rules]
        dupes = sorted({m for m in seen if seen.count(m) > 1})
        if dupes:
            raise ValueError(f"{self.architecture}: rules repeat megatron-core names {dupes}")


_LAYER = "decoder.layers.{l}."
_HF_LAYER = "model.layers.{l}."
_EXPERT = _LAYER + "mlp.experts.local_experts.{e}."


def embedding_rules() -> tuple[Rule, ...]:
    """Embedding, final norm, output layer (tied output layers are handled by the engine)."""
    return (
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule("output_layer.weight", ("lm_head.weight",)),
    )


def layer_norm_rules() -> tuple[Rule, ...]:
    """The two per-layer RMSNorms."""
    return (
        Rule(_LAYER + "input_layernorm.weight", (_HF_LAYER + "input_layernorm.weight",)),
        Rule(_LAYER + "pre_mlp_layernorm.weight", (_HF_LAYER + "post_attention_layernorm.weight",)),
    )


def gqa_attention_rules(*, qkv_bias: bool = False, qk_norm: bool = False) -> tuple[Rule, ...]:
    """Grouped-query attention: fused QKV (and its bias), output projection, q/k norms."""
    attn, hf = _LAYER + "self_attention.", _HF_LAYER + "self_attn."
    rules = [
        Rule(attn + "linear_qkv.weight", tuple(hf + f"{p}_proj.weight" for p in "qkv"), "qkv"),
        Rule(attn + "linear_proj.weight", (hf + "o_proj.weight",)),
    ]
    if qkv_bias:
        rules.append(
            Rule(attn + "linear_qkv.bias", tuple(hf + f"{p}_proj.bias" for p in "qkv"), "qkv")
        )
    if qk_norm:
        rules += [
            Rule(attn + "q_layernorm.weight", (hf + "q_norm.weight",)),
            Rule(attn + "k_layernorm.weight", (hf + "k_norm.weight",)),
        ]
    return tuple(rules)


def swiglu_rules(mcore_prefix: str, hf_prefix: str, names=("gate", "up", "down")):
    """A SwiGLU MLP: ``linear_fc1`` = [gate; up] and ``linear_fc2`` = down.

    Args:
        mcore_prefix: megatron-core module prefix ending in ``.``.
        hf_prefix: HF module prefix ending in ``.``.
        names: HF names of the gate, up and down projections (``_proj.weight`` appended
            unless the name already ends in ``.weight``).
    """
    gate, up, down = (n if n.endswith(".weight") else f"{n}_proj.weight" for n in names)
    return (
        Rule(mcore_prefix + "linear_fc1.weight", (hf_prefix + gate, hf_prefix + up), "glu"),
        Rule(mcore_prefix + "linear_fc2.weight", (hf_prefix + down,)),
    )


def routed_expert_rules(hf_expert_prefix: str, names=("gate", "up", "down")):
    """Routed experts: megatron-core local expert ``{e}`` is the global id after the engine's
    offset; ``hf_expert_prefix`` contains ``{l}`` and ``{e}``."""
    return swiglu_rules(_EXPERT, hf_expert_prefix, names)


def dense_mlp_rules() -> tuple[Rule, ...]:
    """The dense SwiGLU MLP of non-MoE layers (``model.layers.{l}.mlp.{gate,up,down}_proj``)."""
    return swiglu_rules(_LAYER + "mlp.", _HF_LAYER + "mlp.")


def router_rule(hf_name: str = "mlp.gate.weight") -> Rule:
    """The router's weight [E, H]."""
    return Rule(_LAYER + "mlp.router.weight", (_HF_LAYER + hf_name,))


LAYER, HF_LAYER = _LAYER, _HF_LAYER
