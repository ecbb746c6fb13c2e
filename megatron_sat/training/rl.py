"""The RL loop: generate -> score -> advantages -> train step -> (every n steps) weight sync.

Under torchrun global rank 0 owns everything outside the trainer's collectives: the rollout
pool and servers, evaluation, weight sync, logging and the summary. The other trainer ranks
follow it (``_Followers``): before each collective action rank 0 broadcasts what comes next --
a train step, a walk of the HF export for a weight push, a run checkpoint, the end -- and the
others do the same, so every collective (data-parallel scatter and reductions, the export's
TP/EP all-gathers) runs on all ranks in the same order, at any TP/EP/DP layout the trainer
accepts. Each step rank 0 generates the whole batch, computes the group advantages and sends
every data-parallel rank a contiguous share of whole GRPO groups (``dp_shares`` by DP rank;
the TP ranks of one DP rank get the same share), then every rank runs
``PolicyTrainer.rl_step`` on its share (global denominators, global SAT quantile, summed
gradients: see the trainer) and rank 0 logs the global metrics it returns. A weight push walks
the export on every rank; rank 0 sends it. With one process nothing is broadcast.

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
import os
import random
import time
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
    save_run_checkpoint,
    should_save,
)
from megatron_sat.config import RunConfig
from megatron_sat.objectives import compute_grpo_advantages
from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool, check_pool_state
from megatron_sat.rollout.client import RoutingSpec, SamplingParams
from megatron_sat.rollout.datasets import PromptRecord, load_prompt_dataset
from megatron_sat.rollout.fleet import PushReport, sync_servers
from megatron_sat.rollout.meter import ServerMeter, server_metrics
from megatron_sat.rollout.pool import NoLiveServer, RolloutPool, informative_batch
from megatron_sat.rollout.rewards import RewardWorkers
from megatron_sat.rollout.seeds import request_seed
from megatron_sat.rollout.types import Sample, staleness
from megatron_sat.training.batch_transfer import distribute_batch
from megatron_sat.training.engines import rollout_fleet
from megatron_sat.training.evaluate import evaluate
from megatron_sat.training.run_logger import RunLogger
from megatron_sat.training.stage_senders import (
    STAGE_EXPORT,
    StageSender,
    StageZeroUpdater,
    uses_stage_senders,
)
from megatron_sat.training.trainer import PolicyTrainer


def rollout_dispatch(cfg: RunConfig) -> str:
    """How the pools send requests (``rollout.pool.DISPATCH``): ``per_request`` to servers
    given by URL (SGLang, vLLM: continuous batching, so a long response holds only itself;
    rendered SGLang servers run ``--enable-deterministic-inference``, batch-invariant), and
    ``per_server`` to embedded servers: their engine is not batch-invariant (the same seeded
    request's log-probs differ by up to 1e-6 alone and in a batch, measured) and batches
    statically, so per-request arrival would make seeded runs differ bit for bit and would
    not free a server sooner. The logical clock (``rollout.clock_tokens``) sends one batched
    request per server and round, whatever the servers."""
    if cfg.rollout.clock_tokens:
        return "per_server"
    return "per_request" if cfg.rollout.server_urls else "per_server"


def async_pool_config(cfg: RunConfig) -> AsyncPoolConfig:
    """The asynchronous pool of ``rollout.mode`` fixed_lag or bounded, from the run config."""
    ro = cfg.rollout
    return AsyncPoolConfig(
        mode=ro.mode,
        lag=ro.lag,
        prompts_per_batch=ro.prompts_per_step,
        group_size=ro.group_size,
        on_update=ro.on_update,
        clock_tokens=ro.clock_tokens,
        filter_groups=ro.filter_groups,
        max_replacements=ro.max_replacement_groups,
        dispatch=rollout_dispatch(cfg),
    )


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
    }
    if ages:
        out["rollout/staleness_mean"] = sum(ages) / len(ages)
        out["rollout/staleness_max"] = float(max(ages))
        for age in sorted(set(ages)):  # the staleness histogram of the step
            out[f"rollout/staleness_frac_age{age}"] = ages.count(age) / len(ages)
    return out


def dp_shares(num_samples: int, group_size: int, num_ranks: int) -> list[slice]:
    """Contiguous shares of whole groups for ``num_ranks`` data-parallel ranks.

    The groups are split as evenly as possible, the first ranks taking one more group when
    they do not divide evenly; a rank may get none when there are fewer groups than ranks.

    Raises:
        ValueError: ``num_samples`` is not a multiple of ``group_size``, or a count < 1.
    """
    if group_size < 1 or num_ranks < 1:
        raise ValueError(f"group_size ({group_size}) and num_ranks ({num_ranks}) must be >= 1")
    if num_samples % group_size:
        raise ValueError(f"{num_samples} samples are not whole groups of {group_size}")
    base, extra = divmod(num_samples // group_size, num_ranks)
    shares, start = [], 0
    for rank in range(num_ranks):
        stop = start + (base + (rank < extra)) * group_size
        shares.append(slice(start, stop))
        start = stop
    return shares


def distributed_rl_step(
    trainer: PolicyTrainer,
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    cfg: RunConfig,
    trainer_version: int | None,
    *,
    routing_diagnostic: bool = True,
) -> dict[str, float]:
    """One train step on every rank: rank 0 passes the whole batch and sends each rank the
    share of its data-parallel rank (``dp_shares``; TP ranks of one DP rank get the same
    share) as flat CPU tensors over gloo (``training.batch_transfer``: no pickle, nothing
    staged on a GPU); the other ranks pass None and receive theirs. Returns the global metrics of
    ``PolicyTrainer.rl_step`` (on every rank); ``routing_diagnostic`` (the same on every
    rank: ``routing_diagnostic_due``) runs its live-routing diagnostic forward.

    Raises:
        ValueError: a non-zero rank passed samples, or rank 0 passed none.
    """
    from megatron.core import parallel_state

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (samples is None) != (rank != 0):
        raise ValueError(f"rank {rank}: only rank 0 passes the batch to distributed_rl_step")
    if world == 1:
        share = (samples, advantages, trainer_version)
    else:
        # Flat CPU tensors over gloo, each rank only its share (training.batch_transfer).
        slices = None
        if rank == 0:
            num_dp = parallel_state.get_data_parallel_world_size()
            slices = dp_shares(len(samples), cfg.rollout.group_size, num_dp)
        share = distribute_batch(
            samples, advantages, trainer_version, slices, parallel_state.get_data_parallel_rank()
        )
    share_samples, share_advantages, version = share
    return trainer.rl_step(
        share_samples,
        share_advantages,
        cfg.objective,
        trainer_version=version,
        routing_diagnostic=routing_diagnostic,
    )


class _Followers:
    """Rank 0's side of the command channel to the other trainer ranks (module docstring).

    ``tell(command, arg)`` broadcasts one command over the world group before rank 0 starts
    the collective action it names; the followers run ``follow``. Commands: ``step``, ``export``
    (walk ``trainer.hf_tensors()`` to the end), ``save`` (arg: the step), ``done`` and
    ``abort`` (rank 0 failed: the followers raise instead of waiting forever).

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
        self.done |= command == "done"
        self.busy = command in ("step", "export", "save", "stage_connect", "stage_push")

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
    def follow(trainer: PolicyTrainer, cfg: RunConfig) -> None:
        """A non-zero rank: do what rank 0 says until it says ``done``.

        Raises:
            RuntimeError: when rank 0 aborts.
        """
        stage = StageSender(trainer)  # PP > 1: this rank's part of every stage push
        while True:
            message: list = [None, None]
            dist.broadcast_object_list(message, src=0)
            command, arg = message
            if command == "step":  # arg: the step, for the diagnostic's interval
                interval = cfg.train.routing_diagnostic_interval
                distributed_rl_step(
                    trainer,
                    None,
                    None,
                    cfg,
                    None,
                    routing_diagnostic=routing_diagnostic_due(interval, arg),
                )
            elif command == "export":
                for _ in trainer.hf_tensors():
                    pass
            elif command == "save":
                save_if_due(cfg, trainer, arg, version=None, initial=None)
            elif command in StageSender.COMMANDS:
                stage.handle(command, arg)
            elif command == "done":
                stage.close()
                return
            else:
                stage.close()
                raise RuntimeError(f"rank 0 ended the run ({command}); see its log")


def check_prompt_lengths(
    records: list[PromptRecord], tokenizer, context: int | None, max_new_tokens: int, path
) -> None:
    """Refuse a dataset with a row whose prompt tokens plus ``max_new_tokens`` exceed the
    model's context (``max_position_embeddings``), at load time rather than when the row is
    generated (the server refuses it then, possibly mid-run).

    Raises:
        ValueError: naming the file, the row (0-based, as ``PromptRecord.source_index``) and
            ``rollout.max_new_tokens``.
    """
    if context is None:
        return
    for record in records:
        n = len(tokenizer.encode(record.prompt))
        if n + max_new_tokens > context:
            raise ValueError(
                f"{path} row {record.source_index}: {n} prompt tokens + rollout.max_new_tokens="
                f"{max_new_tokens} exceed the model's context length {context} "
                "(max_position_embeddings)"
            )


def validate_run(cfg: RunConfig, world: int | None = None) -> None:
    """Everything ``train`` can refuse before building the trainer: the HF checkpoint, the
    launch plan's layout and model checks at the trainer's world size (``WORLD_SIZE``,
    default 1), and every train and eval row against the context length.

    Raises:
        FileNotFoundError: ``init_checkpoint`` is not an HF checkpoint directory, or a
            dataset is missing.
        ValueError: naming the config field (layout, rollout.engine=vllm without
            rollout.server_urls) or the dataset row (length).
    """
    from megatron_sat.config.layout import check_train_layout

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
        records = load_prompt_dataset(path, tokenizer=tokenizer)
        check_prompt_lengths(records, tokenizer, context, cfg.rollout.max_new_tokens, path)


def run_rl(cfg: RunConfig) -> dict:
    """Run the whole RL job of ``cfg``; returns (and writes) the run summary on rank 0, and an
    empty dict on the other data-parallel ranks (see the module docstring).

    With ``train.resume`` the run continues from its latest committed run checkpoint; when a
    crash came before the first commit there is none and the run starts from step 1 (the
    killed run's metrics and uncommitted folders are dropped)."""
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
    )
    state = None
    fresh_after_crash = False
    if cfg.train.resume:
        if dist.get_rank() == 0:
            clean_uncommitted(cfg.run_dir)
        if dist.is_initialized():
            dist.barrier()
        if latest_run_checkpoint(cfg.run_dir) is not None:
            state = load_run_checkpoint(
                cfg.run_dir, model=trainer.model, optimizer=trainer.optimizer
            )
        else:
            fresh_after_crash = True
            print(f"megatron-sat: no committed run checkpoint in {cfg.run_dir}: from step 1")
    first_step = 1 if state is None else state.step + 1
    pool_state = None if state is None else state.rollout_state
    if cfg.rollout.mode != "sync" and (pool_state or {}).get("batches") is not None:
        # Before any server starts: a pool of another lag, batch or clock is refused here.
        check_pool_state(pool_state, async_pool_config(cfg))
    if first_step > cfg.train.num_steps:
        if state.step == cfg.train.num_steps and not (Path(cfg.run_dir) / "summary.json").exists():
            # Killed after its last run checkpoint, before the HF export and the summary.
            return _finish_after_last_step(cfg, trainer, state)
        raise ValueError(
            f"run_dir {cfg.run_dir} already holds step {first_step - 1} >= train.num_steps="
            f"{cfg.train.num_steps}: nothing to resume (raise train.num_steps)"
        )
    if dist.get_rank() != 0:
        _Followers.follow(trainer, cfg)
        # Writing the checkpoint is a collective (checkpoint.hf_io.save_model_as_hf).
        trainer.save_hf(Path(cfg.run_dir) / "checkpoint", tokenizer_dir=cfg.init_checkpoint)
        return {}
    followers = _Followers(trainer)
    try:
        summary = _lead(cfg, trainer, tokenizer, state, first_step, followers, fresh_after_crash)
    except BaseException:
        if followers.can_abort():
            followers.tell("abort")
        raise
    return summary


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


def _lead(
    cfg: RunConfig,
    trainer: PolicyTrainer,
    tokenizer,
    state,
    first_step: int,
    followers: _Followers,
    fresh_after_crash: bool = False,
) -> dict:
    """Rank 0's part of ``run_rl`` (everything but the set-up shared by all ranks)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    train_records = load_prompt_dataset(cfg.data.train_path, tokenizer=tokenizer)
    eval_records = load_prompt_dataset(cfg.data.eval_path, tokenizer=tokenizer)
    eval_records = eval_records[: cfg.data.num_eval_prompts]
    num_layers, top_k, num_experts = trainer.routing_shape
    ro = cfg.rollout
    prompts = PromptStream(train_records, cfg.train.seed)
    # The data position on resume (older checkpoints: one batch of prompts per step).
    position = (first_step - 1) * ro.prompts_per_step
    if state is not None:
        position = state.data_state.get("prompts_consumed", position)
    for _ in range(position):
        next(prompts)
    t_start = time.time()
    resume_step = None if state is None else state.step
    if fresh_after_crash:
        resume_step = -1  # drop every line the killed run logged
    with (
        rollout_fleet(cfg) as fleet,
        RunLogger(run_dir, resume_step) as logger,
        RewardWorkers() as rewards,  # scored concurrently, math-verify's timeouts on
    ):
        # One meter for both pools: a server is busy while either has a request on it.
        meter = ServerMeter(len(fleet.clients))
        # Routes are asked for only when configured (R3 needs them: RunConfig refuses R3
        # without); a sample without them then trains without the routing diagnostics.
        routing = RoutingSpec(num_layers, top_k, num_experts) if ro.return_routed_experts else None
        pool = RolloutPool(
            fleet.clients,
            tokenizer,
            rewards,
            routing=routing,
            stop_token_ids=[tokenizer.eos_token_id],
            meter=meter,
            dispatch=rollout_dispatch(cfg),
        )
        pools: list[RolloutPool | AsyncRolloutPool] = [pool]
        version = 0 if state is None else state.weight_version
        tensors = followers.hf_tensors  # rank 0 sends the gathered export
        if uses_stage_senders(cfg):  # each pipeline stage sends its own layers
            fleet.updater_cls = functools.partial(StageZeroUpdater, followers, trainer)
            tensors = lambda: STAGE_EXPORT  # noqa: E731
        # Start from identical weights on both sides, tagged with the trainer's version.
        try:  # through sync_servers like every push: a server restarted here reaches the pool
            sync_servers(fleet, pools, tensors, version)
        finally:
            followers.finish_export()
        base_version = version  # the async pool counts batches from here
        pool_start = prompts.consumed  # the data position where the async pool starts drawing
        async_pool = None
        if ro.mode != "sync":
            async_pool = AsyncRolloutPool(
                fleet.clients,
                tokenizer,
                rewards,
                prompts,
                async_pool_config(cfg),
                SamplingParams(
                    temperature=ro.temperature,
                    top_p=ro.top_p,
                    top_k=ro.top_k,
                    max_new_tokens=ro.max_new_tokens,
                    stop_token_ids=(tokenizer.eos_token_id,),
                ),
                routing=routing,
                meter=meter,
                # Batch b is consumed by step first_step + b; drawn counts from pool_start.
                seed_of=lambda b, drawn, slot: request_seed(
                    cfg.train.seed, first_step + b, pool_start + drawn, slot
                ),
            )
            pools.append(async_pool)
            restored = {} if state is None else state.rollout_state
            if restored.get("batches") is not None:
                # The batches generated ahead of the checkpoint, exactly as they were (bounded
                # mode: with the requests in flight then, see AsyncRolloutPool.export_state).
                async_pool.restore_state(restored)
        restart_s = 0.0  # of the current step
        filtered_groups = 0  # synchronous mode's replaced groups, since the start
        # The cumulative counters logged at the checkpoint resumed from: this process counts on.
        counted = {} if state is None else state.extra.get("counters", {})

        def push() -> PushReport:
            """The trainer's weights as ``version`` to every server, dead ones replaced."""
            nonlocal restart_s
            try:
                report = sync_servers(fleet, pools, tensors, version)
            finally:
                followers.finish_export()
            restart_s += report.restart_s
            if report.found_dead:
                tqdm.write(
                    f"rollout servers {list(report.found_dead)} died; restarted and re-synced "
                    f"{list(report.restarted)}; without a server: {list(report.down)}"
                )
            return report

        def revived(call):
            """``call()``; when every server is dead, revive them (``push``) and call again.
            Ends when nothing can be restarted: ``push`` then raises WeightSyncError."""
            while True:
                try:
                    return call()
                except NoLiveServer as e:
                    tqdm.write(f"{e}; reviving the rollout servers")
                    push()

        run_seed = cfg.train.seed

        def run_eval(after_step: int) -> dict[str, float]:
            return revived(
                lambda: evaluate(
                    pool,
                    eval_records,
                    samples_per_prompt=ro.eval_samples_per_prompt,
                    temperature=ro.eval_temperature,
                    max_new_tokens=ro.max_new_tokens,
                    seed_of=lambda i, k: request_seed(run_seed, after_step, i, k, "eval"),
                )
            )

        if state is None:
            initial = run_eval(0)
            logger.log(0, initial)
        else:
            initial = state.extra["initial_eval"]
        progress = tqdm(
            range(first_step, cfg.train.num_steps + 1),
            desc="RL",
            unit="step",
            initial=first_step - 1,
            total=cfg.train.num_steps,
        )
        if async_pool is not None:
            async_pool.start()
        snapshot = meter.snapshot()
        last_acc = initial["eval/acc_greedy"]  # the bar shows the latest held-out accuracy
        for step in progress:
            t0 = time.time()
            restart_s = 0.0
            if async_pool is not None:
                samples = revived(functools.partial(async_pool.get_batch, step - first_step))
            else:

                def seeded(records, step=step):
                    # The records were just drawn: data positions consumed - len .. consumed.
                    first = prompts.consumed - len(records)
                    return functools.partial(
                        pool.generate_groups,
                        records,
                        ro.group_size,
                        temperature=ro.temperature,
                        top_p=ro.top_p,
                        top_k=ro.top_k,
                        max_new_tokens=ro.max_new_tokens,
                        seed_of=lambda g, j: request_seed(run_seed, step, first + g, j),
                    )

                samples, replaced = informative_batch(
                    lambda records: revived(seeded(records)),
                    prompts,
                    ro.prompts_per_step,
                    ro.group_size,
                    ro.max_replacement_groups,
                )
                filtered_groups += replaced
            t_gen = time.time() - t0
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
            advantages = compute_grpo_advantages(rewards, ro.group_size)
            metrics = batch_metrics(samples, version)
            followers.tell("step", step)
            diagnostic = routing_diagnostic_due(cfg.train.routing_diagnostic_interval, step)
            train = distributed_rl_step(
                trainer, samples, advantages, cfg, version, routing_diagnostic=diagnostic
            )
            followers.idle()
            metrics.update({f"train/{k}": v for k, v in train.items()})
            version += 1
            t_sync = t_eval = 0.0
            pool_state = None
            eval_due = step % cfg.train.eval_every == 0 or step == cfg.train.num_steps
            evaluated = None
            if async_pool is not None:
                revived(functools.partial(async_pool.wait_before_update, version - base_version))
                t1 = time.time()
                push()
                t_sync = time.time() - t1
                if eval_due:
                    # Before the pool goes on: none of its requests is in flight now (fixed
                    # lag: the batches of the pushed version are done; the logical clock
                    # pauses), so no rollout shares a server batch with the evaluation (the
                    # embedded engine's log-probs depend on the batch).
                    evaluated = run_eval(step)
                    t_eval = time.time() - t1 - t_sync
                if due(cfg, step):
                    # Fixed lag: the complete batches ahead are saved, the next one re-created;
                    # bounded: everything admitted, as it stands (the logical clock: paused).
                    pool_state = revived(
                        functools.partial(async_pool.export_state, step - first_step + 1)
                    )
                async_pool.set_version(version - base_version)
            elif version % ro.update_weights_interval == 0:
                t1 = time.time()
                push()
                t_sync = time.time() - t1
            metrics.update(
                {
                    "time/generate_s": t_gen,
                    "time/sync_s": t_sync,  # restarts and regrouping included
                    "time/restart_s": restart_s,
                    "time/step_s": time.time() - t0 - t_eval,
                }
            )
            if eval_due:
                metrics.update(run_eval(step) if evaluated is None else evaluated)
                last_acc = metrics["eval/acc_greedy"]
            # Per server index, since the previous step's log (evaluation included).
            now = meter.snapshot()
            metrics.update(server_metrics(snapshot, now))
            snapshot = now
            counters = {
                "rollout/reissued": float(sum(p.stats.reissued for p in pools)),
                "rollout/server_restarts": float(sum(fleet.restarts)),
                "rollout/filtered_groups": float(
                    filtered_groups
                    + (0 if async_pool is None else async_pool.stats.filtered_groups)
                ),
            }
            counters = {k: counted.get(k, 0.0) + v for k, v in counters.items()}
            metrics.update(counters)
            metrics["rollout/dead_servers"] = float(len(fleet.down))
            logger.log(step, metrics)
            followers.tell("save", step)
            drawn = prompts.consumed  # the prompts admitted ahead are drawn again on resume
            if pool_state is not None:
                drawn = pool_start + pool_state["drawn"]
            elif async_pool is not None:
                drawn = pool_start + async_pool.drawn_before(step - first_step + 1)
            save_if_due(
                cfg,
                trainer,
                step,
                version=version,
                initial=initial,
                prompts=drawn,
                rollout_state=pool_state,
                counters=counters,
            )
            followers.idle()
            progress.set_postfix(
                reward=f"{metrics['rollout/reward']:.3f}",
                acc=f"{last_acc:.3f}",
            )
        final = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if async_pool is not None:
            async_pool.stop()
        pool.close()
        followers.tell("done")
        checkpoint = trainer.save_hf(run_dir / "checkpoint", tokenizer_dir=cfg.init_checkpoint)
        summary = make_summary(cfg, initial, final, run_dir, checkpoint, time.time() - t_start)
        logger.write_summary(summary)
    print(json.dumps(summary, indent=2))
    return summary


def routing_diagnostic_due(interval: int, step: int) -> bool:
    """Whether optimizer step ``step`` (1-based) runs the live-routing diagnostic forward at
    ``train.routing_diagnostic_interval`` = ``interval`` (every ``interval`` steps, as
    ``train.save_every`` counts; 0 = never).

    Raises:
        ValueError: ``interval`` < 0 or ``step`` < 1.
    """
    if interval < 0 or step < 1:
        raise ValueError(f"routing_diagnostic_due: interval={interval} < 0 or step={step} < 1")
    return interval > 0 and step % interval == 0


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
) -> None:
    """Run checkpoint after ``step`` every ``train.save_every`` steps and after the last one
    (collective: every rank calls it; rank 0's version and data position, ``prompts``
    consumed from the prompt stream by the batches trained on so far, are written, with the
    cumulative ``counters`` logged at ``step``, which a resumed run counts on from)."""
    if not due(cfg, step):
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
