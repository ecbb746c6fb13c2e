"""Train-inference mismatch at top-p 0.9 with and without sampling-mask replay, on the main
job's model: the embedded engine in bf16 samples (SGLang's top-p rule), the fp32 trainer
(``PolicyTrainer``, as in the RL loop) scores the same tokens at equal weights.

    python bench/sampling_mask.py [--checkpoint checkpoints/warm_start]
        [--data data/arith/train.jsonl]

The reference is the distribution the engine sampled each token from: its own bf16 logits at
that step (recorded inside ``GenerationEngine._sample``), truncated by the rule
(``objectives.sampling_mask``, checked against SGLang's sampler in tests/test_sampling_mask.py).
The trainer's log-probs come from its real no-grad pass (``PolicyTrainer._no_grad_log_probs``,
the vocab-parallel ``fp32_log_probs``) with ``rollout.replay_sampling_mask`` off (the full
softmax, SGLang's convention) and on (``training.sampling_mask_tp``). Per sampled token
``|log pi_trainer(y) - log q_engine(y)|``. The checkpoint is the main job's warm start
(``bash examples/run_cpu.sh`` makes it). Last line JSON: ``mismatch_no_replay`` and
``mismatch_replay`` (mean and max, nats), ``kept_set_differs`` (fraction of positions where
the trainer's kept set differs from the engine's: the residual's cause), ``tokens``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def engine_samples(engine, sampling, prompts):
    """Generate; return the samples, each token's log-prob under the engine's sampling
    distribution as ``rollout_log_probs``, and the engine's (logits [B, V], tokens [B]) per
    step."""
    from megatron_sat.objectives.sampling_mask import truncated_log_probs
    from megatron_sat.rollout.embedded.engine import EngineRequest
    from megatron_sat.rollout.types import Sample

    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    sample = engine._sample

    def recording(logits, params, positions=None):
        tokens, logprobs = sample(logits, params, positions)
        steps.append((logits.float().clone(), tokens.clone()))
        return tokens, logprobs

    engine._sample = recording
    outputs = engine.generate([EngineRequest(p, sampling) for p in prompts])
    samples = []
    for b, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        logits = torch.cat([steps[t][0][b : b + 1] for t in range(len(out.output_ids))])
        tokens = torch.tensor(out.output_ids, dtype=torch.long)
        assert all(int(steps[t][1][b]) == int(y) for t, y in enumerate(tokens))
        q = truncated_log_probs(logits, tokens, top_p=sampling.top_p) if len(tokens) else []
        samples.append(
            Sample(
                index=b,
                group_index=b,
                prompt="",
                label="",
                prompt_ids=prompt,
                response_ids=tokens.tolist(),
                rollout_log_probs=[float(x) for x in q],
                response_versions=[0] * len(tokens),
            )
        )
    return samples, steps


def trainer_gaps(trainer, samples) -> torch.Tensor:
    """|log pi_trainer - log q_engine| [tokens] through the trainer's no-grad log-prob pass."""
    mbs = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
    out = []
    for mb, (lp, _) in zip(mbs, trainer._no_grad_log_probs(mbs, replay=False), strict=True):
        out.append((lp - mb.rollout_log_probs)[mb.samples.loss_mask.bool()].abs())
    return torch.cat(out)


@torch.no_grad()
def kept_set_differences(trainer, samples, steps, top_p: float) -> int:
    """Positions where SGLang's kept set from the trainer's fp32 logits differs from the one
    from the engine's bf16 logits."""
    from megatron_sat.objectives.sampling_mask import kept_mask

    trainer.model.eval()
    differs = 0
    for b, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        rows = trainer.model(ids, torch.arange(ids.shape[1])[None], None)[0].float()
        p = len(s.prompt_ids)
        for t in range(len(s.response_ids)):
            ours = kept_mask(torch.softmax(rows[p - 1 + t : p + t], -1), top_p, -1)
            theirs = kept_mask(torch.softmax(steps[t][0][b : b + 1], -1), top_p, -1)
            differs += int(not torch.equal(ours, theirs))
    return differs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="checkpoints/warm_start")
    parser.add_argument("--data", default="data/arith/train.jsonl")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from megatron_sat.checkpoint.hf_io import read_hf_config
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.rollout.embedded.engine import GenerationEngine
    from megatron_sat.rollout.sampling import SamplingParams
    from megatron_sat.training.sampling_mask_tp import SamplingMask
    from megatron_sat.training.trainer import PolicyTrainer

    ckpt = Path(args.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()][: args.prompts]
    prompts = [tokenizer.encode(r["prompt"]) for r in rows for _ in range(args.samples_per_prompt)]
    sampling = SamplingParams(
        temperature=1.0,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
    )

    engine = GenerationEngine(str(ckpt), seed=0, dtype="bfloat16")
    samples, steps = engine_samples(engine, sampling, prompts)

    init_distributed(ParallelConfig(), seed=0)
    trainer = PolicyTrainer(
        read_hf_config(ckpt),
        TrainConfig(use_r3=False, micro_batch_size=16),
        ParallelConfig(),
        pad_token_id=tokenizer.pad_token_id or 0,
        load_from=ckpt,
    )
    gaps = {}
    for name, mask in (("no_replay", None), ("replay", SamplingMask(1.0, args.top_p, -1))):
        trainer.sampling_mask = mask  # what rollout.replay_sampling_mask sets
        gaps[name] = trainer_gaps(trainer, samples)
    differs = kept_set_differences(trainer, samples, steps, args.top_p)
    tokens = gaps["replay"].numel()
    result = {
        f"mismatch_{k}": {"mean": round(float(v.mean()), 6), "max": round(float(v.max()), 6)}
        for k, v in gaps.items()
    }
    result.update(
        top_p=args.top_p,
        tokens=tokens,
        kept_set_differs=round(differs / tokens, 4),
        checkpoint=str(ckpt),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
