"""When a run checkpoint is written during RL, and what it holds (collective: every rank)."""

from __future__ import annotations

from megatron_sat.checkpoint.run_state import save_run_checkpoint, should_save
from megatron_sat.config import RunConfig
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
