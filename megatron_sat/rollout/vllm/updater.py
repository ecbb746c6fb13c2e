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
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from megatron_sat.rollout.vllm.args import VLLM_BACKENDS
from megatron_sat.rollout.vllm.client import VLLMClient
from megatron_sat.weight_sync.broadcast import UpdateStats, WeightSyncError, pack_order
from megatron_sat.weight_sync.group import (
    WeightUpdateGroup,
    create_weight_update_group,
    host_store,
)


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


class VLLMWeightUpdater:
    """Pushes HF-named tensors from trainer rank 0 to vLLM servers (module docstring).

    Args:
        clients: one client per server.
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

    def __init__(
        self,
        clients: Sequence[VLLMClient],
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
        if not clients:
            raise ValueError("clients must not be empty")
        if backend not in VLLM_BACKENDS:
            raise ValueError(f"backend must be one of {sorted(VLLM_BACKENDS)}, got {backend!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.ranks_per_server = list(ranks_per_server or [1] * len(clients))
        if len(self.ranks_per_server) != len(clients) or min(self.ranks_per_server) < 1:
            raise ValueError(f"ranks_per_server {self.ranks_per_server} for {len(clients)} servers")
        if backend == "nccl" and not master_port:
            # vLLM's nccl rendezvous (StatelessProcessGroup) needs the port up front.
            with socket.socket() as sock:
                sock.bind((master_address, 0))
                master_port = sock.getsockname()[1]
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"megatron_sat_vllm_{uuid.uuid4().hex[:8]}"
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.world_size = 1 + sum(self.ranks_per_server)
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="vllm_weight_sync")
        self._group: WeightUpdateGroup | Any | None = None
        self._staging: torch.Tensor | None = None

    def __enter__(self) -> VLLMWeightUpdater:
        self.connect()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    # -- set-up -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the group with every server's workers (blocks until all joined).

        Raises:
            WeightSyncError: naming each server that failed to join.
        """
        if self._group is not None:
            raise RuntimeError("VLLMWeightUpdater is already connected")
        offsets = [1 + sum(self.ranks_per_server[:i]) for i in range(len(self.clients))]
        store = None
        if self.backend == "gloo":
            store = host_store(
                self.master_address, self.master_port or 0, self.world_size, self.timeout_s
            )
            port = store.port
        else:
            port = self.master_port

        def init_info(offset: int) -> dict[str, Any]:
            info: dict[str, Any] = {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": offset,
                "world_size": self.world_size,
            }
            if self.backend == "gloo":
                info.update(group_name=self.group_name, timeout_s=self.timeout_s)
            else:
                info["packed"] = False
            return info

        futures = [
            self._pool.submit(c.init_weight_transfer_engine, init_info(offset))
            for c, offset in zip(self.clients, offsets, strict=True)
        ]
        built: dict[str, Any] = {}

        def build() -> None:
            try:
                if self.backend == "gloo":
                    built["group"] = create_weight_update_group(
                        self.master_address,
                        port,
                        rank=0,
                        world_size=self.world_size,
                        group_name=self.group_name,
                        backend="gloo",
                        timeout_s=self.timeout_s,
                        store=store,
                    )
                else:  # vLLM's own trainer end of its nccl backend
                    from vllm.distributed.weight_transfer.nccl_common import trainer_init

                    built["group"] = trainer_init(
                        {
                            "master_address": self.master_address,
                            "master_port": port,
                            "world_size": self.world_size,
                        }
                    )
            except Exception as e:
                built["error"] = e

        # Rank 0 joins on a daemon thread so a server that refuses to join fails connect() now.
        thread = threading.Thread(target=build, name="vllm_weight_group_rank0", daemon=True)
        thread.start()
        self._raise_failures("init_weight_transfer_engine", futures)
        thread.join()
        if "error" in built:
            raise WeightSyncError(f"rank 0 failed to join {self.group_name!r}: {built['error']!r}")
        self._group = built["group"]

    # -- one update ---------------------------------------------------------------------------
    def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str
    ) -> UpdateStats:
        """Push every tensor and set ``weight_version`` with the last bucket.

        Raises:
            ValueError: on an empty update, an empty version or a repeated name.
            WeightSyncError: when a server rejects a bucket or a call fails (module docstring).
        """
        if self._group is None:
            raise RuntimeError("call connect() before update()")
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string")
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        loaded_somewhere = False
        open_sessions: set[int] = set()
        try:
            self._on_all("pause", lambda c: c.pause_generation(self.pause_mode))
            futures = [self._pool.submit(c.start_weight_update) for c in self.clients]
            for i, future in enumerate(futures):
                if future.exception() is None:
                    open_sessions.add(i)
            self._raise_failures("start_weight_update", futures)
            seen: set[str] = set()
            for bucket in layer_buckets(named_tensors, self.bucket_bytes):
                bucket = pack_order(bucket)
                for name, _ in bucket:
                    if name in seen:
                        raise ValueError(f"tensor {name!r} appears twice in one update")
                    seen.add(name)
                failed = self._send_bucket(bucket, open_sessions)
                loaded_somewhere |= len(failed) < len(self.clients)
                if failed:
                    raise WeightSyncError("update_weights failed:\n" + "\n".join(failed))
                num_buckets += 1
                num_tensors += len(bucket)
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if num_buckets == 0:
                raise ValueError("update() got no tensors")
            futures = [
                self._pool.submit(c.finish_weight_update, weight_version) for c in self.clients
            ]
            for i, future in enumerate(futures):
                if future.exception() is None:
                    open_sessions.discard(i)
            self._raise_failures("finish_weight_update", futures)
            if self.pause_mode not in ("keep", "in_place"):  # those keep their KV on purpose
                self._on_all("reset_prefix_cache", lambda c: c.flush_cache())
            self._on_all("resume", lambda c: c.continue_generation())
        except (WeightSyncError, ValueError) as e:
            self._end_sessions(open_sessions)
            if not loaded_somewhere:
                try:
                    self._on_all("resume", lambda c: c.continue_generation())
                except WeightSyncError as resume_error:
                    raise WeightSyncError(f"{e}\nresuming afterwards: {resume_error}") from e
                if isinstance(e, ValueError):
                    raise
                raise WeightSyncError(
                    f"{e}\nno bucket was loaded: weights and weight_version are unchanged, "
                    "generation resumed"
                ) from e
            raise WeightSyncError(
                f"{e}\nsome buckets were loaded: the servers hold whole layers of new weights "
                f"next to old ones under their old weight_version and stay paused; retry "
                f"update({weight_version!r})"
            ) from e
        return UpdateStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def _send_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], open_sessions: set[int]
    ) -> list[str]:
        """One bucket to every server; the failure lines (servers that failed end their
        session, so they leave ``open_sessions``)."""
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
        for i, (client, future) in enumerate(zip(self.clients, futures, strict=True)):
            if broadcast_error is not None and not future.done():
                failures.append(f"  {client.base_url}: still receiving when the broadcast failed")
                continue
            try:
                future.result()
            except Exception as e:
                open_sessions.discard(i)
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

    def _end_sessions(self, open_sessions: set[int]) -> None:
        """Finish (without a version) the sessions still open after a failure; best effort:
        a server that cannot is reported by the next update's ``start_weight_update``."""
        futures = {
            i: self._pool.submit(self.clients[i].finish_weight_update, None) for i in open_sessions
        }
        for future in futures.values():
            future.exception()

    def _on_all(self, what: str, call: Callable[[VLLMClient], None]) -> None:
        self._raise_failures(what, [self._pool.submit(call, c) for c in self.clients])

    def _raise_failures(self, what: str, futures: list[Future]) -> None:
        lines = []
        for client, future in zip(self.clients, futures, strict=True):
            try:
                future.result()
            except Exception as e:
                lines.append(f"  {client.base_url}: {e}")
        if lines:
            raise WeightSyncError(f"{what} failed:\n" + "\n".join(lines))

    def close(self) -> None:
        """Leave the group on every server and here; safe to call twice.

        Raises:
            WeightSyncError: naming servers that failed to leave (ours is released regardless).
        """
        try:
            if self._group is not None:
                self._on_all(
                    "shutdown_weight_transfer_engine", lambda c: c.shutdown_weight_transfer_engine()
                )
        finally:
            if self._group is not None:
                if isinstance(self._group, WeightUpdateGroup):
                    self._group.destroy()
                self._group = None
            self._staging = None
            self._pool.shutdown(wait=True)
