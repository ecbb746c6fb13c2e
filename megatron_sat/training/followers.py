"""The command channel from trainer rank 0 to the other ranks: rank 0 broadcasts each
collective action before it starts it (``Followers.tell``), the others mirror it
(``Followers.follow``), so every collective runs on all ranks in the same order."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_sat.config import RunConfig
from megatron_sat.training.mini_batches import RolloutBatchSteps, train_rollout_batch
from megatron_sat.training.saving import save_if_due, save_mid_batch
from megatron_sat.training.stage_senders import StageSender
from megatron_sat.training.step import routing_diagnostic_due
from megatron_sat.training.trainer import PolicyTrainer


class Followers:
    """Rank 0's side of the command channel to the other trainer ranks (``training.rl``'s
    module docstring).

    ``tell(command, arg)`` broadcasts one command over the world group before rank 0 starts
    the collective action it names; the followers run ``follow``. Commands: ``step``, ``export``
    (walk ``trainer.hf_tensors()`` to the end), ``save`` (arg: the step and whether a stop
    forces the save), ``save_mid_batch`` (arg: the step a stop interrupted after one of its
    optimizer steps: each rank saves its own pending batch), ``done``, ``stop`` (a stop
    signal ended the run after a save: no HF export) and ``abort`` (rank 0 failed: the
    followers raise instead of waiting forever).

    ``busy`` is true from ``tell`` of a collective action until rank 0 calls ``idle`` after
    finishing its own part: a failure on rank 0 in between leaves the followers inside that
    action's collectives, where an ``abort`` broadcast would only meet them at the timeout;
    rank 0 then exits without it and the launcher tears the job down.
    """

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer
        self.active = dist.is_initialized() and dist.get_world_size() > 1
        self.done = False
        self.busy = False
        self._export: Iterator | None = None

    def tell(self, command: str, arg: object = None) -> None:
        if self.active:
            dist.broadcast_object_list([command, arg], src=0)
        self.done |= command in ("done", "stop")
        self.busy = command in (
            "step", "export", "save", "save_mid_batch", "stage_connect", "stage_push"
        )  # fmt: skip

    def idle(self) -> None:
        """Rank 0 finished its part of the last collective action."""
        self.busy = False

    def can_abort(self) -> bool:
        """Whether the followers wait at the channel, where ``abort`` reaches them."""
        return not (self.busy or self.done)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``trainer.hf_tensors()`` for the fleet, mirrored by every follower. A push may stop
        consuming an export half-way (a failed bucket) and ask for a new one: the rest of the
        old one is walked first, since the followers walk each export to the end."""
        self.finish_export()
        self.tell("export")
        self._export = self.trainer.hf_tensors()
        return self._export

    def finish_export(self) -> None:
        if self._export is not None:
            for _ in self._export:
                pass
            self._export = None
            self.idle()

    @staticmethod
    def follow(
        trainer: PolicyTrainer, cfg: RunConfig, pending: RolloutBatchSteps | None = None
    ) -> str:
        """A non-zero rank: do what rank 0 says until it says ``done`` or ``stop``; returns
        which. ``pending``: this rank's share of a rollout batch a stop interrupted (the run
        checkpoint's), finished by the first ``step``.

        Raises:
            RuntimeError: when rank 0 aborts.
        """
        stage = StageSender(trainer)  # PP > 1: this rank's part of every stage push
        while True:
            message: list = [None, None]
            dist.broadcast_object_list(message, src=0)
            command, arg = message
            if command == "step":  # arg: the step, for the diagnostic's interval
                # One rollout batch: one optimizer step, or several (training.mini_batches),
                # which rank 0 may stop in the middle: the pending batch is kept to be saved
                interval = cfg.train.routing_diagnostic_interval
                _, pending = train_rollout_batch(
                    trainer,
                    None,
                    None,
                    cfg,
                    None,
                    routing_diagnostic=routing_diagnostic_due(interval, arg),
                    pending=pending,
                )
            elif command == "export":
                for _ in trainer.hf_tensors():
                    pass
            elif command == "save":
                step, force = arg
                save_if_due(cfg, trainer, step, version=None, initial=None, force=force)
            elif command == "save_mid_batch":
                save_mid_batch(cfg, trainer, arg, pending, version=None, initial=None)
            elif command in StageSender.COMMANDS:
                stage.handle(command, arg)
            elif command in ("done", "stop"):
                stage.close()
                return command
            else:
                stage.close()
                raise RuntimeError(f"rank 0 ended the run ({command}); see its log")
