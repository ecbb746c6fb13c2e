"""When a run checkpoint is written during RL, and what it holds (collective: every rank).

Between rollout batches: every ``train.save_every`` rollout batches, after the last one, and
after the one in flight when a stop signal came (``training.stop``). In the middle of a
rollout batch of several optimizer steps (``train.global_batch_size``): only on a stop
(``save_mid_batch``), never by ``train.save_every``, so a run's regular checkpoints stay one
per rollout batch and hold no pending batch (its samples, routes and old log-probs)."""

from __future__ import annotations

from megatron_sat.checkpoint.run_state import save_run_checkpoint, should_save
from megatron_sat.config import RunConfig
from megatron_sat.training.mini_batches import RolloutBatchSteps
from megatron_sat.training.trainer import PolicyTrainer


def due(cfg: RunConfig, step: int) -> bool:
    """Whether a run checkpoint is written after ``step``."""
    return should_save(step, cfg.train.save_every) or step == cfg.train.num_steps


def save_if_due(
    cfg: RunConfig,
    trainer: PolicyTrainer,
    step: int,
    *,
    version: int | None,
    initial: dict | None,
    prompts: int | None = None,
    rollout_state: dict | None = None,
    counters: dict[str, float] | None = None,
    force: bool = False,
) -> None:
    """Run checkpoint after ``step`` every ``train.save_every`` steps and after the last one
    (collective: every rank calls it; rank 0's version and data position, ``prompts``
    consumed from the prompt stream by the batches trained on so far, are written, with the
    cumulative ``counters`` logged at ``step``, which a resumed run counts on from). ``force``
    saves whatever ``train.save_every`` says (a stop signal: ``training.stop``)."""
    if not (force or due(cfg, step)):
        return
    save_run_checkpoint(
        cfg.run_dir,
        model=trainer.model,
        optimizer=trainer.optimizer,
        step=step,
        weight_version=version or 0,
        data_state={"prompts_consumed": prompts or 0},
        rollout_state=rollout_state,
        extra={"initial_eval": initial or {}, "counters": counters or {}},
    )


def save_mid_batch(
    cfg: RunConfig,
    trainer: PolicyTrainer,
    step: int,
    pending: RolloutBatchSteps,
    *,
    version: int | None,
    initial: dict | None,
    prompts: int | None = None,
    counters: dict[str, float] | None = None,
    batch: dict | None = None,
) -> None:
    """Run checkpoint of a stop in the middle of rollout batch ``step``, after
    ``pending.done`` of its optimizer steps (collective: every rank calls it with its own
    ``pending``): ``step_<step - 1>_mini_<done>`` holds the weights and optimizer after that
    step, every rank's pending batch, and rank 0's ``version`` (the batch's: not bumped, no
    push happened), data position ``prompts`` (the batch's prompts included), the cumulative
    ``counters`` (the batch's generation included, not logged yet) and ``batch`` (its rollout
    metrics and generation seconds, logged when the resumed run ends it)."""
    save_run_checkpoint(
        cfg.run_dir,
        model=trainer.model,
        optimizer=trainer.optimizer,
        step=step - 1,
        mini_step=pending.done,
        pending_batch=pending.state_dict(),
        weight_version=version or 0,
        data_state={"prompts_consumed": prompts or 0},
        extra={"initial_eval": initial or {}, "counters": counters or {}, "mid_batch": batch or {}},
    )
