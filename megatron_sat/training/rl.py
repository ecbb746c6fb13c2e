"""The RL loop: generate -> score -> advantages -> train step -> (every n steps) weight sync.

Under torchrun global rank 0 owns everything outside the trainer's collectives: the rollout
pool and servers, evaluation, weight sync, logging and the summary. The other trainer ranks
follow it (``training.followers``): before each collective action rank 0 broadcasts what comes
next -- a train step, a walk of the HF export for a weight push, a run checkpoint, the end --
and the others do the same, so every collective (data-parallel scatter and reductions, the export's
TP/EP all-gathers) runs on all ranks in the same order, at any TP/EP/DP layout the trainer
accepts. Each step rank 0 generates the whole batch, computes the group advantages and sends
every data-parallel rank a contiguous share of whole GRPO groups (``dp_shares`` by DP rank;
the TP ranks of one DP rank get the same share), then every rank runs
``PolicyTrainer.rl_step`` on its share (global denominators, global SAT quantile, summed
gradients: see the trainer) and rank 0 logs the global metrics it returns. A weight push walks
the export on every rank; rank 0 sends it. With one process nothing is broadcast. What
follows a step per ``rollout.mode`` (push, evaluation, the pool's state for a checkpoint) is
the schedule's (``training.schedule``).

Dead servers: the pools stop using a server whose request failed and re-issue its work; every
weight push goes through ``rollout.fleet.sync_servers``, which restarts a dead embedded server,
pushes it the current weights and version with the others, and only then gives its new client
back to the pools (a server given by URL is reported and dropped). When every server is dead
the pools raise ``NoLiveServer`` and the loop revives the servers the same way at once, with
the trainer's current weights and version, then retries (in sync mode between two pushes of
``update_weights_interval > 1``, and in fixed-lag mode while waiting to push, those weights
are newer than the dead servers' ones: the samples record the version they really came from).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm
from transformers import AutoTokenizer

from megatron_sat.checkpoint.hf_io import read_hf_config
from megatron_sat.checkpoint.run_state import (
    clean_uncommitted,
    latest_run_checkpoint,
    load_run_checkpoint,
)
from megatron_sat.config import RunConfig
from megatron_sat.objectives import compute_grpo_advantages
from megatron_sat.rollout.async_pool import AsyncRolloutPool, check_pool_state
from megatron_sat.rollout.client import RoutingSpec
from megatron_sat.rollout.datasets import PromptRecord, load_prompt_dataset
from megatron_sat.rollout.fleet import PushReport, sync_servers
from megatron_sat.rollout.meter import MeterSnapshot, ServerMeter, server_metrics
from megatron_sat.rollout.pool import NoLiveServer, RolloutPool
from megatron_sat.rollout.protocol import refusal_metrics
from megatron_sat.rollout.remote_reward import RemoteReward
from megatron_sat.rollout.reward_choice import open_reward
from megatron_sat.rollout.reward_plugins import (
    check_finite_rewards,
    check_plugin_file,
    reward_metrics,
)
from megatron_sat.rollout.rewards import RewardWorkers
from megatron_sat.rollout.seeds import request_seed
from megatron_sat.rollout.types import Sample, staleness
from megatron_sat.training.engines import rollout_fleet
from megatron_sat.training.evaluate import evaluate
from megatron_sat.training.followers import Followers
from megatron_sat.training.mini_batches import RolloutBatchSteps, train_rollout_batch
from megatron_sat.training.run_folder import check_new_run
from megatron_sat.training.run_logger import RunLogger
from megatron_sat.training.sampling_mask_tp import replayed_sampling_mask
from megatron_sat.training.saving import due, save_if_due, save_mid_batch
from megatron_sat.training.schedule import (
    PoolParts,
    Schedule,
    async_pool_config,
    make_schedule,
    rollout_dispatch,
)
from megatron_sat.training.stage_senders import (
    STAGE_EXPORT,
    StageZeroUpdater,
    single_sender_reason,
    uses_stage_senders,
)
from megatron_sat.training.step import distributed_rl_step, dp_shares, routing_diagnostic_due
from megatron_sat.training.stop import StopRequest, resume_hint
from megatron_sat.training.trackers import make_trackers, mlflow_tracking_uri
from megatron_sat.training.trainer import PolicyTrainer

# Importable from here as before (tests, benches): they live in their own modules now.
__all__ = [
    "batch_metrics",
    "distributed_rl_step",
    "dp_shares",
    "make_summary",
    "routing_diagnostic_due",
    "run_rl",
    "validate_run",
]

logger = logging.getLogger("megatron_sat.training.rl")


class PromptStream:
    """Endless shuffled passes over ``records`` (a new permutation each epoch), counting the
    prompts it has given (``consumed``: the data position a run checkpoint stores)."""

    def __init__(self, records: list[PromptRecord], seed: int) -> None:
        def passes() -> Iterator[PromptRecord]:
            rng = random.Random(seed)
            while True:
                yield from rng.sample(records, len(records))

        self._records = passes()
        self.consumed = 0

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> PromptRecord:
        self.consumed += 1
        return next(self._records)


def batch_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """Reward, response length and truncation over all samples of a consumed batch; staleness
    (``rollout.types.staleness``) over the samples with >= 1 response token (an empty response
    has no version).

    Raises:
        ValueError: for an empty batch.
    """
    if not samples:
        raise ValueError("batch_metrics needs at least one sample")
    n = len(samples)
    ages = [staleness(s, trainer_version) for s in samples if s.response_ids]
    out = {
        "rollout/reward": sum(s.reward for s in samples) / n,
        "rollout/response_length": sum(len(s.response_ids) for s in samples) / n,
        "rollout/truncated": sum(s.finish_reason == "length" for s in samples) / n,
        **reward_metrics(samples),  # a reward plug-in's extra metrics, reward/<name>
    }
    if ages:
        out["rollout/staleness_mean"] = sum(ages) / len(ages)
        out["rollout/staleness_max"] = float(max(ages))
        for age in sorted(set(ages)):  # the staleness histogram of the step
            out[f"rollout/staleness_frac_age{age}"] = ages.count(age) / len(ages)
    return out


def check_prompt_lengths(
    records: list[PromptRecord],
    tokenizer,
    context: int | None,
    max_new_tokens: int,
    path,
    max_prompt_tokens: int | None = None,
) -> None:
    """Refuse a dataset with a row whose prompt tokens plus ``max_new_tokens`` exceed the
    model's context (``max_position_embeddings``), or whose prompt is longer than
    ``max_prompt_tokens`` (``launch.max_prompt_tokens``, what the launch plan sized the
    micro-batches and the rollout pool for), at load time rather than when the row is
    generated (the server refuses it then, or the GPU runs out of memory, possibly mid-run).

    Raises:
        ValueError: naming the file, the row (0-based, as ``PromptRecord.source_index``) and
            the field (``rollout.max_new_tokens`` or ``launch.max_prompt_tokens``).
    """
    for record in records:
        n = len(tokenizer.encode(record.prompt))
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            raise ValueError(
                f"{path} row {record.source_index}: {n} prompt tokens exceed "
                f"launch.max_prompt_tokens={max_prompt_tokens}, for which the launch plan sized "
                "the micro-batches and the rollout pool: raise it (and check the plan with "
                "`megatron-sat launch --dry-run`) or drop the row"
            )
        if context is not None and n + max_new_tokens > context:
            raise ValueError(
                f"{path} row {record.source_index}: {n} prompt tokens + rollout.max_new_tokens="
                f"{max_new_tokens} exceed the model's context length {context} "
                "(max_position_embeddings)"
            )


def validate_run(cfg: RunConfig, world: int | None = None) -> None:
    """Everything ``train`` can refuse before building the trainer: a run folder that holds
    another run, the HF checkpoint, the launch plan's layout and model checks at the
    trainer's world size (``WORLD_SIZE``, default 1), and every train and eval row against
    the context length.

    Raises:
        FileExistsError: ``run_dir`` holds another run and ``train.resume`` is off
            (``training.run_folder``).
        FileNotFoundError: ``init_checkpoint`` is not an HF checkpoint directory, or a
            dataset or the reward plug-in's file is missing.
        ValueError: naming the config field (layout, rollout.engine=vllm without
            rollout.server_urls, logging.mlflow_experiment without a tracking store) or the
            dataset row (length).
    """
    from megatron_sat.config.layout import check_train_layout

    check_new_run(cfg.run_dir, cfg.train.resume)
    if cfg.rollout.reward == "python":  # a missing plug-in file, named before anything starts
        check_plugin_file(cfg.rollout.reward_function)
    if cfg.logging.mlflow_experiment is not None:
        mlflow_tracking_uri(cfg.logging)  # a store is named, not found at the first log
    if cfg.rollout.engine == "vllm" and not cfg.rollout.server_urls:
        raise ValueError(
            "rollout.engine=vllm needs rollout.server_urls (running vLLM servers, or the ones "
            "megatron-sat launch starts with launch.rollout_engine=vllm; the embedded servers "
            "speak SGLang's API)"
        )
    if not (Path(cfg.init_checkpoint) / "config.json").is_file():
        raise FileNotFoundError(
            f"init_checkpoint={cfg.init_checkpoint!r} is not an HF checkpoint directory "
            "(no config.json); run the warm start or point it at one"
        )
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    hf_config = read_hf_config(cfg.init_checkpoint)
    check_train_layout(cfg, world, hf_config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.init_checkpoint)
    context = hf_config.get("max_position_embeddings")
    for path in (cfg.data.train_path, cfg.data.eval_path):
        records = load_prompt_dataset(path, tokenizer=tokenizer, **cfg.data.loader_kwargs())
        check_prompt_lengths(
            records,
            tokenizer,
            context,
            cfg.rollout.max_new_tokens,
            path,
            cfg.launch.max_prompt_tokens,
        )


def run_rl(cfg: RunConfig) -> dict:
    """Run the whole RL job of ``cfg``; returns (and writes) the run summary on rank 0, and an
    empty dict on the other data-parallel ranks (see the module docstring).

    With ``train.resume`` the run continues from its latest committed run checkpoint; when a
    crash came before the first commit there is none and the run starts from step 1 (the
    killed run's metrics and uncommitted folders are dropped).

    SIGTERM, SIGUSR1 and SIGINT stop the run after its current step with a run checkpoint
    (``training.stop``); it then returns ``{"stopped_after": step, "signal": name}`` on rank 0
    (no HF export, no summary: the resumed run writes them)."""
    stop = StopRequest()
    with stop.installed():
        return _run_rl(cfg, stop)


def _run_rl(cfg: RunConfig, stop: StopRequest) -> dict:
    """``run_rl`` with the stop handlers installed."""
    from megatron_sat.platform.lifetime import install_fork_pdeathsig

    install_fork_pdeathsig()  # forked helpers (checkpoint writers) die with this process
    validate_run(cfg, dist.get_world_size() if dist.is_initialized() else None)
    tokenizer = AutoTokenizer.from_pretrained(cfg.init_checkpoint)
    hf_config = read_hf_config(cfg.init_checkpoint)
    trainer = PolicyTrainer(
        hf_config,
        cfg.train,
        cfg.parallel,
        pad_token_id=tokenizer.pad_token_id,
        load_from=cfg.init_checkpoint,
        reference=cfg.objective.kl_coef > 0,  # the k3 KL's pi_ref: the initial checkpoint
        sampling_mask=replayed_sampling_mask(cfg.rollout),
    )
    state, fresh_after_crash = _resumed_state(cfg, trainer)
    first_step = 1 if state is None else state.step + 1
    pool_state = None if state is None else state.rollout_state
    if cfg.rollout.mode != "sync" and (pool_state or {}).get("batches") is not None:
        # Before any server starts: a pool of another lag, batch or clock is refused here.
        check_pool_state(pool_state, async_pool_config(cfg))
    if cfg.rollout.mode != "sync" and state is not None and state.pending_batch is not None:
        raise ValueError(  # only sync mode stops inside a rollout batch (training.stop)
            f"rollout.mode={cfg.rollout.mode}: the run checkpoint was written in the middle of "
            "a rollout batch in rollout.mode=sync; resume it with rollout.mode=sync"
        )
    if first_step > cfg.train.num_steps:
        if state.step == cfg.train.num_steps and not (Path(cfg.run_dir) / "summary.json").exists():
            # Killed after its last run checkpoint, before the HF export and the summary.
            return _finish_after_last_step(cfg, trainer, state)
        raise ValueError(
            f"run_dir {cfg.run_dir} already holds step {first_step - 1} >= train.num_steps="
            f"{cfg.train.num_steps}: nothing to resume (raise train.num_steps)"
        )
    if dist.get_rank() != 0:
        if Followers.follow(trainer, cfg, _pending_batch(state, trainer)) == "done":
            # Writing the checkpoint is a collective (checkpoint.hf_io.save_model_as_hf).
            trainer.save_hf(Path(cfg.run_dir) / "checkpoint", tokenizer_dir=cfg.init_checkpoint)
        return {}
    followers = Followers(trainer)
    try:
        summary = _lead(
            cfg, trainer, tokenizer, state, first_step, followers, stop, fresh_after_crash
        )
    except BaseException:
        if followers.can_abort():
            followers.tell("abort")
        raise
    return summary


def _resumed_state(cfg: RunConfig, trainer: PolicyTrainer):
    """With ``train.resume``: the run checkpoint to continue from (``train.resume_from``, else
    the newest committed one that verifies; ``checkpoint.run_state`` says which and why) and
    False; ``(None, True)`` when a crash came before the first commit. ``(None, False)``
    without ``train.resume``. A collective.

    Raises:
        FileNotFoundError: ``train.resume_from`` names a step but the run has no committed
            checkpoint at all.
    """
    if not cfg.train.resume:
        return None, False
    if dist.get_rank() == 0:
        clean_uncommitted(cfg.run_dir)
    if dist.is_initialized():
        dist.barrier()
    if latest_run_checkpoint(cfg.run_dir) is None:
        if cfg.train.resume_from is not None:
            raise FileNotFoundError(
                f"train.resume_from={cfg.train.resume_from}: {cfg.run_dir} holds no committed "
                "run checkpoint"
            )
        print(f"megatron-sat: no committed run checkpoint in {cfg.run_dir}: from step 1")
        return None, True
    state = load_run_checkpoint(
        cfg.run_dir,
        model=trainer.model,
        optimizer=trainer.optimizer,
        resume_from=cfg.train.resume_from,
    )
    return state, False


def _pending_batch(state, trainer: PolicyTrainer) -> RolloutBatchSteps | None:
    """This rank's share of the rollout batch a stop interrupted (a run checkpoint
    ``step_N_mini_j``: batch N + 1 after j optimizer steps), None otherwise."""
    if state is None or state.pending_batch is None:
        return None
    return RolloutBatchSteps.from_state_dict(state.pending_batch, trainer.device)


def _finish_after_last_step(cfg: RunConfig, trainer: PolicyTrainer, state) -> dict:
    """The end of a run killed after its last run checkpoint (step ``train.num_steps``, whose
    metrics line, final evaluation included, was logged before the checkpoint) but before its
    HF export and ``summary.json``: write both from the restored weights, as the uninterrupted
    run would have (collective: every rank calls it; rank 0 writes the summary).

    Returns:
        The summary on rank 0, ``{}`` on the other ranks.
    """
    run_dir = Path(cfg.run_dir)
    checkpoint = trainer.save_hf(run_dir / "checkpoint", tokenizer_dir=cfg.init_checkpoint)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    print(f"megatron-sat: step {state.step} was the last: writing the HF checkpoint and summary")
    with RunLogger(run_dir, state.step) as logger:  # drops a line cut short by the kill
        rows = [json.loads(line) for line in logger.metrics_path.read_text().splitlines()]
        last = [r for r in rows if r["step"] == state.step]
        if not last:
            raise RuntimeError(f"{logger.metrics_path} has no line of step {state.step}")
        final = {k: v for k, v in last[-1].items() if k.startswith("eval/")}
        summary = make_summary(
            cfg, state.extra["initial_eval"], final, run_dir, checkpoint, seconds=0.0
        )
        logger.write_summary(summary)
    print(json.dumps(summary, indent=2))
    return summary


def _trackers(cfg: RunConfig, resume_step: int | None) -> list:
    """The ``logging`` section's trackers; a resumed run (a checkpoint step >= 0) continues its
    W&B run."""
    resuming = resume_step is not None and resume_step >= 0
    return make_trackers(cfg.logging, Path(cfg.run_dir), cfg.to_dict(resolved=True), resuming)


def _lead(
    cfg: RunConfig,
    trainer: PolicyTrainer,
    tokenizer,
    state,
    first_step: int,
    followers: Followers,
    stop: StopRequest,
    fresh_after_crash: bool = False,
) -> dict:
    """Rank 0's part of ``run_rl`` (everything but the set-up shared by all ranks), in phases:
    the run folder and prompts; the servers, pools and logger (``_Lead``); the initial push
    and evaluation; the steps (``_Lead.run_steps``); the HF export and the summary, or, after
    a stop signal (``training.stop``), the line saying how to resume."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    prompts, eval_records = _prompt_sources(cfg, tokenizer, state, first_step)
    t_start = time.time()
    resume_step = None if state is None else state.step
    if fresh_after_crash:
        resume_step = -1  # drop every line the killed run logged
    with (
        # rollout.reward's, concurrently, timeouts on; first, so that a plug-in that cannot
        # be imported fails before the servers start
        open_reward(cfg.rollout) as rewards,
        rollout_fleet(cfg) as fleet,
        RunLogger(run_dir, resume_step, _trackers(cfg, resume_step)) as logger,
    ):
        lead = _Lead(cfg, trainer, tokenizer, followers, fleet, logger, rewards, eval_records)
        lead.stop = stop
        lead.initial_sync(state)
        lead.build_schedule(prompts, first_step, state)
        initial = lead.initial_eval(state)
        metrics = lead.run_steps(first_step, initial)
        final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        lead.close()
        if lead.stopped_after is not None:  # saved; the servers stop as the block ends
            followers.tell("stop")
            after, mini = lead.stopped_after, lead.stopped_mini
            print(resume_hint(run_dir, after, stop.signal_name, mini), file=sys.stderr)
            return {"stopped_after": after, "mini_step": mini, "signal": stop.signal_name}
        followers.tell("done")
        checkpoint = trainer.save_hf(run_dir / "checkpoint", tokenizer_dir=cfg.init_checkpoint)
        summary = make_summary(cfg, initial, final, run_dir, checkpoint, time.time() - t_start)
        logger.write_summary(summary)
    print(json.dumps(summary, indent=2))
    return summary


def _prompt_sources(
    cfg: RunConfig, tokenizer, state, first_step: int
) -> tuple[PromptStream, list[PromptRecord]]:
    """The train prompt stream at the run's data position, and the held-out prompts."""
    keys = cfg.data.loader_kwargs()
    train_records = load_prompt_dataset(cfg.data.train_path, tokenizer=tokenizer, **keys)
    eval_records = load_prompt_dataset(cfg.data.eval_path, tokenizer=tokenizer, **keys)
    if len(eval_records) < cfg.data.num_eval_prompts:  # said, since the accuracy's noise grows
        warnings.warn(
            f"data.num_eval_prompts={cfg.data.num_eval_prompts} but {cfg.data.eval_path} holds "
            f"{len(eval_records)} prompts: all {len(eval_records)} are evaluated",
            stacklevel=2,
        )
    eval_records = eval_records[: cfg.data.num_eval_prompts]
    prompts = PromptStream(train_records, cfg.train.seed)
    # The data position on resume (older checkpoints: one batch of prompts per step).
    position = (first_step - 1) * cfg.rollout.prompts_per_step
    if state is not None:
        position = state.data_state.get("prompts_consumed", position)
    for _ in range(position):
        next(prompts)
    return prompts, eval_records


class _Lead:
    """Rank 0's run inside the fleet, logger and reward workers: its pools, weight version and
    counters, and the phases ``_lead`` calls in order. It is the schedule's ``RunHooks``
    (``push``, ``revived``, ``evaluate``)."""

    def __init__(
        self,
        cfg: RunConfig,
        trainer: PolicyTrainer,
        tokenizer,
        followers: Followers,
        fleet,
        logger: RunLogger,
        rewards: RewardWorkers | RemoteReward,
        eval_records: list[PromptRecord],
    ) -> None:
        self.cfg, self.trainer, self.followers = cfg, trainer, followers
        self.fleet, self.logger, self.eval_records = fleet, logger, eval_records
        self.rewards = rewards
        num_layers, top_k, num_experts = trainer.routing_shape
        # One meter for both pools: a server is busy while either has a request on it.
        self.meter = ServerMeter(len(fleet.clients))
        # Routes are asked for only when configured (R3 needs them: RunConfig refuses R3
        # without); a sample without them then trains without the routing diagnostics.
        routing = None
        if cfg.rollout.return_routed_experts:
            routing = RoutingSpec(num_layers, top_k, num_experts)
        self.pool = RolloutPool(
            fleet.clients,
            tokenizer,
            rewards,
            routing=routing,
            stop_token_ids=[tokenizer.eos_token_id],
            meter=self.meter,
            dispatch=rollout_dispatch(cfg),
        )
        self.parts = PoolParts(fleet.clients, tokenizer, rewards, routing, self.meter)
        self.pools: list[RolloutPool | AsyncRolloutPool] = [self.pool]
        self.tensors = followers.hf_tensors  # rank 0 sends the gathered export
        if uses_stage_senders(cfg):  # each pipeline stage sends its own layers
            fleet.updater_cls = functools.partial(StageZeroUpdater, followers, trainer)
            self.tensors = lambda: STAGE_EXPORT
        elif (reason := single_sender_reason(cfg)) is not None:
            logger.warning("weight push from trainer rank 0 alone: %s", reason)
        self.version = 0
        self.restart_s = 0.0  # of the current step
        self.counted: dict[str, float] = {}
        self.initial: dict[str, float] = {}  # step 0's evaluation (initial_eval)
        self.snapshot: MeterSnapshot | None = None  # the meter at the last log (run_steps)
        self.schedule: Schedule | None = None  # build_schedule
        self.stop = StopRequest()  # the run's, set by _lead; read once per step
        self.stopped_after: int | None = None  # the step a stop signal saved and ended
        self.stopped_mini = 0  # optimizer steps of the next rollout batch it saved, if any
        # The rollout batch a stop interrupted (the run checkpoint's), finished first
        self.resumed: tuple[dict, RolloutBatchSteps] | None = None

    def initial_sync(self, state) -> None:
        """Start from identical weights on both sides, tagged with the trainer's version. On
        a resume in the middle of a rollout batch the servers get none until it ends
        (``train``): the weights of a mini-step are no policy version."""
        self.version = 0 if state is None else state.weight_version
        # The cumulative counters logged at the checkpoint resumed from: this process counts on.
        self.counted = {} if state is None else state.extra.get("counters", {})
        if state is not None and state.pending_batch is not None:
            self.resumed = (state.extra["mid_batch"], _pending_batch(state, self.trainer))
            return
        self.sync_now()

    def sync_now(self) -> None:
        """The trainer's weights as ``version`` to every server (``sync_servers``)."""
        try:  # through sync_servers like every push: a server restarted here reaches the pool
            sync_servers(
                self.fleet,
                self.pools,
                self.tensors,
                self.version,
                max_reply_bytes=self.cfg.rollout.max_reply_bytes,
            )
        finally:
            self.followers.finish_export()

    def build_schedule(self, prompts: PromptStream, first_step: int, state) -> None:
        """The schedule of ``rollout.mode`` (``training.schedule``), its pools joining ours."""
        self.schedule = make_schedule(
            self.cfg,
            self.pool,
            prompts,
            self,
            self.parts,
            first_step=first_step,
            version=self.version,
            restored=None if state is None else state.rollout_state,
        )
        self.pools.extend(self.schedule.pools)

    def push(self) -> PushReport:
        """The trainer's weights as ``version`` to every server, dead ones replaced."""
        try:
            report = sync_servers(
                self.fleet,
                self.pools,
                self.tensors,
                self.version,
                max_reply_bytes=self.cfg.rollout.max_reply_bytes,
            )
        finally:
            self.followers.finish_export()
        self.restart_s += report.restart_s
        if report.found_dead:
            tqdm.write(
                f"rollout servers {list(report.found_dead)} died; restarted and re-synced "
                f"{list(report.restarted)}; without a server: {list(report.down)}"
            )
        return report

    def revived(self, call):
        """``call()``; when every server is dead, revive them (``push``) and call again.
        Ends when nothing can be restarted: ``push`` then raises WeightSyncError."""
        while True:
            try:
                return call()
            except NoLiveServer as e:
                tqdm.write(f"{e}; reviving the rollout servers")
                self.push()

    def evaluate(self, after_step: int) -> dict[str, float]:
        """The held-out evaluation after ``after_step`` (0: before training), seeded by it."""
        ro, run_seed = self.cfg.rollout, self.cfg.train.seed
        return self.revived(
            lambda: evaluate(
                self.pool,
                self.eval_records,
                samples_per_prompt=ro.eval_samples_per_prompt,
                temperature=ro.eval_temperature,
                max_new_tokens=ro.max_new_tokens,
                seed_of=lambda i, k: request_seed(run_seed, after_step, i, k, "eval"),
            )
        )

    def initial_eval(self, state) -> dict[str, float]:
        """Step 0's evaluation, logged; on resume the one the checkpoint recorded."""
        if state is not None:
            self.initial = state.extra["initial_eval"]
        else:
            self.initial = self.evaluate(0)
            self.logger.log(0, self.initial)
        return self.initial

    def run_steps(self, first_step: int, initial: dict[str, float]) -> dict[str, float]:
        """Steps ``first_step .. train.num_steps``; the last step's metrics."""
        progress = tqdm(
            range(first_step, self.cfg.train.num_steps + 1),
            desc="RL",
            unit="step",
            initial=first_step - 1,
            total=self.cfg.train.num_steps,
        )
        self.schedule.start()
        self.snapshot = self.meter.snapshot()
        last_acc = initial["eval/acc_greedy"]  # the bar shows the latest held-out accuracy
        metrics: dict[str, float] = {}
        for step in progress:
            if step == first_step and self.stop.requested:  # nothing trained here yet
                self.stopped_after = step - 1
                break
            metrics = self.step(step)
            if self.stopped_after is not None:
                break
            last_acc = metrics.get("eval/acc_greedy", last_acc)
            progress.set_postfix(reward=f"{metrics['rollout/reward']:.3f}", acc=f"{last_acc:.3f}")
        return metrics

    def step(self, step: int) -> dict[str, float]:
        """One step: generate, advantages and train, the schedule's push (and evaluation,
        export), log, save. Its metrics."""
        cfg = self.cfg
        t0 = time.time()
        self.restart_s = 0.0
        samples, metrics, t_gen = self.rollout_batch(step)
        if not self.train(step, samples, metrics, t_gen):  # a stop in the middle: saved
            return metrics
        eval_due = step % cfg.train.eval_every == 0 or step == cfg.train.num_steps
        # A stop signal read here is honoured by this step (saved); a later one, by the next.
        stopping = self.stop.requested and step < cfg.train.num_steps
        after = self.schedule.after_step(
            step, self.version, eval_due=eval_due, save_due=due(cfg, step) or stopping
        )
        metrics.update(
            {
                "time/generate_s": t_gen,
                "time/sync_s": after.sync_s,  # restarts and regrouping included
                "time/restart_s": self.restart_s,
                "time/step_s": time.time() - t0 - after.eval_s,
            }
        )
        if eval_due:
            metrics.update(self.evaluate(step) if after.evaluated is None else after.evaluated)
        counters = self.log(step, metrics)
        self.followers.tell("save", (step, stopping))
        save_if_due(
            cfg,
            self.trainer,
            step,
            force=stopping,
            version=self.version,
            initial=self.initial,
            prompts=self.schedule.data_position(step, after.pool_state),
            rollout_state=after.pool_state,
            counters=counters,
        )
        self.followers.idle()
        if stopping:
            self.stopped_after = step
        return metrics

    def rollout_batch(self, step: int) -> tuple[list[Sample] | None, dict[str, float], float]:
        """The step's samples, their metrics (``batch_metrics``) and generation seconds; for
        the rollout batch a stop interrupted, None and the metrics and seconds it saved.

        Raises:
            ValueError: naming the sample, for a non-finite reward (nothing is trained)."""
        if self.resumed is not None:
            saved = self.resumed[0]
            return None, dict(saved["metrics"]), saved["generate_s"]
        t0 = time.time()
        samples = self.schedule.generate(step)
        t_gen = time.time() - t0
        check_finite_rewards(samples)
        return samples, batch_metrics(samples, self.version), t_gen

    def train(self, step: int, samples, metrics: dict[str, float], t_gen: float) -> bool:
        """Group advantages and the distributed train step on ``samples`` (None: finish the
        resumed batch), its metrics into ``metrics``; the trainer's version goes up by one.
        False when a stop came between two of its optimizer steps (sync mode: the
        asynchronous pool's state holds batches generated ahead that a mini-step cannot
        export, so there the stop waits for the batch's end): saved, nothing else done."""
        advantages, pending = None, None if self.resumed is None else self.resumed[1]
        if samples is not None:
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
            advantages = compute_grpo_advantages(rewards, self.cfg.rollout.group_size)
        self.followers.tell("step", step)
        diagnostic = routing_diagnostic_due(self.cfg.train.routing_diagnostic_interval, step)
        stop = (lambda: self.stop.requested) if self.cfg.rollout.mode == "sync" else None
        train, pending = train_rollout_batch(
            self.trainer,
            samples,
            advantages,
            self.cfg,
            self.version,
            routing_diagnostic=diagnostic,
            stop=stop,
            pending=pending,
        )
        self.followers.idle()
        if train is None:
            self.save_mid_batch(step, pending, {"metrics": metrics, "generate_s": t_gen})
            return False
        metrics.update({f"train/{k}": v for k, v in train.items()})
        self.version += 1
        if self.resumed is not None:  # the push initial_sync left for the batch's end
            self.resumed = None
            self.sync_now()
        return True

    def save_mid_batch(self, step: int, pending: RolloutBatchSteps, batch: dict) -> None:
        """The run checkpoint of a stop in the middle of rollout batch ``step``
        (``training.saving.save_mid_batch``); the run then ends."""
        self.followers.tell("save_mid_batch", step)
        save_mid_batch(
            self.cfg,
            self.trainer,
            step,
            pending,
            version=self.version,
            initial=self.initial,
            prompts=self.schedule.data_position(step, None),
            counters=self.counters(),
            batch=batch,
        )
        self.followers.idle()
        self.stopped_after, self.stopped_mini = step - 1, pending.done

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Add the servers' and the cumulative counters' metrics and log the step; the
        cumulative counters (a run checkpoint stores them)."""
        # Per server index, since the previous step's log (evaluation included).
        now = self.meter.snapshot()
        metrics.update(server_metrics(self.snapshot, now))
        metrics.update(refusal_metrics(self.fleet.clients))  # rollout.protocol's, cumulative
        self.snapshot = now
        counters = self.counters()
        metrics.update(counters)
        metrics["rollout/dead_servers"] = float(len(self.fleet.down))
        self.logger.log(step, metrics)
        return counters

    def counters(self) -> dict[str, float]:
        """The cumulative counters: the checkpoint's, plus this process's since."""
        counters = {
            "rollout/reissued": float(sum(p.stats.reissued for p in self.pools)),
            "rollout/server_restarts": float(sum(self.fleet.restarts)),
            "rollout/filtered_groups": float(self.schedule.filtered_groups),
            "rollout/reward_worker_restarts": float(self.rewards.restarts),
            "rollout/reward_retries": float(self.rewards.retries),  # remote scorer's retries
        }
        return {k: self.counted.get(k, 0.0) + v for k, v in counters.items()}

    def close(self) -> None:
        """Stop the schedule's pools and close the synchronous one."""
        self.schedule.stop()
        self.pool.close()


def make_summary(
    cfg: RunConfig, initial: dict, final: dict, run_dir: Path, checkpoint: Path, seconds: float
) -> dict:
    """Held-out accuracy before/after RL with its noise, and the run's mean mismatch."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/mismatch_abs_logratio" in r]

    def mean(key: str) -> float | None:
        values = [r[key] for r in train_rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    out = {
        "objective": cfg.objective.name,
        "use_r3": cfg.train.use_r3,
        "update_weights_interval": cfg.rollout.update_weights_interval,
        # rollout.mode and its lag (None in sync mode), so an async run's summary says so
        "rollout_mode": cfg.rollout.mode,
        "lag": None if cfg.rollout.mode == "sync" else cfg.rollout.lag,
        "num_steps": cfg.train.num_steps,
        "wall_time_s": round(seconds, 1),
    }
    for key in ("acc_greedy", "avg_at_k"):
        before, after = initial[f"eval/{key}"], final[f"eval/{key}"]
        noise = (initial[f"eval/{key}_stderr"] ** 2 + final[f"eval/{key}_stderr"] ** 2) ** 0.5
        out[key] = {
            "warm_start": before,
            "after_rl": after,
            "gain": after - before,
            "noise_2se": 2 * noise,
            "gain_beyond_noise": after - before > 2 * noise,
        }
    out.update(
        mismatch_abs_logratio_mean=mean("train/mismatch_abs_logratio"),
        mismatch_abs_logratio_live_mean=mean("train/mismatch_abs_logratio_live"),
        topk_match_live_mean=mean("train/topk_match_live"),
        topk_match_r3_mean=mean("train/topk_match_r3"),
        num_eval_prompts=int(initial["eval/num_prompts"]),
        noise_method=(
            "2 x standard error of the difference of two means over held-out "
            "prompts (binomial for greedy accuracy; per-prompt avg@k for sampling)"
        ),
        checkpoint=str(checkpoint),
        run_dir=str(run_dir),
    )
    return out
