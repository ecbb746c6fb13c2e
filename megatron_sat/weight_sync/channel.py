"""The server-side calls a weight push makes: what an updater needs of one rollout server.

weight_sync sits below rollout, so it names these calls as protocols and never imports a
client; the rollout clients (``rollout.client.SGLangClient``, ``rollout.vllm.client.VLLMClient``)
satisfy them. Every call blocks until the server answered and raises on failure (the clients
raise ``SGLangError``, a ``RuntimeError``; the updater reports it per server, naming
``base_url``). Weight-update calls are never retried: each is one half of a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# SGLang's pause modes (sglang 0.5.23 ``io_struct.PauseGenerationReqInput``): "abort" ends
# running requests, "retract" puts them back in the queue, "in_place" keeps them and their KV.
PAUSE_MODES = ("abort", "retract", "in_place")


class UpdateChannel(Protocol):
    """Generation control of one server, common to every engine's weight push."""

    base_url: str

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> None: ...


class SGLangUpdateChannel(UpdateChannel, Protocol):
    """SGLang's weight-update session (sglang 0.5.23 ``/init_weights_update_group``,
    ``/begin_weight_update``, ``/update_weights_from_distributed`` per bucket,
    ``/end_weight_update``, ``/destroy_weights_update_group``): what
    :class:`~megatron_sat.weight_sync.broadcast.WeightUpdater` calls."""

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None: ...

    def begin_weight_update(self, selector: str = "all") -> None: ...

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None: ...

    def end_weight_update(self) -> None: ...

    def destroy_weights_update_group(self, group_name: str) -> None: ...
