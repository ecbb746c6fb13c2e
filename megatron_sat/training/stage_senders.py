"""The weight push at PP > 1: one sender per pipeline stage (as slime), each sending its own
layers over its own group, driven from global rank 0 through the followers' command channel
(``training.rl``)."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from types import SimpleNamespace

import torch.distributed as dist

from megatron_sat.config import RunConfig
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.engines import ENGINES
from megatron_sat.training.trainer import PolicyTrainer
from megatron_sat.weight_sync.broadcast import UpdateStats, WeightSyncError, WeightUpdater
from megatron_sat.weight_sync.megatron_push import (
    connect_in_stage_order,
    is_stage_sender,
    push_megatron_weights,
)


def uses_stage_senders(cfg: RunConfig) -> bool:
    """Whether the run's weight push has one sender per pipeline stage
    (``weight_sync.megatron_push``, as slime): at PP > 1 with SGLang servers (embedded or by
    URL) each stage's sender rank (``is_stage_sender``) sends its own layers over its own
    group, so no rank gathers the other stages' layers. vLLM cannot take several senders
    (``EngineSpec.single_sender_reason``, from its source): a vLLM run at PP > 1 pushes rank
    0's gathered export, as at PP = 1, and :func:`single_sender_reason` says why."""
    return (
        cfg.parallel.pipeline_model_parallel_size > 1 and ENGINES[cfg.rollout.engine].per_stage_push
    )


def single_sender_reason(cfg: RunConfig) -> str | None:
    """Why a run at PP > 1 pushes from rank 0 alone (its engine takes one sender per server),
    for the run to log at start; None when it does not (PP = 1, or one sender per stage)."""
    spec = ENGINES[cfg.rollout.engine]
    if cfg.parallel.pipeline_model_parallel_size == 1 or spec.per_stage_push:
        return None
    return (
        f"rollout.engine={cfg.rollout.engine} at pipeline_model_parallel_size="
        f"{cfg.parallel.pipeline_model_parallel_size}: {spec.single_sender_reason}"
    )


class StageExport:
    """What the fleet hands ``StageZeroUpdater.update`` as its tensors: nothing to read,
    every stage exports its own layers inside ``push_megatron_weights``."""


STAGE_EXPORT = StageExport()


class StageZeroUpdater(WeightUpdater):
    """Global rank 0's updater (stage 0's sender) as the fleet's ``updater_cls`` when
    ``uses_stage_senders``. The fleet keeps its part (health probes, restarts, regrouping), and
    each of its calls becomes the collective of every trainer rank
    (``training.followers.Followers``):

    - ``connect``: the followers get the members (URL, client timeout and keys: pickled in
      memory, never logged) and this updater's options; each later stage's sender builds its
      own ``WeightUpdater`` (its own group name; its own address as the servers see it) and
      the senders connect one stage after another (``connect_in_stage_order``). The fleet
      regroups after every change of membership (a server restarted or dropped), so the
      stage senders reconnect to the new server set then.
    - ``update``: ``push_megatron_weights`` on every rank: this rank pauses the servers,
      begins, sends stage 0's layers, ends and continues; each later stage's sender sends its
      own layers in stage order. Returns this rank's (stage 0's) ``UpdateStats``.
    - ``close``: every stage sender closes its group (skipped when the followers are done --
      they closed theirs -- or inside a collective: the run is then ending).
    """

    def __init__(self, followers, trainer: PolicyTrainer, clients, **options) -> None:
        super().__init__(clients, **options)
        self.followers, self.trainer = followers, trainer

    def connect(self) -> None:
        """Connect every stage sender (see the class docstring).

        Raises:
            WeightSyncError: naming every rank that failed to connect (on any rank).
        """
        self.followers.tell(
            "stage_connect",
            {
                "servers": [(c.base_url, c.timeout_s, c.keys) for c in self.clients],
                "ranks_per_server": self.ranks_per_server,
                "host": socket.gethostname(),
                "master_address": self.master_address,
                "options": {
                    "backend": self.backend,
                    "bucket_bytes": self.bucket_bytes,
                    "pause_mode": self.pause_mode,
                    "timeout_s": self.timeout_s,
                    "flatten_buckets": self.flatten_buckets,
                    "unpacked_from_bytes": self.unpacked_from_bytes,
                },
            },
        )
        try:
            failures = connect_stage_senders(lambda: WeightUpdater.connect(self))
        finally:
            self.followers.idle()  # connect_stage_senders ends in a collective on every rank
        if failures:
            raise WeightSyncError("stage senders failed to connect:\n" + "\n".join(failures))

    def update(self, named_tensors, weight_version: str) -> UpdateStats:
        """One push from every stage (``push_megatron_weights``); ``named_tensors`` must be
        ``STAGE_EXPORT``.

        Raises:
            TypeError: for any other ``named_tensors`` (a caller passing real tensors).
            WeightSyncError: as ``push_megatron_weights``.
        """
        if named_tensors is not STAGE_EXPORT:
            raise TypeError(
                "at PP > 1 each stage exports its own layers: pass the fleet STAGE_EXPORT, "
                f"got {type(named_tensors).__name__}"
            )
        self.followers.tell("stage_push", weight_version)
        try:
            model, hf_config = self.trainer.model, self.trainer.hf_config
            return push_megatron_weights(model, hf_config, self, weight_version)
        finally:
            # It ends in an all-gather of every rank's error, failed or not.
            self.followers.idle()

    def close(self) -> None:
        if self.followers.active and self.followers.can_abort():
            self.followers.tell("stage_close")
        super().close()


class StageSender:
    """A follower's part of ``StageZeroUpdater``'s collectives, and its own updater when it
    is a later stage's sender (``is_stage_sender``; None on the other followers)."""

    COMMANDS = ("stage_connect", "stage_push", "stage_close")

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer
        self.updater: WeightUpdater | None = None

    def handle(self, command: str, arg) -> None:
        if command == "stage_connect":
            self.close()  # the fleet regroups: a new server set, new groups
            connect = None
            if is_stage_sender():
                try:
                    address = stage_master_address(arg["host"], arg["master_address"])
                    clients = [SGLangClient(u, t, keys=k) for u, t, k in arg["servers"]]
                    self.updater = WeightUpdater(
                        clients,
                        master_address=address,
                        ranks_per_server=arg["ranks_per_server"],
                        **arg["options"],
                    )
                    connect = self.updater.connect
                except Exception as e:  # reported by rank 0, after the same collectives
                    connect = functools.partial(_reraise, e)
            connect_stage_senders(connect)
        elif command == "stage_push":
            try:
                model, hf_config = self.trainer.model, self.trainer.hf_config
                push_megatron_weights(model, hf_config, self.updater, arg)
            except Exception as e:  # every rank raised; rank 0 retries or ends the run
                print(f"megatron-sat: rank {dist.get_rank()}: push {arg!r} failed: {e}")
        else:
            self.close()

    def close(self) -> None:
        updater, self.updater = self.updater, None
        if updater is None:
            return
        try:
            updater.close()
        except WeightSyncError as e:  # a dead server cannot destroy its side; ours is released
            print(f"megatron-sat: rank {dist.get_rank()}: closing its weight group: {e}")
        for client in updater.clients:
            client.close()


def _reraise(error: Exception) -> None:
    raise error


def connect_stage_senders(connect: Callable[[], None] | None) -> list[str]:
    """``connect()`` on this rank (None: not a stage sender) in stage order
    (``connect_in_stage_order``), a failure caught so that every rank reaches the same
    collectives. A collective on the world group; returns every failed rank's message
    ("rank r: ..."), the same list on every rank."""
    failure = None

    def guarded() -> None:
        nonlocal failure
        try:
            connect()
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"

    connect_in_stage_order(None if connect is None else SimpleNamespace(connect=guarded))
    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return [f"rank {r}: {m}" for r, m in enumerate(failures) if m is not None]


def stage_master_address(rank0_host: str, rank0_address: str) -> str:
    """This rank's address as the rollout servers see it, for its stage's group (whose
    TCPStore it hosts): rank 0's ``master_address`` on rank 0's host (``socket.gethostname``
    equal); on another node the address of the interface that routes to rank 0's address
    (a UDP ``connect`` sends nothing, it only picks the route).

    Raises:
        ValueError: on another node when that address is a loopback one (rank 0's address
            then does not reach across nodes: set ``MASTER_ADDR``).
    """
    if socket.gethostname() == rank0_host:
        return rank0_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((rank0_address, 1))
        address = probe.getsockname()[0]
    if address.startswith("127."):
        raise ValueError(
            f"this stage sender is on host {socket.gethostname()!r}, rank 0 on {rank0_host!r}, "
            f"but rank 0's weight-sync address {rank0_address!r} is loopback: set MASTER_ADDR "
            "to an address the other nodes reach"
        )
    return address
