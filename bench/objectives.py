"""SAT-GSPO's loss cost: over plain GSPO's loss, and over a train step of the main job's model.

Side by side in one run, one process (CPU; gloo world of 1 for the trainer):

1. Loss alone, on about one million active tokens (``--tokens``; rows of 64..320 tokens, random
   fp32 log-probs with a per-response and a per-token mismatch to the rollout log-probs, one
   advantage per response): ``policy_loss`` forward + ``backward`` for "gspo" and "sat-gspo"
   (token-mean, eps 0.2, alpha 0.9, q from the batch), alternated repeat by repeat (order
   swapped every repeat) so that machine load drifts hit both. Times are process CPU time:
   with ``--threads 1`` CPU time is the work done, while wall-clock time on a shared machine
   also counts waiting for a core. ``ratio`` = median over repeats of the per-repeat ratio
   SAT-GSPO / GSPO (goal <= 1.03): each repeat times the two back to back, so load that drifts
   over the run cancels within a pair, and the median ignores the pairs a burst of load hit.
   Also reported: ``ratio_fast_quarter`` (mean of the fastest quarter of each objective's
   repeats, one over the other), ``ratio_min`` (fastest / fastest) and ``ratio_wall`` (the
   median ratio in wall-clock time); ``*_loss_s`` are the fast-quarter means. Measured on this
   2-core machine: 1.013 and 1.017 in two runs of 200 repeats (0.98-1.02 with 100), while the
   fast-quarter ratio moved between 0.99 and 1.06 from run to run. The intrinsic SAT-GSPO work
   over GSPO's is O(B): radii and quantile per response, not per token (about 1.5%).
2. A train step of the main job: the model of ``examples/models/qwen3_moe_tiny.json`` (random
   weights, char tokenizer's vocabulary) in ``PolicyTrainer.rl_step`` with SAT-GSPO and R3 on a
   batch shaped like the main job's (``examples/configs/tiny_cpu_sat_gspo_r3.yaml``: 32 arithmetic
   prompts with the chat template x 8 samples, 1..10 response tokens, one micro-batch of 256),
   rollout log-probs = the model's own plus noise. Reported: the step's time and tokens, the
   SAT-GSPO loss time on that step's own batch shape and its share of the step
   (``sat_loss_over_train_step``), and per token, the 1M-token SAT-GSPO loss over the train step
   (``sat_loss_over_train_step_per_token``).

The last line is JSON with every figure. Usage:
``python bench/objectives.py [--tokens 1000000] [--repeats 200] [--steps 5] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def loss_batch(num_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 loss inputs with about ``num_tokens`` active tokens (rows of 64..320)."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(1, num_tokens // 192)
    lengths = torch.randint(64, 321, (rows,), generator=gen)
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rollout = -3.0 * torch.rand(rows, width, generator=gen)
    per_row = 0.05 * torch.randn(rows, 1, generator=gen)
    log_probs = rollout + per_row + 0.1 * torch.randn(rows, width, generator=gen)
    advantages = torch.randn(rows, generator=gen)
    return {"log_probs": log_probs, "rollout": rollout, "adv": advantages, "mask": mask}


def time_loss(batch: dict[str, torch.Tensor], name: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ``policy_loss`` forward + backward."""
    from megatron_sat.objectives import ObjectiveConfig, policy_loss

    config = ObjectiveConfig(name=name)
    log_probs = batch["log_probs"].clone().requires_grad_(True)
    start, start_cpu = time.perf_counter(), time.process_time()
    loss, _ = policy_loss(log_probs, batch["rollout"], batch["adv"], batch["mask"], config)
    loss.backward()
    return time.process_time() - start_cpu, time.perf_counter() - start


def compare_losses(batch: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """GSPO and SAT-GSPO loss times (fast-quarter means) and their ratios (module docstring)."""
    for name in ("gspo", "sat-gspo"):  # warm-up: allocator, first-call overheads
        time_loss(batch, name)
    times: dict[str, list[tuple[float, float]]] = {"gspo": [], "sat-gspo": []}
    for i in range(repeats):
        for name in ("gspo", "sat-gspo") if i % 2 == 0 else ("sat-gspo", "gspo"):
            times[name].append(time_loss(batch, name))
    cpu = {n: [t[0] for t in v] for n, v in times.items()}
    wall = {n: [t[1] for t in v] for n, v in times.items()}
    fast = {n: statistics.mean(sorted(v)[: max(1, len(v) // 4)]) for n, v in cpu.items()}
    return {
        "gspo_loss_s": fast["gspo"],
        "sat_gspo_loss_s": fast["sat-gspo"],
        "ratio": statistics.median(
            s / g for s, g in zip(cpu["sat-gspo"], cpu["gspo"], strict=True)
        ),
        "ratio_fast_quarter": fast["sat-gspo"] / fast["gspo"],
        "ratio_min": min(cpu["sat-gspo"]) / min(cpu["gspo"]),
        "ratio_wall": statistics.median(
            s / g for s, g in zip(wall["sat-gspo"], wall["gspo"], strict=True)
        ),
    }


def main_job_samples(trainer, tokenizer, seed: int = 0) -> list:
    """32 prompts x 8 samples shaped like the main job's batch, with random R3 routes."""
    from megatron_sat.rollout.arith import make_arith_splits
    from megatron_sat.rollout.types import Sample

    rng = np.random.default_rng(seed)
    rows, _ = make_arith_splits(32, 0, seed=seed, max_digits=2)
    layers, top_k, experts = trainer.routing_shape
    samples = []
    for g, row in enumerate(rows):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer.encode(text)
        for j in range(8):
            r = int(rng.integers(1, 11))
            response = rng.integers(3, len(tokenizer), size=r).tolist()
            n = len(prompt) + r - 1
            routes = np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :top_k]
            samples.append(
                Sample(
                    index=g * 8 + j,
                    group_index=g,
                    prompt=text,
                    label=row["label"],
                    prompt_ids=prompt,
                    response_ids=response,
                    rollout_log_probs=[0.0] * r,
                    response_versions=[0] * r,
                    routed_experts=routes.astype(np.uint8),
                )
            )
    mb = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=True)
    ((log_probs, _),) = trainer._no_grad_log_probs(mb, replay=True)
    gen = torch.Generator().manual_seed(seed)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        noise = 0.05 * torch.randn(r, generator=gen)
        s.rollout_log_probs = (log_probs[row, p - 1 : p + r - 1] + noise).tolist()
    return samples


def train_step(steps: int) -> dict[str, float]:
    """Median rl_step time of the main job's model and batch, and the loss on its shape."""
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.objectives import ObjectiveConfig, compute_grpo_advantages
    from megatron_sat.rollout.tokenizer import build_char_tokenizer
    from megatron_sat.training.trainer import PolicyTrainer

    tokenizer = build_char_tokenizer()
    hf_config = json.loads((ROOT / "examples/models/qwen3_moe_tiny.json").read_text())
    hf_config.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    trainer = PolicyTrainer(
        hf_config,
        TrainConfig(micro_batch_size=256, use_r3=True),
        ParallelConfig(),
        pad_token_id=tokenizer.pad_token_id,
        load_from=None,
    )
    samples = main_job_samples(trainer, tokenizer)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(samples))])
    advantages = compute_grpo_advantages(rewards, 8)
    objective = ObjectiveConfig(name="sat-gspo")
    trainer.rl_step(samples, advantages, objective)  # warm-up
    cpu, wall = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        metrics = trainer.rl_step(samples, advantages, objective)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    (mb,) = trainer.micro_batches(samples, advantages, with_routes=True)
    batch = {
        "log_probs": mb.rollout_log_probs + 0.05 * torch.randn(mb.rollout_log_probs.shape),
        "rollout": mb.rollout_log_probs,
        "adv": mb.advantages,
        "mask": mb.loss_mask.bool(),
    }
    on_batch = compare_losses(batch, repeats=max(steps, 9))
    return {
        "train_step_s": statistics.median(cpu),
        "train_step_wall_s": statistics.median(wall),
        "train_step_tokens": int(metrics["num_tokens"]),
        "sat_gspo_loss_on_train_batch_s": on_batch["sat_gspo_loss_s"],
        "gspo_loss_on_train_batch_s": on_batch["gspo_loss_s"],
    }


def main() -> None:
    """Run both measurements and print the JSON line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = loss_batch(args.tokens)
    tokens = int(batch["mask"].sum())
    losses = compare_losses(batch, args.repeats)
    print(
        f"loss on {tokens} tokens: gspo {losses['gspo_loss_s']:.4f} s, sat-gspo "
        f"{losses['sat_gspo_loss_s']:.4f} s, ratio {losses['ratio']:.4f} (fast quarter "
        f"{losses['ratio_fast_quarter']:.4f}, min {losses['ratio_min']:.4f}, wall "
        f"{losses['ratio_wall']:.4f})",
        flush=True,
    )
    step = train_step(args.steps)
    print(
        f"train step ({step['train_step_tokens']} tokens): {step['train_step_s']:.4f} s; "
        f"sat-gspo loss on its batch {step['sat_gspo_loss_on_train_batch_s']:.5f} s",
        flush=True,
    )
    per_token_loss = losses["sat_gspo_loss_s"] / tokens
    per_token_step = step["train_step_s"] / step["train_step_tokens"]
    result = {
        "tokens": tokens,
        **losses,
        **step,
        "sat_loss_over_train_step": step["sat_gspo_loss_on_train_batch_s"] / step["train_step_s"],
        "sat_loss_over_train_step_per_token": per_token_loss / per_token_step,
        "threads": args.threads,
        "goal_ratio": 1.03,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
