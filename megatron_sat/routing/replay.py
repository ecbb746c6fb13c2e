"""R3 replay and record control over megatron-core's ``RouterReplay``, keyed by
(micro-batch, layer).

Source: Ma et al., "Stabilizing MoE RL by Aligning Training and Inference Routers" (R3),
arXiv 2510.11370; megatron-core 0.19 ``transformer/moe/router_replay.py``. Measured facts this
module rests on are in ARCHITECTURE.md ("RouterReplay under PP + recompute").

- Routers are found by walking the live model chunks given (never megatron-core's
  process-global ``RouterReplay.global_router_replay_instances``, which keeps the instances of
  every model ever built), keyed by their global 1-based ``layer_number``; a pipeline stage holds
  only its own layers. Routers inside a multi-token-prediction block number their layers from 1
  again; they are kept apart (:attr:`RoutingReplay.mtp_routers`), never receive decoder routes
  and always route live (SGLang returns no rows for MTP layers).
- Targets are installed per router call by a forward pre-hook, from the micro-batch the caller
  names with :meth:`RoutingReplay.micro_batch` (the forward step of a pipeline schedule).
  megatron-core replays ``REPLAY_FORWARD`` targets on the forward; activation recompute happens
  later, inside the backward, where this module switches the router to ``REPLAY_BACKWARD`` so
  that it pops megatron-core's per-layer FIFO, which holds the targets of the forwards of that
  layer in forward order. Backwards need not run in forward order (interleaved pipelining, or
  any caller: F0, F1, B1, B0), so the FIFO's order is not trusted: each decoder block's output
  carries a gradient hook that names the micro-batch whose backward enters the block, and
  before each recompute the target of that (micro-batch, layer) is moved to the FIFO's head (a
  ledger of (micro-batch, target) per layer finds it by identity). Two micro-batches'
  backwards interleaving inside one block (one backward through both losses) cannot be told
  apart and raise.
- Every session clears the indices and actions of its routers on entry and on exit, and on a
  clean exit checks that each layer was recomputed either for every forward that can be
  backpropagated or for none. No-grad forwards outside a checkpoint never enter the FIFO.
- Gates: megatron-core's replay gathers the trainer's own scores at the replayed experts (raw
  logits then softmax when ``moe_router_pre_softmax=False``, the full softmax when True, biased
  scores for selection and unbiased ones as gates for sigmoid routers), so gates are
  recomputed from the trainer's router and normalised as the router normally does; the router
  keeps its gradient.
- Audit: while replaying, the trainer's own top-k on the same scores is computed (no grad) and
  compared as a set with the replayed experts, per layer, over real tokens
  (:meth:`ReplayReport.metrics`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megatron_sat.routing.slicing import moe_layer_numbers, router_targets


def _mtp_module_ids(model: torch.nn.Module) -> set[int]:
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, MultiTokenPredictionBlock):
            ids.update(id(m) for m in module.modules())
    return ids


def _routers(model: torch.nn.Module, *, mtp: bool) -> dict[int, torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    inside_mtp = _mtp_module_ids(model)
    routers: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(module, TopKRouter) and (id(module) in inside_mtp) == mtp:
            layer = int(module.layer_number)
            if layer in routers:
                kind = "MTP" if mtp else "decoder"
                raise ValueError(f"two {kind} routers claim layer_number {layer}")
            routers[layer] = module
    return routers


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder MoE routers of ``model``: global 1-based layer number -> ``TopKRouter``.

    Multi-token-prediction routers are excluded (see :func:`find_mtp_routers`).

    Raises:
        ValueError: if two decoder routers claim one layer number.
    """
    return _routers(model, mtp=False)


def find_mtp_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Routers inside the multi-token-prediction block: MTP layer number (from 1) -> router."""
    return _routers(model, mtp=True)


def check_replayable(layer: int, router: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming the layer and the setting when replay cannot be exact.

    Refused: no ``RouterReplay`` (``moe_enable_routing_replay=False``); the fused router (its
    path skips the replay hook); sinkhorn / quantile-balancing routing (they bypass top-k);
    token dropping (``moe_expert_capacity_factor``: dropped tokens would not use the replayed
    experts); forced load balancing or forced bias (random logits); context parallelism.
    """
    config = router.config
    if router.router_replay is None:
        raise ValueError(
            f"router of layer {layer} has no RouterReplay: build with "
            "moe_enable_routing_replay=True"
        )
    bad = {
        "moe_router_fusion": config.moe_router_fusion,
        "moe_expert_capacity_factor": config.moe_expert_capacity_factor is not None,
        "moe_router_force_load_balancing": config.moe_router_force_load_balancing,
        "moe_router_force_biased": getattr(config, "moe_router_force_biased", None) is not None,
        "context_parallel_size": config.context_parallel_size > 1,
    }
    if router.routing_type in ("sinkhorn", "quantile_balancing"):
        bad[f"moe_router_load_balancing_type={router.routing_type!r}"] = True
    named = [name for name, is_bad in bad.items() if is_bad]
    if named:
        raise ValueError(f"routing replay of layer {layer} cannot be exact with {named}")


@dataclass(frozen=True)
class MicroBatchRoutes:
    """What the routers of this rank replay for one micro-batch.

    Attributes:
        targets: global layer number -> int64 [num_local_tokens, top_k] in the router's token
            order (see :mod:`megatron_sat.routing.slicing`).
        real: bool [num_local_tokens], True where the route came from the rollout engine (not a
            filler row); the audit counts only these. None counts every token.
    """

    targets: Mapping[int, torch.Tensor]
    real: torch.Tensor | None = None


@dataclass
class ReplayReport:
    """What a replay or record session saw, filled while it runs.

    Attributes:
        differ: layer -> 0-dim int64, real tokens whose replayed expert set differs from the
            trainer's own top-k (forwards only; recomputes are not counted again).
        tokens: layer -> 0-dim int64, real tokens audited.
        recorded: (micro-batch, layer) -> int64 [tokens, top_k] the router chose (record mode).
        used: (micro-batch, layer) -> bool [tokens, num_experts] routing map of the forward
            (only with ``capture=True``).
        recomputed: (micro-batch, layer) -> bool routing map of the recompute (``capture=True``).
        forwards, recomputes: layer -> number of router forwards / recomputes.
    """

    differ: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    recorded: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    used: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    recomputed: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    forwards: Counter = field(default_factory=Counter)
    recomputes: Counter = field(default_factory=Counter)

    def metrics(
        self, num_layers: int, group: torch.distributed.ProcessGroup | None = None
    ) -> dict[str, float]:
        """Fraction of real tokens whose replayed experts differ from the trainer's own top-k.

        Counts are summed over ``group`` (default: the whole world when torch.distributed is
        initialised): sequence-parallel shards, data-parallel replicas and pipeline stages
        (disjoint layers) all add up correctly; a collective, so every rank must call it.

        Returns:
            ``{"r3_topk_differ": overall, "r3_topk_differ_layer{n}": per MoE layer}``, fractions
            in [0, 1]; layers without audited tokens (dense, or not audited) are left out.
        """
        device = "cpu"
        if torch.distributed.is_initialized() and torch.distributed.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        counts = torch.zeros(num_layers + 1, 2, dtype=torch.float64, device=device)
        for layer, differ in self.differ.items():
            counts[layer, 0] += differ.to(device)
            counts[layer, 1] += self.tokens[layer].to(device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=group)
        counts = counts.cpu()
        out = {}
        for layer in range(1, num_layers + 1):
            if counts[layer, 1] > 0:
                out[f"r3_topk_differ_layer{layer}"] = float(counts[layer, 0] / counts[layer, 1])
        total = counts[:, 1].sum()
        if total > 0:
            out["r3_topk_differ"] = float(counts[:, 0].sum() / total)
        return out


@dataclass
class _Call:
    """One router call in flight (between its pre-hook and its forward hook)."""

    phase: str  # "forward" or "recompute"
    micro_batch: int
    real: torch.Tensor | None
    own: torch.Tensor | None = None
    replayed: torch.Tensor | None = None
    will_backward: bool = False
    checkpointed: bool = False


@dataclass
class _Queued:
    """One forward of a layer that a backward may recompute: its micro-batch, the target the
    recompute must replay (the very tensor in megatron-core's FIFO), and whether it ran inside
    a checkpoint (only those are recomputed)."""

    micro_batch: int
    target: torch.Tensor
    checkpointed: bool


def _checkpointing() -> bool:
    from megatron.core.tensor_parallel.random import is_checkpointing

    return bool(is_checkpointing())


def _decoder_blocks(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """megatron-core ``TransformerBlock`` modules of the decoder (none inside an MTP block)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    blocks = []
    for chunk in chunks:
        inside_mtp = _mtp_module_ids(chunk)
        for module in chunk.modules():
            if isinstance(module, TransformerBlock) and id(module) not in inside_mtp:
                blocks.append(module)
    return blocks


def _will_backward(grad_at_micro_batch: bool) -> bool:
    """Whether this router forward can be recomputed in a later backward: its micro-batch was
    entered with grad enabled, and it builds a graph or runs inside megatron-core's
    ``CheckpointFunction`` forward (no grad there, recomputed later). A forward under
    ``torch.no_grad()`` inside a training session is never backpropagated (megatron-core still
    routes it through the checkpoint function when recompute is on), so it must not enter the
    recompute FIFO, or a later recompute would pop its routes. Recompute through another
    checkpoint implementation finds no forward and raises; never silent."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return grad_at_micro_batch and (torch.is_grad_enabled() or is_checkpointing())


class RoutingReplay:
    """Replay or record controller for the MoE routers of one model (all its local chunks).

    Args:
        model: the live model on this rank: one module or a list of virtual-pipeline chunks,
            DDP-wrapped or not.

    Raises:
        ValueError: when a router cannot replay exactly (:func:`check_replayable`), two
            routers claim one layer number, or a router sits on a layer that the config's
            ``moe_layer_freq`` makes dense.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        from megatron.core import parallel_state

        chunks = list(model) if isinstance(model, Sequence) else [model]
        self.routers: dict[int, torch.nn.Module] = {}
        self.mtp_routers: dict[int, torch.nn.Module] = {}
        for chunk in chunks:
            for mapping, found in (
                (self.routers, find_routers(chunk)),
                (self.mtp_routers, find_mtp_routers(chunk)),
            ):
                for layer, router in found.items():
                    if layer in mapping:
                        raise ValueError(f"two model chunks hold a router for layer {layer}")
                    mapping[layer] = router
        for layer, router in self.routers.items():
            check_replayable(layer, router)
        self.layers: list[int] = sorted(self.routers)
        config = next(iter(self.routers.values())).config if self.routers else None
        if config is not None:
            # Routes are cut by layer number: a router on a layer the config calls dense would
            # read a dense layer's rows (SGLang's expert 0).
            not_moe = sorted(set(self.layers) - set(moe_layer_numbers(config)))
            if not_moe:
                raise ValueError(
                    f"routers on layers {not_moe}, which moe_layer_freq "
                    f"{config.moe_layer_freq!r} makes dense"
                )
        self.num_layers = config.num_layers if config else None
        self.sequence_parallel = bool(config and config.sequence_parallel)
        tp_ready = parallel_state.model_parallel_is_initialized()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_ready else 0
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size() if tp_ready else 1
        self._layer_of = {id(r): layer for layer, r in self.routers.items()}
        self._mode: str | None = None
        self._training = False
        self._audit = False
        self._capture = False
        self._routes: Mapping[int, MicroBatchRoutes] = {}
        self._current: int | None = None
        self._grad_at_micro_batch = False
        self._calls: dict[int, _Call] = {}
        self._ledger: dict[int, list[_Queued]] = {}
        self._queued: Counter = Counter()
        # Decoder blocks (not MTP) and, per router, the block holding it: the block's output
        # gradient hook says whose backward is running in it (see the module docstring).
        self._blocks = _decoder_blocks(chunks)
        self._block_of: dict[int, int] = {}
        for block in self._blocks:
            for module in block.modules():
                if id(module) in self._layer_of:
                    self._block_of[self._layer_of[id(module)]] = id(block)
        self._backward_mb: dict[int, int] = {}
        self._ids_checked = False
        self._structure_checked: set[int] = set()
        self._report = ReplayReport()

    # -- targets ---------------------------------------------------------------------------
    def routes_for(
        self, routes: torch.Tensor, real: torch.Tensor | None = None
    ) -> MicroBatchRoutes:
        """This rank's :class:`MicroBatchRoutes` from a micro-batch's routes in the model's
        input layout: this stage's layers, this TP rank's sequence shard under SP, int64 on the
        routers' device (the compact routes are copied there once, then cut and widened).

        Args:
            routes: [B, S, L, K] expert ids (any integer dtype), L = all decoder layers.
            real: bool [B, S], True where the routes came from the rollout engine, or None.

        Raises:
            ValueError: as :func:`megatron_sat.routing.slicing.router_targets`.
        """
        from megatron_sat.routing.slicing import router_token_order

        if self.num_layers is None:
            return MicroBatchRoutes(targets={}, real=None)
        coords = dict(
            tp_rank=self.tp_rank, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel
        )
        device = self.routers[self.layers[0]].weight.device
        routes = routes.to(device, non_blocking=True)  # compact ids: one small copy
        targets = router_targets(routes, self.layers, num_layers=self.num_layers, **coords)
        return MicroBatchRoutes(
            targets=targets,
            real=None if real is None else router_token_order(real.to(device).bool(), **coords),
        )

    # -- sessions --------------------------------------------------------------------------
    @contextlib.contextmanager
    def replay(
        self,
        routes: Mapping[int, MicroBatchRoutes],
        *,
        training: bool = True,
        audit: bool = True,
        capture: bool = False,
        ids_checked: bool = False,
    ) -> Iterator[ReplayReport]:
        """Replay ``routes[micro_batch].targets[layer]`` in every router for the block inside.

        Args:
            routes: micro-batch index -> its :class:`MicroBatchRoutes`; each must hold a target
                for exactly the layers of :attr:`layers` (this rank's stage).
            training: True when backward passes (and so recomputes) run inside; False for
                forward-only passes (a recompute then raises).
            audit: compare the trainer's own top-k with the replayed experts (report.differ).
            capture: keep every routing map actually used (report.used / report.recomputed).
            ids_checked: the caller already checked the expert ids on the host (in range,
                distinct within a token: ``training.batching.check_sample_routes`` for every
                sample of a step); the ids are then not checked again here, which would read
                one flag back from the device per session (a host synchronisation per
                micro-batch). Shapes and dtypes are always checked, then per micro-batch
                when it first runs: ``routes`` is read lazily, so a mapping may build each
                micro-batch's targets on demand (``training.passes.LazyRoutes``).

        Yields:
            The :class:`ReplayReport` filled during the block.

        Raises:
            ValueError: on a missing or extra layer for a micro-batch (naming both), a target
                whose shape, dtype or ids do not fit its router, or a router call whose token
                count differs from its target's.
            RuntimeError: when a router runs outside :meth:`micro_batch`, a recompute runs
                outside a tagged decoder block's backward or finds no checkpointed forward of
                its micro-batch and layer, two micro-batches' backwards interleave in one
                block, or a layer was recomputed for some forwards but not all.
        """
        if ids_checked:  # structure checked per micro-batch as it runs (``_pre_hook``)
            with self._session("replay", training, audit, capture, routes, True) as report:
                yield report
            return
        flags = {}
        for mb, mb_routes in routes.items():
            flags |= self._check_structure(mb, mb_routes, ids=True)
        flags = {key: flag for key, flag in flags.items() if flag is not None}
        device = next(iter(flags.values())).device if flags else None
        if flags and bool(torch.stack([f.to(device) for f in flags.values()]).any()):
            for (mb, layer), flag in flags.items():
                if bool(flag):
                    self._name_bad_target(mb, layer, routes[mb].targets[layer])
        with self._session("replay", training, audit, capture, routes) as report:
            yield report

    def _check_structure(
        self, mb: int, mb_routes: MicroBatchRoutes, *, ids: bool
    ) -> dict[tuple[int, int], torch.Tensor | None]:
        """Raise ValueError on a missing or extra layer or a target's shape or dtype; with
        ``ids``, also return per layer the 0-dim flag of ``_check_target`` (read by the caller)."""
        missing = sorted(set(self.layers) - set(mb_routes.targets))
        extra = sorted(set(mb_routes.targets) - set(self.layers))
        if missing or extra:
            raise ValueError(
                f"routing replay targets of micro-batch {mb} do not match this rank's MoE "
                f"layers {self.layers}: missing {missing}, not in this model (or pipeline "
                f"stage) {extra}"
            )
        return {
            (mb, layer): self._check_target(mb, layer, target, mb_routes.real, ids=ids)
            for layer, target in mb_routes.targets.items()
        }

    @contextlib.contextmanager
    def record(self, *, training: bool = True, capture: bool = False) -> Iterator[ReplayReport]:
        """Record the experts every router chooses (report.recorded[(micro_batch, layer)]).

        In training, a recompute replays exactly what its forward recorded. Arguments and
        errors as :meth:`replay`.
        """
        with self._session("record", training, False, capture, {}) as report:
            yield report

    @contextlib.contextmanager
    def micro_batch(self, index: int) -> Iterator[None]:
        """Mark the forward inside as micro-batch ``index`` (call it in the forward step, inside
        any ``torch.no_grad()``: a micro-batch entered without grad is never queued for
        recompute).

        Raises:
            RuntimeError: outside a session, or when nested.
            ValueError: in replay mode, for a micro-batch without routes.
        """
        if self._mode is None:
            raise RuntimeError("micro_batch() outside a replay/record session")
        if self._current is not None:
            raise RuntimeError(f"micro_batch({index}) inside micro_batch({self._current})")
        if self._mode == "replay" and index not in self._routes:
            raise ValueError(
                f"no routing replay targets for micro-batch {index} (have {sorted(self._routes)})"
            )
        self._current = index
        self._grad_at_micro_batch = torch.is_grad_enabled()
        try:
            yield
        finally:
            self._current = None

    # -- internals -------------------------------------------------------------------------
    def _check_target(
        self, mb: int, layer: int, target: torch.Tensor, real: torch.Tensor | None, *, ids: bool
    ) -> torch.Tensor | None:
        """Check shape and dtype now; with ``ids`` return a 0-dim bool tensor, True when an id
        is out of range or repeated within a token's top-k (checked for all targets with one
        device sync in :meth:`replay`, then named by :meth:`_name_bad_target`)."""
        router = self.routers[layer]
        top_k = router.topk
        where = f"routing replay target of micro-batch {mb}, layer {layer}"
        if target.dim() != 2 or target.shape[1] != top_k:
            raise ValueError(
                f"{where} has shape {tuple(target.shape)}; expected [num_tokens, top_k={top_k}]"
            )
        if target.dtype != torch.int64:
            raise ValueError(f"{where} has dtype {target.dtype}; expected torch.int64")
        if real is not None and real.shape != (target.shape[0],):
            raise ValueError(
                f"{where}: real mask has shape {tuple(real.shape)}, target {target.shape[0]} rows"
            )
        if not ids or not target.numel():
            return None
        bad = (target < 0) | (target >= router.config.num_moe_experts)
        if top_k > 1:
            ordered = target.sort(dim=1).values
            return bad.any() | (ordered[:, 1:] == ordered[:, :-1]).any()
        return bad.any()

    def _name_bad_target(self, mb: int, layer: int, target: torch.Tensor) -> None:
        num_experts = self.routers[layer].config.num_moe_experts
        where = f"routing replay target of micro-batch {mb}, layer {layer}"
        if int(target.min()) < 0 or int(target.max()) >= num_experts:
            raise ValueError(f"{where} holds expert ids outside [0, {num_experts})")
        raise ValueError(f"{where} repeats an expert within a token's top-k")

    @contextlib.contextmanager
    def _session(
        self, mode, training, audit, capture, routes, ids_checked=False
    ) -> Iterator[ReplayReport]:
        if self._mode is not None:
            raise RuntimeError(f"a {self._mode} session is already open on this model")
        self._ids_checked = ids_checked
        self._mode, self._training, self._audit, self._capture = mode, training, audit, capture
        self._routes = routes
        self._report = ReplayReport()
        self._ledger = {layer: [] for layer in self.layers}
        self._queued = Counter()
        self._calls = {}
        self._backward_mb = {}
        self._structure_checked = set()
        self._reset_routers()
        handles = []
        if training:
            for block in self._blocks:
                handles.append(block.register_forward_hook(self._block_post_hook))
        for layer, router in self.routers.items():
            handles.append(router.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            handles.append(router.register_forward_hook(self._post_hook))
            self._wrap_topk(layer, router.router_replay)
        clean = False
        try:
            yield self._report
            clean = True
        finally:
            for handle in handles:
                handle.remove()
            for router in self.routers.values():
                vars(router.router_replay).pop("get_replay_topk", None)
            self._reset_routers()
            self._mode, self._routes, self._current, self._calls = None, {}, None, {}
        if clean and training:
            for layer in self.layers:
                queued = self._queued[layer]
                recomputes = self._report.recomputes[layer]
                if recomputes not in (0, queued):
                    raise RuntimeError(
                        f"layer {layer}: {queued} router forwards to backpropagate but "
                        f"{recomputes} recomputes; recompute must cover every forward of a "
                        "layer or none"
                    )

    def _reset_routers(self) -> None:
        for router in [*self.routers.values(), *self.mtp_routers.values()]:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _wrap_topk(self, layer: int, replay) -> None:
        """Shadow this instance's ``get_replay_topk`` for the session: same result, plus the
        trainer's own top-k on the same scores when auditing a replayed forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default=None):
            call = self._calls.get(layer)
            action = replay.router_replay_action
            probs, indices = original(scores, topk, num_groups, group_topk, default)
            if call is not None and call.phase == "forward" and self._audit:
                if action == RouterReplayAction.REPLAY_FORWARD:
                    with torch.no_grad():
                        _, own = default(
                            scores.detach(), topk, num_groups=num_groups, group_topk=group_topk
                        )
                    call.own, call.replayed = own, indices
            return probs, indices

        replay.get_replay_topk = get_replay_topk

    def _pre_hook(self, router, args, kwargs):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        layer = self._layer_of[id(router)]
        replay = router.router_replay
        hidden = args[0] if args else kwargs["input"]
        num_tokens = hidden.numel() // hidden.shape[-1]
        if torch._C._current_autograd_node() is not None:  # inside a backward: a recompute
            if not self._training:
                raise RuntimeError(
                    f"layer {layer} was recomputed inside a forward-only session "
                    "(open it with training=True)"
                )
            if not self._ledger[layer]:
                raise RuntimeError(f"recompute of layer {layer} has no recorded forward to reuse")
            mb, target = self._recompute_target(layer, replay)
            self._check_tokens(mb, layer, target, num_tokens)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            self._calls[layer] = _Call("recompute", mb, None)
            self._report.recomputes[layer] += 1
            return None
        mb = self._current
        if mb is None:
            raise RuntimeError(
                f"router of layer {layer} ran outside RoutingReplay.micro_batch(...) while a "
                f"{self._mode} session is open"
            )
        real = None
        if self._mode == "replay":
            mb_routes = self._routes[mb]
            if self._ids_checked and mb not in self._structure_checked:
                self._check_structure(mb, mb_routes, ids=False)
                self._structure_checked.add(mb)
            target = mb_routes.targets[layer]
            real = mb_routes.real
            self._check_tokens(mb, layer, target, num_tokens)
            if self._training and _will_backward(self._grad_at_micro_batch):
                replay.set_target_indices(target)  # also appends to the backward FIFO
                self._ledger[layer].append(_Queued(mb, target, _checkpointing()))
                self._queued[layer] += 1
            else:
                replay.target_topk_idx = target
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        self._calls[layer] = _Call(
            "forward",
            mb,
            real,
            will_backward=_will_backward(self._grad_at_micro_batch),
            checkpointed=_checkpointing(),
        )
        self._report.forwards[layer] += 1
        return None

    def _post_hook(self, router, args, output):
        layer = self._layer_of[id(router)]
        replay = router.router_replay
        call = self._calls.pop(layer)
        replay.clear_router_replay_action()
        key = (call.micro_batch, layer)
        if call.phase == "recompute":
            if self._capture:
                self._report.recomputed[key] = output[1].detach()
            return
        if self._mode == "record":
            recorded = replay.get_recorded_indices().detach()
            self._report.recorded[key] = recorded
            if self._training and call.will_backward:
                replay.replay_backward_list.append(recorded)
                self._ledger[layer].append(_Queued(call.micro_batch, recorded, call.checkpointed))
                self._queued[layer] += 1
        if self._capture:
            self._report.used[key] = output[1].detach()
        if call.own is not None:
            differ = (call.own.sort(dim=1).values != call.replayed.sort(dim=1).values).any(dim=1)
            if call.real is not None:
                real = call.real.to(differ.device)
                differ, count = differ & real, real.sum()
            else:
                count = torch.tensor(differ.numel(), device=differ.device)
            report = self._report
            report.differ[layer] = report.differ.get(layer, 0) + differ.sum()
            report.tokens[layer] = report.tokens.get(layer, 0) + count

    def _block_post_hook(self, block, args, output):
        """Tag a decoder block's output so its gradient names the micro-batch whose backward
        enters the block (it runs before any recompute inside the block)."""
        hidden = output[0] if isinstance(output, tuple) else output
        mb = self._current
        if mb is None or not torch.is_tensor(hidden) or not hidden.requires_grad:
            return None
        block_id = id(block)

        def backward_begins(grad):
            previous = self._backward_mb.get(block_id)
            if previous is not None and previous != mb and self._pending(block_id, previous):
                raise RuntimeError(
                    f"the backwards of micro-batches {min(previous, mb)} and "
                    f"{max(previous, mb)} interleave in one decoder block: the routes of their "
                    "recomputes cannot be told apart (backpropagate one micro-batch at a time)"
                )
            self._backward_mb[block_id] = mb
            return None

        hidden.register_hook(backward_begins)
        return None

    def _pending(self, block_id: int, mb: int) -> bool:
        """Whether micro-batch ``mb`` still has a checkpointed forward of the block to recompute."""
        return any(
            entry.micro_batch == mb and entry.checkpointed
            for layer, entries in self._ledger.items()
            if self._block_of.get(layer) == block_id
            for entry in entries
        )

    def _recompute_target(self, layer: int, replay) -> tuple[int, torch.Tensor]:
        """The micro-batch being backpropagated through ``layer``'s block and its target for
        the layer, moved to the head of megatron-core's FIFO (which ``REPLAY_BACKWARD`` pops).

        Raises:
            RuntimeError: when no tagged backward is running in the block, or that micro-batch
                has no checkpointed forward of the layer left, or the FIFO lost the target.
        """
        mb = self._backward_mb.get(self._block_of.get(layer))
        if mb is None:
            raise RuntimeError(
                f"recompute of layer {layer} outside the backward of a decoder block's output: "
                "cannot tell which micro-batch's routes to replay"
            )
        entries = self._ledger[layer]
        index = next(
            (i for i, e in enumerate(entries) if e.micro_batch == mb and e.checkpointed), None
        )
        if index is None:
            raise RuntimeError(
                f"recompute of layer {layer} in the backward of micro-batch {mb}, which has no "
                "checkpointed forward of this layer left to recompute"
            )
        target = entries.pop(index).target
        fifo = replay.replay_backward_list
        position = next((i for i, t in enumerate(fifo) if t is target), None)
        if position is None:
            raise RuntimeError(
                f"recompute of layer {layer} (micro-batch {mb}): megatron-core's backward FIFO "
                "no longer holds this session's target"
            )
        fifo.insert(0, fifo.pop(position))
        return mb, target

    def _check_tokens(self, mb: int, layer: int, target: torch.Tensor, num_tokens: int) -> None:
        if target.shape[0] != num_tokens:
            raise ValueError(
                f"routing replay target of micro-batch {mb}, layer {layer} has "
                f"{target.shape[0]} rows but the router sees {num_tokens} tokens on this rank "
                f"(TP rank {self.tp_rank} of {self.tp_size}, sequence_parallel="
                f"{self.sequence_parallel})"
            )


@contextlib.contextmanager
def replay_routing(
    model: torch.nn.Module, targets: Mapping[int, torch.Tensor], *, training: bool = True
) -> Iterator[ReplayReport]:
    """Replay ``targets`` in every decoder MoE router of ``model`` for one micro-batch.

    A one-micro-batch :class:`RoutingReplay` session for code that runs the forward itself.

    Args:
        model: the live megatron-core model on this rank (DDP-wrapped or not).
        targets: global layer number -> int64 [num_tokens, top_k] in the router's token order
            (:func:`megatron_sat.routing.slicing.router_targets`).
        training: as :meth:`RoutingReplay.replay`.

    Raises:
        ValueError: if a router of the model has no target (never a silent fall-back to live
            routing), a target names a layer the model does not hold, a router cannot replay
            exactly (:func:`check_replayable`), or a target has the wrong shape or ids.
    """
    controller = RoutingReplay(model)
    with controller.replay({0: MicroBatchRoutes(targets)}, training=training) as report:
        with controller.micro_batch(0):
            yield report


@contextlib.contextmanager
def capture_routing(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Collect the experts each decoder router actually used, whatever the replay mode.

    Yields a dict filled during the block: global layer number -> bool routing map
    [num_tokens, num_experts] of the last forward through that router (detached). Used to
    verify replay and to measure how often the trainer's own top-k agrees with the rollout's.
    """
    routers = find_routers(model)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer, router in routers.items():

        def hook(module, args, output, layer=layer):
            captured[layer] = output[1].detach()

        handles.append(router.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
