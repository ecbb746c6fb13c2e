"""Trainer side of the weight push to vLLM servers, through vLLM 0.32's weight-transfer API.

Same interface as :class:`megatron_sat.weight_sync.broadcast.WeightUpdater` (``connect``,
``update(named_tensors, weight_version)``, ``close``; the same constructor options), so the
fleet and the RL loop use either. Backends: ``"gloo"`` is ours, ``megatron_sat_gloo``
(:mod:`megatron_sat.rollout.vllm.gloo_engine`, registered in the servers through the
``vllm.general_plugins`` entry point of tools/vllm_plugin; the group is built as
``weight_sync.group`` builds it); ``"nccl"`` is vLLM's own ``nccl`` backend (GPUs), whose
trainer end is vLLM's ``nccl_common.trainer_init`` (a ``PyNcclCommunicator``), so the
trainer's environment needs vllm installed for it. The NCCL path cannot run on these CPU
machines and has not been run.

One ``update``:

1. ``/pause?mode=`` on every server (SGLang's mode names map as
   ``client.SGLANG_TO_VLLM_PAUSE``), then ``/start_weight_update``.
2. Tensors are grouped into buckets of whole layers (consecutive tensors sharing the prefix
   up to the first integer segment, ``model.layers.3``; other tensors by their module), at most
   ``bucket_bytes`` each unless one layer is larger; each bucket ordered by element size
   (``pack_order``). Per bucket ``/update_weights`` (``names``, ``dtype_names``, ``shapes``) is
   posted to every server while rank 0 broadcasts the bucket: gloo, one flat uint8 tensor;
   nccl, one broadcast per tensor (vLLM's ``packed: false``).
3. ``/finish_weight_update`` with ``weight_version``: the version is set only here, after the
   last bucket; ``/reset_prefix_cache`` (its KV blocks came from the old weights, and vLLM's
   pause no longer clears them; not for pause modes keep / in_place, which keep the paused
   requests' KV on purpose); then ``/resume``.

Failures: a server that rejects a bucket ends its session itself (vLLM's worker, and the gloo
engine's layerwise-reload clean-up); every other server whose session is still open gets
``/finish_weight_update`` without a version, so none is left inside a session; the version
stays the old one everywhere. If no bucket loaded anywhere, generation resumes and
``WeightSyncError`` is raised; otherwise the servers hold whole layers of new weights next to
old ones under the old version, so they stay paused and ``WeightSyncError`` says so: retry
``update`` (a retry that succeeds resumes them).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from megatron_sat.rollout.vllm.args import VLLM_BACKENDS
from megatron_sat.weight_sync.broadcast import pack_order
from megatron_sat.weight_sync.channel import UpdateChannel
from megatron_sat.weight_sync.updater import BaseWeightUpdater, UpdateStats, WeightSyncError


class VLLMUpdateChannel(UpdateChannel, Protocol):
    """vLLM 0.32's weight-transfer session (``rollout.vllm.client.VLLMClient`` has it)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...


def layer_key(name: str) -> str:
    """The layer an HF tensor belongs to: the name up to its first integer segment
    (``model.layers.3.mlp.experts.7.up_proj.weight`` -> ``model.layers.3``), else its module
    (``model.norm.weight`` -> ``model.norm``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name.rpartition(".")[0]


def layer_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive buckets of whole layers (``layer_key``), at most ``bucket_bytes`` each
    unless a single layer is larger (it then travels alone), lazily (one layer ahead)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    layer: list[tuple[str, torch.Tensor]] = []
    size = layer_size = 0
    key = None
    for name, tensor in named_tensors:
        if layer and layer_key(name) != key:
            if bucket and size + layer_size > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket += layer
            size += layer_size
            layer, layer_size = [], 0
        key = layer_key(name)
        layer.append((name, tensor))
        layer_size += tensor.numel() * tensor.element_size()
    if bucket and size + layer_size > bucket_bytes:
        yield bucket
        bucket = []
    bucket += layer
    if bucket:
        yield bucket


class VLLMWeightUpdater(BaseWeightUpdater):
    """Pushes HF-named tensors from trainer rank 0 to vLLM servers (module docstring).

    Args:
        clients: one channel per server.
        master_address: the trainer's address as the servers see it.
        master_port: the group's TCP port; None lets the OS choose.
        group_name: gloo group name; default a fresh ``megatron_sat_vllm_<hex>``.
        backend: "gloo" (CPU, our backend) or "nccl" (GPU, vLLM's).
        bucket_bytes: bucket size limit, bytes.
        ranks_per_server: workers per server (TP x PP); default 1.
        pause_mode: SGLang's or vLLM's pause mode (``VLLMClient.pause_generation``).
        timeout_s: rendezvous and broadcast timeout, seconds.
        flatten_buckets: accepted for ``WeightUpdater``'s options; gloo always sends one flat
            tensor per bucket, nccl one broadcast per tensor.
    """

    group_prefix = "megatron_sat_vllm_"
    thread_name = "vllm_weight_sync"
    calls = {
        "join": "init_weight_transfer_engine",
        "pause": "pause",
        "begin": "start_weight_update",
        "end": "finish_weight_update",
        "resume": "resume",
        "leave": "shutdown_weight_transfer_engine",
    }

    def __init__(
        self,
        clients: Sequence[VLLMUpdateChannel],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = 512 * 2**20,
        *,
        ranks_per_server: Sequence[int] | None = None,
        pause_mode: str = "retract",
        timeout_s: float = 600.0,
        flatten_buckets: bool = True,
    ) -> None:
        del flatten_buckets
        if clients and backend not in VLLM_BACKENDS:
            raise ValueError(f"backend must be one of {sorted(VLLM_BACKENDS)}, got {backend!r}")
        if backend == "nccl" and not master_port and clients:
            # vLLM's nccl rendezvous (StatelessProcessGroup) needs the port up front.
            with socket.socket() as sock:
                sock.bind((master_address, 0))
                master_port = sock.getsockname()[1]
        super().__init__(
            clients,
            master_address,
            master_port,
            group_name,
            backend,
            bucket_bytes,
            ranks_per_server=ranks_per_server,
            pause_mode=pause_mode,
            timeout_s=timeout_s,
        )
        self._staging: torch.Tensor | None = None
        self._version: str | None = None

    # -- vLLM's calls -------------------------------------------------------------------------
    def _host_store(self) -> Any:
        return super()._host_store() if self.backend == "gloo" else None

    def _rank0_group(self, port: int, store: Any) -> Any:
        if self.backend == "gloo":
            return super()._rank0_group(port, store)
        # vLLM's own trainer end of its nccl backend
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        return trainer_init(
            {
                "master_address": self.master_address,
                "master_port": port,
                "world_size": self.world_size,
            }
        )

    def _join(self, channel: VLLMUpdateChannel, port: int, rank_offset: int) -> None:
        info: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
        }
        if self.backend == "gloo":
            info.update(group_name=self.group_name, timeout_s=self.timeout_s)
        else:
            info["packed"] = False
        channel.init_weight_transfer_engine(info)

    def _begin(self, channel: VLLMUpdateChannel) -> None:
        channel.start_weight_update()

    def _end(self, channel: VLLMUpdateChannel, weight_version: str | None) -> None:
        channel.finish_weight_update(weight_version)

    def _after_sessions(self) -> None:
        if self.pause_mode not in ("keep", "in_place"):  # those keep their KV on purpose
            self._on_servers("reset_prefix_cache", self.clients, lambda c: c.flush_cache())

    def _leave(self, channel: VLLMUpdateChannel) -> None:
        channel.shutdown_weight_transfer_engine()

    def _release_staging(self) -> None:
        self._staging = None

    # -- one update ---------------------------------------------------------------------------
    def send_buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None
    ) -> UpdateStats:
        """Step 2: the layer buckets (module docstring); vLLM sets ``weight_version`` when the
        sessions finish (``end_update``), so it is not sent here.

        Raises:
            ValueError: on no tensors or a repeated name.
            WeightSyncError: a server rejected a bucket or the broadcast failed.
        """
        self._version = weight_version  # for the retry advice of a failure
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        seen: set[str] = set()
        for bucket in layer_buckets(named_tensors, self.bucket_bytes):
            bucket = pack_order(bucket)
            for name, _ in bucket:
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears twice in one update")
                seen.add(name)
            failed = self._send_bucket(bucket)
            self._loaded |= len(failed) < len(self.clients)
            if failed:
                raise WeightSyncError("update_weights failed:\n" + "\n".join(failed))
            num_buckets += 1
            num_tensors += len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if num_buckets == 0:
            raise ValueError("update() got no tensors")
        return UpdateStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def _end_failed(self, error: WeightSyncError) -> None:
        self._fail(error, loaded=True)

    def _fail(self, error: BaseException, loaded: bool) -> None:
        """Sessions still open are finished without a version (best effort: a server that
        cannot is reported by the next ``start_weight_update``); generation resumes when no
        bucket loaded, else the servers stay paused. Errors other than ``WeightSyncError``
        and ``ValueError`` propagate as they are."""
        if not isinstance(error, (WeightSyncError, ValueError)):
            raise error
        open_, self._open = self._open, []
        for future in [self._pool.submit(c.finish_weight_update, None) for c in open_]:
            future.exception()
        if not loaded:
            try:
                self._on_servers("resume", self.clients, lambda c: c.continue_generation())
            except WeightSyncError as resume_error:
                raise WeightSyncError(f"{error}\nresuming afterwards: {resume_error}") from error
            if isinstance(error, ValueError):
                raise error
            raise WeightSyncError(
                f"{error}\nno bucket was loaded: weights and weight_version are unchanged, "
                "generation resumed"
            ) from error
        raise WeightSyncError(
            f"{error}\nsome buckets were loaded: the servers hold whole layers of new weights "
            f"next to old ones under their old weight_version and stay paused; retry "
            f"update({self._version!r})"
        ) from error

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
        """One bucket to every server; the failure lines (servers that failed end their
        session, so they leave ``_open``)."""
        info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
        }
        futures = [self._pool.submit(c.update_weights, info) for c in self.clients]
        broadcast_error = None
        try:
            if self.backend == "gloo":
                flat = self._pack([t for _, t in bucket])
                work = self._group.broadcast(flat, src=0, async_op=True)
                # A server that refuses the bucket before receiving it never joins the
                # broadcast: surface that instead of waiting for the group's timeout.
                while not work.is_completed():
                    if any(f.done() and f.exception() is not None for f in futures):
                        raise RuntimeError("a server refused the bucket before receiving it")
                    time.sleep(0.002)
                work.wait()
            else:
                stream = torch.cuda.current_stream()
                for _, tensor in bucket:
                    self._group.broadcast(tensor.contiguous(), src=0, stream=stream)
        except RuntimeError as e:
            broadcast_error = e
        failures = []
        for client, future in zip(self.clients, futures, strict=True):
            if broadcast_error is not None and not future.done():
                failures.append(f"  {client.base_url}: still receiving when the broadcast failed")
                continue
            try:
                future.result()
            except Exception as e:
                if client in self._open:
                    self._open.remove(client)
                failures.append(f"  {client.base_url}: {e}")
        if broadcast_error is not None:
            failures.append(
                f"  rank 0 broadcast failed ({broadcast_error!r}); the group may be unusable: "
                "close() and connect() again"
            )
        return failures

    def _pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Every tensor's bytes, in order, in (a prefix of) the reused staging buffer."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self._staging is None or self._staging.numel() < total:
            self._staging = None
            self._staging = torch.empty(total, dtype=torch.uint8)
        flat = self._staging[:total]
        torch.cat(
            [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors],
            out=flat,
        )
        return flat
