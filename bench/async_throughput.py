"""Asynchronous RL throughput: samples/s at fixed lag 1, 4, 8 and synchronous, vs the bound.

Side by side in one run, on the main job's model (examples/models/qwen3_moe_tiny.json, random
weights) with one embedded rollout server. The trainer and the server get one CPU thread each
(``--threads``), so that the two pipeline stages can overlap on a 2-core machine.

- ``sync``: ``--steps`` steps of generate, then train, then sync, one after the other. Each
  step's two stages are timed there, each with the other stage idle: ``generate`` = one batch
  on the server (with its rewards), ``train_and_sync`` = one ``rl_step`` plus the weight sync.
- the pipelining bound: ``batch / max(generate, train_and_sync)`` samples/s (the slowest stage),
  from the means over those ``--steps`` steps, the same number of steps a lag-n throughput
  is measured over, alternating the two stages as the pipeline does.
- ``lag n``: the AsyncRolloutPool in fixed-lag mode: generation of batch t + n overlaps the
  training of batch t. Per step, where the time went: ``lag{n}_train_s`` (the ``rl_step``
  beside the generation), ``lag{n}_wait_batch_s`` (``get_batch``),
  ``lag{n}_wait_before_update_s`` (generation still running when the step ended: the
  generation stage was the slow one), ``lag{n}_sync_s`` (the push, the server paused).

``fraction_of_bound`` is the lowest lag-n throughput over the bound of the same round (issue #5
goal: >= 0.9; issue 24: the median of three rounds). Until issue 24 the bound's stage times
were the means of 3 back-to-back steps per stage, taken before the sync run; that bound varied
by a third between rounds on an idle machine (267-366 samples/s), more than the figure's
margin. Its figures are kept beside the new ones: ``bound_3step_samples_per_s`` and
``fraction_of_bound_3step``.

The whole set runs ``--repeats`` times (default 3) in one process, the lags in a rotated order
each round (so no lag always runs first or last while the machine's load drifts); the last
line is JSON with each figure's median over the rounds and the load average before and after.
Usage: ``python bench/async_throughput.py [--steps 12] [--prompts 16] [--group-size 8]
[--repeats 3]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
LAGS = (1, 4, 8)
MAX_NEW_TOKENS = 10


def records():
    from megatron_sat.rollout.arith import make_arith_rows
    from megatron_sat.rollout.datasets import PromptRecord

    rows = make_arith_rows(2000, seed=0, max_digits=2)
    for i in itertools.count():
        row = rows[i % len(rows)]
        yield PromptRecord(prompt=row["prompt"], label=row["label"], source_index=i)


@dataclass
class Setup:
    """What every measurement of a round uses: the trainer, the server's client and updater,
    the prompt stream, and ``generate`` (one batch from the synchronous pool)."""

    args: argparse.Namespace
    trainer: Any
    tokenizer: Any
    updater: Any
    client: Any
    prompts: Iterator
    generate: Callable[[], list]
    batch: int

    def train(self, samples) -> None:
        """One ``rl_step`` on ``samples`` (GRPO advantages of their rewards)."""
        from megatron_sat.objectives import ObjectiveConfig, compute_grpo_advantages

        rewards = torch.tensor([s.reward for s in samples])
        advantages = compute_grpo_advantages(rewards, self.args.group_size)
        self.trainer.rl_step(samples, advantages, ObjectiveConfig(name="sat-gspo"))

    def push(self, version: int) -> None:
        """The weight sync: the trainer's weights to the server as ``version``."""
        self.updater.update(self.trainer.hf_tensors(), weight_version=str(version))


def stage_times(setup: Setup, version: int) -> dict:
    """The sync run: ``--steps`` steps of generate, train, sync; the stage times (s), the
    bound and the sync throughput (samples/s)."""
    steps = setup.args.steps
    t_gen, t_train = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        samples = setup.generate()
        t1 = time.perf_counter()
        setup.train(samples)
        version += 1
        setup.push(version)
        t_gen.append(t1 - t0)
        t_train.append(time.perf_counter() - t1)
    gen, train_sync = statistics.mean(t_gen), statistics.mean(t_train)
    return {
        "generate_s": gen,
        "train_and_sync_s": train_sync,
        "bound_samples_per_s": setup.batch / max(gen, train_sync),
        "sync_samples_per_s": steps * setup.batch / (sum(t_gen) + sum(t_train)),
    }


def bound_3step(setup: Setup) -> float:
    """The bound as measured until issue 24 (samples/s): 3 generates, then 3 train + sync."""
    t0 = time.perf_counter()
    samples = [setup.generate() for _ in range(3)][-1]
    t_gen = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    for version in range(1, 4):
        setup.train(samples)
        setup.push(version)
    return setup.batch / max(t_gen, (time.perf_counter() - t0) / 3)


def lag_run(setup: Setup, lag: int) -> dict:
    """``--steps`` timed steps at fixed lag ``lag``: samples/s and where each step went (s)."""
    from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
    from megatron_sat.rollout.client import RoutingSpec, SamplingParams
    from megatron_sat.rollout.rewards import math_reward

    args = setup.args
    pool = AsyncRolloutPool(
        [setup.client],
        setup.tokenizer,
        math_reward,
        setup.prompts,
        AsyncPoolConfig(
            mode="fixed_lag", lag=lag, prompts_per_batch=args.prompts, group_size=args.group_size
        ),
        SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=(1,)),
        routing=RoutingSpec(*setup.trainer.routing_shape),
    )
    setup.push(0)  # batch indices count from the pool's own version 0
    pool.start()
    spent = {"wait_batch_s": 0.0, "train_s": 0.0, "wait_before_update_s": 0.0, "sync_s": 0.0}
    # The first `lag` steps fill the pipeline and are not timed.
    for step in range(lag + args.steps):
        if step == lag:
            spent = dict.fromkeys(spent, 0.0)
            t0 = time.perf_counter()
        marks = [time.perf_counter()]
        samples = pool.get_batch(step)
        marks.append(time.perf_counter())
        setup.train(samples)
        marks.append(time.perf_counter())
        pool.wait_before_update(step + 1)
        marks.append(time.perf_counter())
        setup.push(step + 1)
        pool.set_version(step + 1)
        marks.append(time.perf_counter())
        for key, (start, end) in zip(spent, itertools.pairwise(marks), strict=True):
            spent[key] += end - start
    rate = args.steps * setup.batch / (time.perf_counter() - t0)
    pool.stop()
    return {
        f"lag{lag}_samples_per_s": rate,
        **{f"lag{lag}_{key}": total / args.steps for key, total in spent.items()},
    }


def one_round(setup: Setup, index: int) -> dict:
    """The old bound, the sync run with the stage times and bound, then lag 1/4/8 (rotated
    by ``index``), back to back."""
    old_bound = bound_3step(setup)
    figures = stage_times(setup, version=3)
    lags = LAGS[index % len(LAGS) :] + LAGS[: index % len(LAGS)]
    for lag in lags:
        figures.update(lag_run(setup, lag))
    slowest = min(figures[f"lag{n}_samples_per_s"] for n in lags)
    return {
        **figures,
        "fraction_of_bound": slowest / figures["bound_samples_per_s"],
        "bound_3step_samples_per_s": old_bound,
        "fraction_of_bound_3step": slowest / old_bound,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians")
    args = parser.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    torch.set_num_threads(args.threads)
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.rollout.client import RoutingSpec
    from megatron_sat.rollout.embedded.launch import EmbeddedServer
    from megatron_sat.rollout.pool import RolloutPool
    from megatron_sat.rollout.rewards import math_reward
    from megatron_sat.rollout.tokenizer import build_char_tokenizer
    from megatron_sat.training.trainer import PolicyTrainer
    from megatron_sat.weight_sync.broadcast import WeightUpdater

    tokenizer = build_char_tokenizer()
    hf_config = json.loads((REPO / "examples/models/qwen3_moe_tiny.json").read_text())
    hf_config.update(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1)
    trainer = PolicyTrainer(
        hf_config, TrainConfig(lr=1e-4), ParallelConfig(), pad_token_id=0, load_from=None
    )
    batch = args.prompts * args.group_size
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = trainer.save_hf(Path(tmp) / "model")
        tokenizer.save_pretrained(ckpt)
        server = EmbeddedServer(
            ckpt,
            random_seed=0,
            max_running_requests=batch,
            env={"OMP_NUM_THREADS": str(args.threads)},
        )
        with server, WeightUpdater([server.client()]) as updater:
            client = server.client()
            updater.update(trainer.hf_tensors(), weight_version="0")
            sync_pool = RolloutPool(
                [client],
                tokenizer,
                math_reward,
                routing=RoutingSpec(*trainer.routing_shape),
                stop_token_ids=[1],
            )
            prompts = records()

            def generate():
                recs = [next(prompts) for _ in range(args.prompts)]
                return sync_pool.generate_groups(
                    recs, args.group_size, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS
                )

            setup = Setup(args, trainer, tokenizer, updater, client, prompts, generate, batch)
            generate()  # warm-up
            rounds = []
            for index in range(args.repeats):
                rounds.append(one_round(setup, index))
                print(f"round {len(rounds)}: {json.dumps(rounds[-1])}", flush=True)
            sync_pool.close()
    result = {
        "batch_samples": batch,
        "repeats": args.repeats,
        # each figure: the median over the rounds (each round's bound and throughputs are
        # measured back to back, so a round compares like with like on a loaded machine)
        **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "fraction_of_bound_rounds": [r["fraction_of_bound"] for r in rounds],
        "fraction_of_bound_3step_rounds": [r["fraction_of_bound_3step"] for r in rounds],
        "load_avg_before": load_before,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    for key, value in result.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
