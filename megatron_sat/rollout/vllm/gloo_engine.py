"""Our weight-transfer backend for vLLM on CPU: a gloo group with the trainer, one broadcast
per bucket (vLLM's built-in backends, nccl / ipc / ..., are CUDA-only).

Runs inside vLLM's worker processes (the vLLM environment, tools/vllm_env.sh): vLLM's
``WeightTransferEngineFactory`` imports this module when a server is started with
``--weight-transfer-config '{"backend": "megatron_sat_gloo"}'``; the registration is the
``vllm.general_plugins`` entry point of tools/vllm_plugin. The trainer never imports it.

Protocol (vLLM 0.32's weight-transfer API, driven by
:class:`megatron_sat.rollout.vllm.updater.VLLMWeightUpdater`):

- ``/init_weight_transfer_engine`` ``{"init_info": GlooInitInfo}``: the worker joins the group
  built exactly as the trainer builds it (``megatron_sat.weight_sync.group``: TCPStore +
  PrefixStore(group_name)), as rank ``rank_offset`` + its TP rank.
- ``/start_weight_update``: vLLM's layerwise reload starts (the CPU MoE kernels repack
  ``w13``/``w2`` after loading, so checkpoint-format tensors cannot be copied in place; the
  reload buffers each layer's tensors and re-runs the layer's post-processing once it has all).
- ``/update_weights`` ``{"update_info": GlooUpdateInfo}`` per bucket, while the trainer
  broadcasts the bucket as one flat uint8 tensor (the tensors' bytes back to back in ``names``
  order; ordered by element size, largest first, as ``weight_sync.broadcast.pack_order`` does,
  every tensor starts at a multiple of its element size). The
  bytes are always received first, so a rejected bucket never leaves the trainer blocked in the
  broadcast; then every tensor is checked against the served checkpoint (name known, shape
  equal), and the bucket is rejected whole, naming each bad tensor, before any of it loads.
  A rejected bucket ends the layerwise reload here: layers that got all their tensors keep the
  new values, the others get their old tensors back (the trainer buckets whole decoder layers,
  so no layer is half-loaded), and vLLM ends the session; the weight version is untouched.
- ``/finish_weight_update`` ``{"weight_version": v}``: layerwise reload finalised, the CPU
  MoE prepacking re-run on the reloaded expert layers (``_repack_experts``: vLLM skips it on
  an update), then vLLM sets the version (only after the last bucket).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_sat.weight_sync.group import WeightUpdateGroup, create_weight_update_group

logger = logging.getLogger("megatron_sat.vllm.gloo_engine")

BACKEND_NAME = "megatron_sat_gloo"


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine`` for this backend.

    Attributes:
        master_address, master_port: the trainer's TCPStore.
        rank_offset: group rank of this server's first worker (trainer = 0).
        world_size: 1 + all workers of all servers.
        group_name: the group's name and store prefix (unique per group).
        timeout_s: rendezvous and broadcast timeout, seconds.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_s: float = 600.0


@dataclass(kw_only=True)
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of one ``/update_weights`` call: one bucket.

    Attributes:
        names: HF checkpoint names, in the order of the bucket's bytes.
        dtype_names: torch dtype names ("float32", "bfloat16", ...), one per tensor.
        shapes: one shape per tensor.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names, "
                f"{len(self.shapes)} shapes"
            )
        if not self.names:
            raise ValueError("update_info: empty bucket")


def _checkpoint_shapes(model_path: str) -> dict[str, list[int]] | None:
    """Name -> shape of every tensor of a local safetensors checkpoint (headers only), or None
    when ``model_path`` is not a local directory with safetensors files."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def layer_prefix(name: str) -> str:
    """``model.layers.3`` of any name inside decoder layer 3 (vLLM module or HF tensor)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM worker side of the trainer's gloo weight push (module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: WeightUpdateGroup | None = None
        self._expert_layers: set[str] = set()
        self.expected = _checkpoint_shapes(self.model_config.model)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.group is not None:
            # A trainer that restarted (or a fleet that regrouped) without shutting the old
            # group down: the old group has no live peer, so leave it and join the new one.
            logger.warning("leaving weight-update group %s for a new one", self.group.group_name)
            self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = create_weight_update_group(
            init_info.master_address,
            init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            group_name=init_info.group_name,
            backend="gloo",
            timeout_s=init_info.timeout_s,
        )
        logger.info("joined weight-update group %s as rank %d", init_info.group_name, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._expert_layers = set()
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._repack_experts()

    def _repack_experts(self) -> None:
        """Re-run the CPU MoE kernel's weight prepacking on every expert layer this update
        reloaded. vLLM 0.32's unquantized MoE method skips it on a weight update
        (``_setup_kernel`` calls ``fused_experts.process_weights_after_loading`` only when the
        kernel is first built), so the reloaded ``w13``/``w2`` would be served in checkpoint
        layout by a kernel that reads the prepacked one (measured: every expert tensor differs
        from a fresh server's after pushing the same weights). Layers not reloaded are already
        prepacked and are left alone."""
        touched = self._expert_layers
        for name, module in self.model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is None or not hasattr(module, "w13_weight"):
                continue
            if layer_prefix(name) in touched:
                kernel.fused_experts.process_weights_after_loading(module)
        self._expert_layers = set()

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which a CPU build lacks.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("init_weight_transfer_engine was not called")
        try:
            dtypes = [getattr(torch, name) for name in update_info.dtype_names]
            if not all(isinstance(d, torch.dtype) for d in dtypes):
                raise AttributeError
        except AttributeError:
            # Before the broadcast the bucket size is unknown: nothing can be received.
            raise ValueError(f"update_info: unknown dtype in {update_info.dtype_names}") from None
        offsets, total = [], 0  # the tensors' bytes back to back, no padding
        for dtype, shape in zip(dtypes, update_info.shapes, strict=True):
            offsets.append(total)
            total += dtype.itemsize * int(torch.Size(shape).numel())
        flat = torch.empty(total, dtype=torch.uint8)
        self.group.broadcast(flat, src=0)
        try:
            self._check(update_info)
            misaligned = [
                n for n, d, o in zip(update_info.names, dtypes, offsets) if o % d.itemsize
            ]
            if misaligned:
                raise ValueError(
                    f"bucket rejected: {misaligned} do not start at a multiple of their element "
                    "size (order a bucket by element size, largest first)"
                )
            tensors = []
            for name, dtype, shape, start in zip(
                update_info.names, dtypes, update_info.shapes, offsets, strict=True
            ):
                count = int(torch.Size(shape).numel()) * dtype.itemsize
                tensors.append((name, flat[start : start + count].view(dtype).view(shape)))
            self.model.load_weights(tensors)
            self._expert_layers |= {layer_prefix(n) for n in update_info.names if ".experts." in n}
        except BaseException:
            # vLLM ends the session on this error without finishing the layerwise reload;
            # finish it here so no layer stays on the meta device (module docstring).
            self.finish_weight_update()
            raise

    def _check(self, update_info: GlooUpdateInfo) -> None:
        if self.expected is None:
            return
        bad = []
        for name, shape in zip(update_info.names, update_info.shapes, strict=True):
            want = self.expected.get(name)
            if want is None:
                bad.append(f"{name}: not a tensor of the served checkpoint")
            elif list(shape) != list(want):
                bad.append(f"{name}: shape {list(shape)}, the checkpoint has {list(want)}")
        if bad:
            raise ValueError("bucket rejected (nothing of it loaded): " + "; ".join(bad))

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
