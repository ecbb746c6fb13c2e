"""This rank's megatron-core shards <-> full Hugging Face tensors, at any TP / EP / PP.

Layout of a shard (megatron-core 0.19, local or transformer-engine spec):

- Tensor parallel: a parameter with ``tensor_model_parallel=True`` holds the slice
  ``partition_dim`` of the full tensor for its TP rank (the expert-TP group for routed experts,
  the TP group otherwise); others are replicated. A gated ``linear_fc1`` [2I/TP, H] holds
  ``[gate shard; up shard]`` of its rank, not a contiguous slice of ``[gate; up]``.
- Expert parallel: layer ``l``'s module ``mlp.experts.local_experts.{i}`` is global expert
  ``mlp.local_expert_indices[i]`` = ``ep_rank * num_local + i``.
- Pipeline parallel: ``decoder.layers.{i}`` is global layer ``layer_number - 1``; only the
  first stage holds the embedding, only the last the final norm and output layer.

Both functions run collectives: every rank of the world must call them, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_sat.checkpoint.hf_map import (
    NameMap,
    canonical_mcore_name,
    check_tied_lm_head,
    format_names,
    globalize,
    hf_disk_names,
)


@dataclass(frozen=True)
class LocalTensor:
    """One parameter or persistent buffer of this rank's model.

    Attributes:
        name: state-dict name on this rank.
        canonical: canonical local-spec name with the global layer index and, for a routed
            expert, the global expert id.
        tensor: the parameter or buffer itself (a shard under TP).
        tp_dim: the dimension split over TP ranks, or None when replicated.
        glu: a gated ``linear_fc1`` (shards are ``[gate shard; up shard]``).
        expert: a routed-expert tensor (held by one EP rank).
        local_expert: the local expert index (experts only).
        num_local_experts: experts per EP rank in this layer (experts only).
    """

    name: str
    canonical: str
    tensor: torch.Tensor
    tp_dim: int | None
    glu: bool
    expert: bool
    local_expert: int = 0
    num_local_experts: int = 0

    def canonical_on(self, ep_rank: int) -> str:
        """The canonical name of the same local expert slot on EP rank ``ep_rank``."""
        if not self.expert:
            return self.canonical
        global_id = ep_rank * self.num_local_experts + self.local_expert
        prefix, _, rest = self.canonical.partition("mlp.experts.local_experts.")
        return f"{prefix}mlp.experts.local_experts.{global_id}.{rest.split('.', 1)[1]}"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def local_tensors(model: torch.nn.Module) -> list[LocalTensor]:
    """Every parameter and persistent buffer of this rank's model (``_extra_state`` skipped),
    in state-dict order, with its global name and shard layout."""
    model = unwrap(model)
    gated = bool(model.config.gated_linear_unit)
    layer_offset: dict[int, int] = {}
    expert_base: dict[int, tuple[int, int]] = {}  # local layer -> (first global id, num local)
    for i, layer in enumerate(getattr(getattr(model, "decoder", None), "layers", [])):
        layer_offset[i] = layer.layer_number - 1 - i
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if indices:
            expert_base[i] = (indices[0], len(indices))
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        canonical = canonical_mcore_name(name)
        layer = None
        if canonical.startswith("decoder.layers."):
            layer = int(canonical.split(".")[2])
        expert = ".mlp.experts.local_experts." in canonical
        local_expert, num_local, offset = 0, 0, 0
        if expert:
            local_expert = int(canonical.split("mlp.experts.local_experts.")[1].split(".")[0])
            offset, num_local = expert_base[layer]
        canonical = globalize(
            canonical,
            layer_offset=layer_offset.get(layer, 0) if layer is not None else 0,
            expert_offset=offset,
        )
        split = bool(getattr(tensor, "tensor_model_parallel", False))
        out.append(
            LocalTensor(
                name=name,
                canonical=canonical,
                tensor=tensor,
                tp_dim=int(tensor.partition_dim) if split else None,
                glu=gated and canonical.endswith("linear_fc1.weight"),
                expert=expert,
                local_expert=local_expert,
                num_local_experts=num_local,
            )
        )
    return out


def _groups(expert: bool):
    """(tensor-parallel group, expert-parallel group or None) of a tensor on this rank."""
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    return ps.get_tensor_model_parallel_group(), None


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() and group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() and group is not None else 0


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    if _size(group) == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def join_tp(parts: list[torch.Tensor], dim: int, glu: bool) -> torch.Tensor:
    """Full tensor from its TP shards in rank order (``[gate_r; up_r]`` shards for ``glu``)."""
    if len(parts) == 1:
        return parts[0]
    if glu:
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def split_tp(full: torch.Tensor, dim: int, glu: bool, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of ``full`` (inverse of :func:`join_tp`).

    Raises:
        ValueError: when the split dimension does not divide evenly.
    """
    if size == 1:
        return full
    halves = full.chunk(2, dim=dim) if glu else (full,)
    shards = []
    for half in halves:
        if half.shape[dim] % size:
            raise ValueError(f"dimension {dim} of shape {tuple(full.shape)} does not split {size}")
        shards.append(half.narrow(dim, rank * (half.shape[dim] // size), half.shape[dim] // size))
    return torch.cat(shards, dim=dim) if glu else shards[0]


def _full_shape(unit: LocalTensor, tp_size: int) -> tuple[int, ...]:
    shape = list(unit.tensor.shape)
    if unit.tp_dim is not None:
        shape[unit.tp_dim] *= tp_size
    return tuple(shape)


def _gather_unit(unit: LocalTensor) -> list[tuple[str, torch.Tensor]]:
    """Full megatron-core tensors of one local tensor: TP-gathered, and for an expert the same
    slot of every EP rank (collective over the unit's TP and EP groups)."""
    tp_group, ep_group = _groups(unit.expert)
    tensor = unit.tensor.detach()
    if unit.tp_dim is not None:
        tensor = join_tp(_all_gather(tensor, tp_group), unit.tp_dim, unit.glu)
    if not unit.expert:
        return [(unit.canonical, tensor)]
    return [(unit.canonical_on(r), t) for r, t in enumerate(_all_gather(tensor, ep_group))]


def _unit_meta(unit: LocalTensor) -> list[tuple[str, torch.Tensor]]:
    """As :func:`_gather_unit` with meta tensors (shapes only, no communication)."""
    tp_group, ep_group = _groups(unit.expert)
    meta = torch.empty(_full_shape(unit, _size(tp_group)), dtype=unit.tensor.dtype, device="meta")
    if not unit.expert:
        return [(unit.canonical, meta)]
    return [(unit.canonical_on(r), meta) for r in range(_size(ep_group))]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def export_hf_tensors(
    model: torch.nn.Module, hf_config: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model, on every rank.

    Gathers TP shards (re-interleaving gated ``linear_fc1``), the experts of every EP rank
    (global id ``ep_rank * num_local + i``) and, under PP, every stage's tensors (each stage
    broadcasts its own over the pipeline group, in stage order). Tensors keep the training
    dtype (the DeepSeek-V3 expert bias stays fp32). HF names are the on-disk ones (per-expert
    keys), as SGLang's weight update takes them.

    Every rank must iterate the generator to the end: it runs collectives over the TP, EP and
    PP groups. Yielded tensors may be views of the parameters (TP = EP = PP = 1): clone them
    before the next optimizer step if they must be kept.

    Raises:
        ValueError: for a megatron-core tensor the architecture's map does not know, or an HF
            name produced twice.
    """
    from megatron.core import parallel_state as ps

    names = NameMap(hf_config)
    units = local_tensors(model)
    pp_group = ps.get_pipeline_model_parallel_group() if dist.is_initialized() else None
    pp_size = _size(pp_group)
    seen: set[str] = set()

    def once(hf_name: str) -> str:
        if hf_name in seen:
            raise ValueError(f"Hugging Face tensor {hf_name!r} would be written twice")
        seen.add(hf_name)
        return hf_name

    if pp_size == 1:
        for unit in units:
            for canonical, full in _gather_unit(unit):
                for hf_name, tensor in names.to_hf(canonical, full):
                    yield once(hf_name), tensor
        return
    meta = [
        (hf_name, tuple(t.shape), str(t.dtype))
        for unit in units
        for canonical, full in _unit_meta(unit)
        for hf_name, t in names.to_hf(canonical, full)
    ]
    all_meta: list[Any] = [None] * pp_size
    dist.all_gather_object(all_meta, meta, group=pp_group)
    ranks = dist.get_process_group_ranks(pp_group)
    stage = _rank(pp_group)
    for src_stage in range(pp_size):
        if src_stage == stage:
            for unit in units:
                for canonical, full in _gather_unit(unit):
                    for hf_name, tensor in names.to_hf(canonical, full):
                        tensor = tensor.contiguous()
                        dist.broadcast(tensor, src=ranks[src_stage], group=pp_group)
                        yield once(hf_name), tensor
        else:
            for hf_name, shape, dtype in all_meta[src_stage]:
                tensor = torch.empty(shape, dtype=_dtype(dtype))
                dist.broadcast(tensor, src=ranks[src_stage], group=pp_group)
                yield once(hf_name), tensor


def export_stage_hf_tensors(
    model: torch.nn.Module, hf_config: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for this pipeline stage's own tensors only.

    As ``export_hf_tensors`` (TP shards and every EP rank's experts gathered, training dtype,
    global layer numbers in the HF names), but without the PP broadcasts: each stage yields
    what it holds, for a weight push in which every stage sends its own layers. At PP = 1 it
    is ``export_hf_tensors``. Every rank of the stage's TP / EP groups must iterate it to the
    end (collectives).

    Raises:
        ValueError: for a megatron-core tensor the map does not know, or an HF name produced
            twice by this stage.
    """
    names = NameMap(hf_config)
    seen: set[str] = set()
    for unit in local_tensors(model):
        for canonical, full in _gather_unit(unit):
            for hf_name, tensor in names.to_hf(canonical, full):
                if hf_name in seen:
                    raise ValueError(f"Hugging Face tensor {hf_name!r} would be written twice")
                seen.add(hf_name)
                yield hf_name, tensor


def load_hf_tensors(
    model: torch.nn.Module,
    hf_tensors: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any],
    *,
    progress: bool = False,
) -> None:
    """Copy full HF tensors into this rank's shards of ``model``, in place.

    Each rank builds the full megatron-core tensor of every local parameter / persistent
    buffer from its HF sources (``hf_tensors`` may be lazy: only the needed tensors are read),
    takes its TP shard and copies it (cast to the parameter's dtype; the fp32 expert bias stays
    fp32). Then the HF names used on every rank are gathered: each HF tensor must be used by
    some rank.

    Args:
        model: this rank's megatron-core model (DDP-wrapped or not).
        hf_tensors: full HF tensors by on-disk or transformers in-memory name.
        hf_config: the model's ``config.json``.
        progress: show a progress bar (tqdm) on global rank 0.

    Raises:
        ValueError: on every rank, naming the missing HF tensors, the ones no rank used,
            mis-shaped ones (with expected and found shapes) and unmappable model tensors.
    """
    names = NameMap(hf_config)
    hf_tensors = hf_disk_names(hf_tensors, hf_config)
    used: set[str] = set()
    problems: list[str] = []
    missing: set[str] = set()
    from tqdm import tqdm

    units = local_tensors(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    bar = tqdm(units, desc="load HF", unit="tensor", disable=not (progress and rank0))
    with torch.no_grad():
        for unit in bar:
            try:
                sources = names.hf_sources(unit.canonical)
            except ValueError as err:
                problems.append(str(err))
                continue
            absent = [s for s in sources if s not in hf_tensors]
            if absent:
                missing.update(absent)
                continue
            used.update(sources)
            tp_group, _ = _groups(unit.expert)
            tp_size = _size(tp_group) if unit.tp_dim is not None else 1
            want = _full_shape(unit, tp_size)
            try:
                full = names.from_hf(unit.canonical, [hf_tensors[s] for s in sources])
            except RuntimeError as err:  # e.g. a q_proj whose rows do not reshape into heads
                problems.append(f"mis-shaped {sources}: cannot build {unit.canonical}: {err}")
                continue
            if tuple(full.shape) != want:
                shapes = [tuple(hf_tensors[s].shape) for s in sources]
                problems.append(
                    f"mis-shaped {sources} {shapes}: {unit.canonical} needs {want}, "
                    f"got {tuple(full.shape)}"
                )
                continue
            if unit.tp_dim is not None:
                full = split_tp(full, unit.tp_dim, unit.glu, _rank(tp_group), tp_size)
            unit.tensor.data.copy_(full.to(unit.tensor.dtype))
    used |= check_tied_lm_head(hf_tensors, hf_config)
    gathered = [(used, problems, missing)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (used, problems, missing))
    all_used = set().union(*(g[0] for g in gathered))
    all_problems = sorted({p for g in gathered for p in g[1]})
    all_missing = set().union(*(g[2] for g in gathered))
    unused = set(hf_tensors) - all_used
    if all_problems or all_missing or unused:
        raise ValueError(
            "Hugging Face checkpoint does not match the model: "
            f"missing {format_names(all_missing)}; unused {format_names(unused)}"
            + (f"; {'; '.join(all_problems[:8])}" if all_problems else "")
        )
