"""HF <-> megatron-core tensor maps on full (unsharded) tensors, driven by the per-architecture
rules of :mod:`megatron_sat.checkpoint.archs`.

Names. megatron-core tensors may be named in either scheme; :func:`canonical_mcore_name` turns
the transformer-engine spec names (``self_attention.linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``, ``experts.linear_fc1.weight{e}``, MLA's
``linear_{q,kv}_up_proj.layer_norm_weight``) into the local spec ones (``input_layernorm.weight``,
``pre_mlp_layernorm.weight``, ``experts.local_experts.{e}.linear_fc1.weight``,
``{q,kv}_layernorm.weight``); wrapper prefixes (``module.``) are dropped. HF names are the
on-disk ones (one key per expert), which SGLang's weight update also takes; transformers'
in-memory names (fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I],
Mixtral's ``.mlp.``) are converted by :func:`hf_disk_names`.

Tied embeddings (``tie_word_embeddings``): HF keeps only ``model.embed_tokens.weight``; a
megatron-core ``output_layer.weight`` (the last pipeline stage's copy) is built from it and not
exported. An ``lm_head.weight`` in a tied checkpoint must equal the embedding.

Every source tensor must be used exactly once and every target written exactly once; anything
else raises ``ValueError`` naming the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from megatron_sat.checkpoint.archs import ArchMap, Rule, arch_map

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
OUTPUT_LAYER = "output_layer.weight"

_TE_TO_LOCAL: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(.*)self_attention\.linear_qkv\.layer_norm_weight"), r"\1input_layernorm.weight"),
    (
        re.compile(r"(.*)self_attention\.linear_q_up_proj\.layer_norm_weight"),
        r"\1self_attention.q_layernorm.weight",
    ),
    (
        re.compile(r"(.*)self_attention\.linear_kv_up_proj\.layer_norm_weight"),
        r"\1self_attention.kv_layernorm.weight",
    ),
    (re.compile(r"(.*)mlp\.linear_fc1\.layer_norm_weight"), r"\1pre_mlp_layernorm.weight"),
    (
        re.compile(r"(.*)mlp\.experts\.(linear_fc[12])\.weight(\d+)"),
        r"\1mlp.experts.local_experts.\3.\2.weight",
    ),
]
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def canonical_mcore_name(name: str) -> str:
    """The local-spec name of a megatron-core tensor named in either scheme (wrapper prefixes
    ``module.`` removed). Names that need no change are returned as they are."""
    while name.startswith("module."):
        name = name[len("module.") :]
    for pattern, replacement in _TE_TO_LOCAL:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    return name


def globalize(name: str, *, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Shift the layer index and local expert index of a canonical name to global ones."""
    name = _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name, count=1)
    return _EXPERT_RE.sub(
        lambda m: f"mlp.experts.local_experts.{int(m[1]) + expert_offset}.", name, count=1
    )


def _qkv_dims(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    heads = int(hf_config["num_attention_heads"])
    groups = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    return heads // groups, groups, head_dim


def split_qkv(qkv: torch.Tensor, hf_config: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """Grouped megatron-core QKV [G*(Q/G+2)*D, ...] -> (q [Q*D, ...], k [G*D, ...], v [G*D, ...]).

    Works for weights [.., H] and biases [..] alike (D = head_dim, G = KV heads, Q = heads).
    """
    per_group, groups, d = _qkv_dims(hf_config)
    rest = qkv.shape[1:]
    w = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = torch.split(w, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config: Mapping[str, Any]):
    """Inverse of :func:`split_qkv`: HF q, k, v -> grouped megatron-core QKV."""
    per_group, groups, d = _qkv_dims(hf_config)
    rest = q.shape[1:]
    w = torch.cat(
        [
            q.reshape(groups, per_group * d, *rest),
            k.reshape(groups, d, *rest),
            v.reshape(groups, d, *rest),
        ],
        dim=1,
    )
    return w.reshape(-1, *rest)


class NameMap:
    """The full-tensor map of one architecture (``ArchMap`` + ``config.json``)."""

    def __init__(self, hf_config: Mapping[str, Any]) -> None:
        self.hf_config = hf_config
        self.arch: ArchMap = arch_map(hf_config)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self._compiled = [(rule, rule.pattern) for rule in self.arch.rules]

    def rule_for(self, canonical: str) -> tuple[Rule, list[str]]:
        """The rule matching a canonical, global megatron-core name and its HF names.

        Raises:
            ValueError: when no rule, or more than one, matches (naming the tensor).
        """
        found = [(r, m) for r, p in self._compiled if (m := p.fullmatch(canonical))]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise ValueError(
                f"megatron-core tensor {canonical!r} has {what} {self.arch.architecture} mapping"
            )
        rule, match = found[0]
        fields = match.groupdict()
        return rule, [t.format(**fields) for t in rule.hf]

    def to_hf(self, canonical: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of one full megatron-core tensor ([] for a tied output
        layer, which HF does not store)."""
        rule, names = self.rule_for(canonical)
        if self.tied and canonical == OUTPUT_LAYER:
            return []
        if rule.kind == "qkv":
            parts = split_qkv(tensor, self.hf_config)
        elif rule.kind == "glu":
            parts = torch.chunk(tensor, 2, dim=0)
        else:
            parts = (tensor,)
        return list(zip(names, parts, strict=True))

    def hf_sources(self, canonical: str) -> list[str]:
        """HF names one megatron-core tensor is built from (the embedding for a tied output)."""
        if self.tied and canonical == OUTPUT_LAYER:
            return [EMBEDDING]
        return self.rule_for(canonical)[1]

    def from_hf(self, canonical: str, sources: list[torch.Tensor]) -> torch.Tensor:
        """Build one full megatron-core tensor from its HF sources (as :meth:`hf_sources`)."""
        if self.tied and canonical == OUTPUT_LAYER:
            return sources[0]
        rule, _ = self.rule_for(canonical)
        if rule.kind == "qkv":
            return merge_qkv(*sources, self.hf_config)
        if rule.kind == "glu":
            return torch.cat(sources, dim=0)
        return sources[0]

    def memory_to_disk(self, name: str) -> str:
        """An in-memory transformers name as it is written on disk."""
        for old, new in self.arch.memory_renames:
            name = name.replace(old, new)
        return name


_FUSED = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)"
)


def hf_disk_names(
    hf_tensors: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any]
) -> Mapping[str, torch.Tensor]:
    """HF tensors under their on-disk names.

    ``hf_tensors`` as read from disk is returned unchanged. A transformers ``state_dict()``
    (fused experts ``experts.gate_up_proj`` [E, 2I, H] = per expert [gate; up], and
    ``experts.down_proj`` [E, H, I]) is split into per-expert tensors named as the architecture's
    expert rules say, and renamed by its ``memory_renames``.
    """
    if not any(_FUSED.fullmatch(k) for k in hf_tensors):
        return hf_tensors
    names = NameMap(hf_config)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf_tensors.items():
        m = _FUSED.fullmatch(key)
        if m is None:
            out[names.memory_to_disk(key)] = tensor
            continue
        layer, which = int(m[1]), m[2]
        fc = "linear_fc1" if which == "gate_up_proj" else "linear_fc2"
        for e in range(tensor.shape[0]):
            canonical = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}.weight"
            sources = names.hf_sources(canonical)
            parts = torch.chunk(tensor[e], 2, dim=0) if fc == "linear_fc1" else (tensor[e],)
            out.update(zip(sources, parts, strict=True))
    return out


def mcore_to_hf(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    hf_config: Mapping[str, Any],
    *,
    expert_offset: int = 0,
    layer_offset: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for each full megatron-core tensor, in input order.

    Args:
        named_tensors: megatron-core names (either scheme) to full tensors, or such pairs.
        hf_config: the model's HF ``config.json`` (its ``architectures`` picks the map).
        expert_offset: global id of local expert 0 (``ep_rank * num_local_experts``).
        layer_offset: global index of local decoder layer 0 (pipeline stage offset).

    Raises:
        ValueError: for a name the map does not know, or an HF name produced twice.
    """
    names = NameMap(hf_config)
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    written: set[str] = set()
    for name, tensor in items:
        canonical = globalize(
            canonical_mcore_name(name), layer_offset=layer_offset, expert_offset=expert_offset
        )
        for hf_name, part in names.to_hf(canonical, tensor):
            if hf_name in written:
                raise ValueError(f"Hugging Face tensor {hf_name!r} would be written twice")
            written.add(hf_name)
            yield hf_name, part


def format_names(names: Iterable[str], limit: int = 8) -> str:
    """``[a, b, ...]`` with at most ``limit`` names and a count of the rest."""
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def check_tied_lm_head(hf_tensors: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any]):
    """Names of HF tensors a tied model accounts for without a megatron-core target: an
    ``lm_head.weight`` equal to the embedding.

    Raises:
        ValueError: when a tied checkpoint's ``lm_head.weight`` differs from the embedding.
    """
    if not hf_config.get("tie_word_embeddings", False) or LM_HEAD not in hf_tensors:
        return set()
    if EMBEDDING in hf_tensors and not torch.equal(hf_tensors[LM_HEAD], hf_tensors[EMBEDDING]):
        raise ValueError(f"tie_word_embeddings=true but {LM_HEAD!r} differs from {EMBEDDING!r}")
    return {LM_HEAD}


def hf_to_mcore(
    hf_tensors: Mapping[str, torch.Tensor],
    mcore_names: list[str],
    hf_config: Mapping[str, Any],
    *,
    expert_offset: int = 0,
    layer_offset: int = 0,
    check_unused: bool = True,
) -> dict[str, torch.Tensor]:
    """Build each megatron-core tensor in ``mcore_names`` (full tensors) from HF tensors.

    Args:
        hf_tensors: HF name -> tensor, on-disk or transformers in-memory names.
        mcore_names: megatron-core names (either scheme); keys of the result as given.
        hf_config: the model's ``config.json``.
        expert_offset, layer_offset: as in :func:`mcore_to_hf`.
        check_unused: require every HF tensor to be used (False when building one shard of a
            model whose other ranks use the rest).

    Raises:
        ValueError: naming the missing HF tensors, the unused ones, an HF tensor used twice,
            or an unmappable megatron-core name.
    """
    names = NameMap(hf_config)
    hf_tensors = hf_disk_names(hf_tensors, hf_config)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for name in mcore_names:
        canonical = globalize(
            canonical_mcore_name(name), layer_offset=layer_offset, expert_offset=expert_offset
        )
        sources = names.hf_sources(canonical)
        tied_alias = names.tied and canonical == OUTPUT_LAYER
        for src in sources:
            if src not in hf_tensors:
                missing.append(src)
            elif src in used and not tied_alias:
                raise ValueError(f"Hugging Face tensor {src!r} would be used twice")
        if all(src in hf_tensors for src in sources):
            used.update(sources)
            out[name] = names.from_hf(canonical, [hf_tensors[s] for s in sources])
    used |= check_tied_lm_head(hf_tensors, hf_config)
    unused = set(hf_tensors) - used if check_unused else set()
    if missing or unused:
        raise ValueError(
            f"Hugging Face checkpoint does not match the model: missing {format_names(missing)}; "
            f"unused {format_names(unused)}"
        )
    return out
