"""Asynchronous RL throughput: samples/s at fixed lag 1, 4, 8 and synchronous, vs the bound.

Side by side in one run, on the main job's model (examples/models/qwen3_moe_tiny.json, random
weights) with one embedded rollout server. The trainer and the server get one CPU thread each
(``--threads``), so that the two pipeline stages can overlap on a 2-core machine.

- stage times alone: ``generate`` = one batch on the server with the trainer idle;
  ``train`` = one ``rl_step`` plus the weight sync, with the server idle.
- the pipelining bound: ``batch / max(generate, train)`` samples/s (the slowest stage).
- ``sync``: generate, then train, then sync, one after the other.
- ``lag n``: the AsyncRolloutPool in fixed-lag mode: generation of batch t + n overlaps the
  training of batch t.

The whole set runs ``--repeats`` times (default 3) in one process; the last line is JSON with
each figure's median over the rounds. ``fraction_of_bound`` is the lowest lag-n throughput
over the bound of the same round (issue #5 goal: >= 0.9; issue 24: the median of three).
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
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def records():
    from megatron_sat.rollout.arith import make_arith_rows
    from megatron_sat.rollout.datasets import PromptRecord

    rows = make_arith_rows(2000, seed=0, max_digits=2)
    for i in itertools.count():
        row = rows[i % len(rows)]
        yield PromptRecord(prompt=row["prompt"], label=row["label"], source_index=i)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.objectives import ObjectiveConfig, compute_grpo_advantages
    from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
    from megatron_sat.rollout.client import RoutingSpec, SamplingParams
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
    objective = ObjectiveConfig(name="sat-gspo")
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=(1,))
    batch = args.prompts * args.group_size
    routing = RoutingSpec(*trainer.routing_shape)

    def train(samples) -> None:
        rewards = torch.tensor([s.reward for s in samples])
        trainer.rl_step(samples, compute_grpo_advantages(rewards, args.group_size), objective)

    def one_round(generate, train, updater, client, sync_pool, prompts) -> dict:
        """Stage times, the bound, sync and lag 1/4/8 throughputs, back to back."""
        version = 0
        t0 = time.perf_counter()
        samples = [generate() for _ in range(3)][-1]
        t_gen = (time.perf_counter() - t0) / 3
        t0 = time.perf_counter()
        for _ in range(3):
            train(samples)
            version += 1
            updater.update(trainer.hf_tensors(), weight_version=str(version))
        t_train = (time.perf_counter() - t0) / 3
        bound = batch / max(t_gen, t_train)

        t0 = time.perf_counter()
        for _ in range(args.steps):
            train(generate())
            version += 1
            updater.update(trainer.hf_tensors(), weight_version=str(version))
        sync_rate = args.steps * batch / (time.perf_counter() - t0)

        rates = {}
        for lag in (1, 4, 8):
            pool = AsyncRolloutPool(
                [client],
                tokenizer,
                math_reward,
                prompts,
                AsyncPoolConfig(
                    mode="fixed_lag",
                    lag=lag,
                    prompts_per_batch=args.prompts,
                    group_size=args.group_size,
                ),
                sampling,
                routing=routing,
            )
            # Batch indices count from the pool's own version 0.
            updater.update(trainer.hf_tensors(), weight_version="0")
            pool.start()
            # The first `lag` steps fill the pipeline and are not timed.
            for step in range(lag + args.steps):
                if step == lag:
                    t0 = time.perf_counter()
                train(pool.get_batch(step))
                pool.wait_before_update(step + 1)
                updater.update(trainer.hf_tensors(), weight_version=str(step + 1))
                pool.set_version(step + 1)
            rates[lag] = args.steps * batch / (time.perf_counter() - t0)
            pool.stop()
        return {
            "generate_s": t_gen,
            "train_and_sync_s": t_train,
            "bound_samples_per_s": bound,
            "sync_samples_per_s": sync_rate,
            **{f"lag{n}_samples_per_s": r for n, r in rates.items()},
            "fraction_of_bound": min(rates.values()) / bound,
        }

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
            version = 0
            updater.update(trainer.hf_tensors(), weight_version=str(version))
            sync_pool = RolloutPool(
                [client], tokenizer, math_reward, routing=routing, stop_token_ids=[1]
            )
            prompts = records()

            def generate():
                recs = [next(prompts) for _ in range(args.prompts)]
                return sync_pool.generate_groups(
                    recs, args.group_size, temperature=1.0, max_new_tokens=10
                )

            generate()  # warm-up
            rounds = []
            for _ in range(args.repeats):
                rounds.append(one_round(generate, train, updater, client, sync_pool, prompts))
                print(f"round {len(rounds)}: {json.dumps(rounds[-1])}", flush=True)
            sync_pool.close()
    result = {
        "batch_samples": batch,
        "repeats": args.repeats,
        # each figure: the median over the rounds (each round's bound and throughputs are
        # measured back to back, so a round compares like with like on a loaded machine)
        **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "fraction_of_bound_rounds": [r["fraction_of_bound"] for r in rounds],
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    for key, value in result.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
