"""Declarative Qwen3-MoE name map between megatron-core and Hugging Face tensors.

Full (unsharded) tensors on both sides. Both megatron-core naming schemes are accepted: the
local spec (``input_layernorm.weight``, ``experts.local_experts.{e}.linear_fc1.weight``) and the
transformer-engine spec (``linear_qkv.layer_norm_weight``, ``experts.linear_fc1.weight{e}``).
HF names are the on-disk ones (one key per expert), which is also what SGLang's weight update
takes. Reshapes:

- ``linear_qkv.weight`` [G * (Q/G + 2) * D, H] holds, per query group g, the Q/G query heads of
  the group, then its key head, then its value head (D = head_dim, G = KV heads, Q = heads).
- ``linear_fc1.weight`` [2I, H] is ``[gate_proj; up_proj]``.

Every source tensor must be used exactly once and every target written exactly once; anything
else raises ``ValueError`` naming the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_L = r"decoder\.layers\.(?P<l>\d+)\."
# Local spec: experts.local_experts.{e}.linear_fcN.weight; TE spec: experts.linear_fcN.weight{e}.
_EXPERT = r"mlp\.experts\.(local_experts\.(?P<e>\d+)\.{fc}\.weight|{fc}\.weight(?P<e2>\d+))"
# (megatron-core pattern, HF template); {l} layer, {e} global expert id.
_DIRECT: list[tuple[str, str]] = [
    (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    (r"output_layer\.weight", "lm_head.weight"),
    (r"decoder\.final_layernorm\.weight", "model.norm.weight"),
    (
        _L + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)",
        "model.layers.{l}.input_layernorm.weight",
    ),
    (_L + r"self_attention\.linear_proj\.weight", "model.layers.{l}.self_attn.o_proj.weight"),
    (_L + r"self_attention\.q_layernorm\.weight", "model.layers.{l}.self_attn.q_norm.weight"),
    (_L + r"self_attention\.k_layernorm\.weight", "model.layers.{l}.self_attn.k_norm.weight"),
    (
        _L + r"(pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)",
        "model.layers.{l}.post_attention_layernorm.weight",
    ),
    (_L + r"mlp\.router\.weight", "model.layers.{l}.mlp.gate.weight"),
    (_L + _EXPERT.format(fc="linear_fc2"), "model.layers.{l}.mlp.experts.{e}.down_proj.weight"),
]
_QKV = re.compile(_L + r"self_attention\.linear_qkv\.weight")
_FC1 = re.compile(_L + _EXPERT.format(fc="linear_fc1"))
_DIRECT_RE = [(re.compile(p), t) for p, t in _DIRECT]


def _fields(m: re.Match, expert_offset: int) -> dict[str, int]:
    groups = m.groupdict()
    out = {"l": int(groups["l"])} if groups.get("l") is not None else {}
    e = groups.get("e") or groups.get("e2")
    if e is not None:
        out["e"] = int(e) + expert_offset
    return out


def _qkv_dims(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    heads = int(hf_config["num_attention_heads"])
    groups = int(hf_config.get("num_key_value_heads", heads))
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    return heads // groups, groups, head_dim


def split_qkv(qkv: torch.Tensor, hf_config: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """[G*(Q/G+2)*D, H] grouped megatron-core QKV -> (q [Q*D, H], k [G*D, H], v [G*D, H])."""
    per_group, groups, d = _qkv_dims(hf_config)
    w = qkv.reshape(groups, (per_group + 2) * d, -1)
    q, k, v = torch.split(w, [per_group * d, d, d], dim=1)
    hidden = qkv.shape[-1]
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config: Mapping[str, Any]):
    """Inverse of :func:`split_qkv`."""
    per_group, groups, d = _qkv_dims(hf_config)
    hidden = q.shape[-1]
    w = torch.cat(
        [
            q.reshape(groups, per_group * d, hidden),
            k.reshape(groups, d, hidden),
            v.reshape(groups, d, hidden),
        ],
        dim=1,
    )
    return w.reshape(-1, hidden)


def mcore_to_hf(
    named_tensors: Mapping[str, torch.Tensor] | Iterator[tuple[str, torch.Tensor]],
    hf_config: Mapping[str, Any],
    *,
    expert_offset: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for each full megatron-core tensor, in input order.

    Args:
        named_tensors: megatron-core parameter names (``module.`` prefixes stripped) to full
            tensors, or an iterator of such pairs.
        hf_config: The model's HF ``config.json``.
        expert_offset: Global id of this rank's first local expert (``ep_rank * num_local``).

    Raises:
        ValueError: for a name the map does not know (naming it).
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tied = bool(hf_config.get("tie_word_embeddings", False))
    for name, tensor in items:
        name = name.removeprefix("module.")
        if m := _QKV.fullmatch(name):
            q, k, v = split_qkv(tensor, hf_config)
            base = f"model.layers.{m['l']}.self_attn."
            yield base + "q_proj.weight", q
            yield base + "k_proj.weight", k
            yield base + "v_proj.weight", v
        elif m := _FC1.fullmatch(name):
            f = _fields(m, expert_offset)
            gate, up = torch.chunk(tensor, 2, dim=0)
            base = f"model.layers.{f['l']}.mlp.experts.{f['e']}."
            yield base + "gate_proj.weight", gate
            yield base + "up_proj.weight", up
        else:
            for pattern, template in _DIRECT_RE:
                if m := pattern.fullmatch(name):
                    if tied and template == "lm_head.weight":
                        break  # tied: HF keeps only the embedding
                    yield template.format(**_fields(m, expert_offset)), tensor
                    break
            else:
                raise ValueError(f"megatron-core tensor {name!r} has no Hugging Face mapping")


def hf_to_mcore(
    hf_tensors: Mapping[str, torch.Tensor],
    mcore_names: list[str],
    hf_config: Mapping[str, Any],
    *,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """Build each megatron-core tensor in ``mcore_names`` from the HF tensors.

    Every name in ``mcore_names`` is produced and every HF tensor consumed exactly once (HF
    tensors of experts outside this rank's range must not be passed).

    Raises:
        ValueError: naming the missing HF tensors, the unused ones, or an unmappable name.
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []

    def take(key: str) -> torch.Tensor | None:
        if key not in hf_tensors:
            missing.append(key)
            return None
        if key in used:
            raise ValueError(f"Hugging Face tensor {key!r} would be used twice")
        used.add(key)
        return hf_tensors[key]

    tied = bool(hf_config.get("tie_word_embeddings", False))
    for name in mcore_names:
        clean = name.removeprefix("module.")
        if m := _QKV.fullmatch(clean):
            base = f"model.layers.{m['l']}.self_attn."
            parts = [take(base + p) for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")]
            if all(p is not None for p in parts):
                out[name] = merge_qkv(*parts, hf_config)
        elif m := _FC1.fullmatch(clean):
            f = _fields(m, expert_offset)
            base = f"model.layers.{f['l']}.mlp.experts.{f['e']}."
            gate, up = take(base + "gate_proj.weight"), take(base + "up_proj.weight")
            if gate is not None and up is not None:
                out[name] = torch.cat([gate, up], dim=0)
        else:
            for pattern, template in _DIRECT_RE:
                if m := pattern.fullmatch(clean):
                    if tied and template == "lm_head.weight":
                        template = "model.embed_tokens.weight"
                        if template in used:  # tied weights are one tensor: reuse it
                            out[name] = hf_tensors[template]
                            break
                    t = take(template.format(**_fields(m, expert_offset)))
                    if t is not None:
                        out[name] = t
                    break
            else:
                raise ValueError(f"megatron-core tensor {name!r} has no Hugging Face mapping")
    unused = sorted(set(hf_tensors) - used)
    if missing or unused:
        raise ValueError(
            f"Hugging Face checkpoint does not match the model: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}; unused {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}"
        )
    return out
