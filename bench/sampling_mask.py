"""Train-inference mismatch at top-p 0.9 with and without sampling-mask replay, on the main
job's model: the embedded engine in bf16 samples (SGLang's top-p rule), the fp32 trainer
(``PolicyTrainer``, as in the RL loop) scores the same tokens at equal weights.

    python bench/sampling_mask.py [--checkpoint checkpoints/warm_start]
        [--data data/arith/train.jsonl]

The reference is the distribution the engine sampled each token from: its own bf16 logits at
that step (recorded inside ``GenerationEngine._sample``), truncated by the rule
(``objectives.sampling_mask``, checked against SGLang's sampler in tests/test_sampling_mask.py).
Per sampled token, ``|log pi_trainer(y) - log q_engine(y)|`` with ``pi_trainer`` the full
softmax (no replay: SGLang's convention, what the trainer scores today) or the truncated one
recomputed from the trainer's logits (replay). The checkpoint is the main job's warm start
(``bash examples/run_cpu.sh`` makes it). Last line JSON: ``mismatch_no_replay`` and
``mismatch_replay`` (mean and max, nats), ``kept_set_differs`` (fraction of positions where
the trainer's kept set differs from the engine's), ``tokens``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


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
    from megatron_sat.objectives.sampling_mask import kept_mask, truncated_log_probs
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.rollout.embedded.engine import EngineRequest, GenerationEngine
    from megatron_sat.rollout.sampling import SamplingParams
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
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # (logits [B, V], tokens [B]) per step
    sample = engine._sample

    def recording(logits, params, positions=None):
        tokens, logprobs = sample(logits, params, positions)
        steps.append((logits.float().clone(), tokens.clone()))
        return tokens, logprobs

    engine._sample = recording
    outputs = engine.generate([EngineRequest(p, sampling) for p in prompts])

    init_distributed(ParallelConfig(), seed=0)
    trainer = PolicyTrainer(
        read_hf_config(ckpt),
        TrainConfig(use_r3=False),
        ParallelConfig(),
        pad_token_id=tokenizer.pad_token_id or 0,
        load_from=ckpt,
    )
    trainer.model.eval()
    gaps = {"no_replay": [], "replay": []}
    differs = 0
    top_p = args.top_p
    with torch.no_grad():
        for b, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            if not out.output_ids:
                continue
            ids = torch.tensor([prompt + out.output_ids])
            rows = trainer.model(ids, torch.arange(ids.shape[1])[None], None)[0].float()
            for t, token in enumerate(out.output_ids):
                engine_logits, engine_tokens = steps[t]
                assert int(engine_tokens[b]) == token
                y = torch.tensor([token])
                ref = truncated_log_probs(engine_logits[b : b + 1], y, top_p=top_p)
                logits = rows[len(prompt) - 1 + t : len(prompt) + t]
                full = torch.log_softmax(logits, dim=-1)[0, token]
                mine = truncated_log_probs(logits, y, top_p=top_p)
                gaps["no_replay"].append(float((full - ref).abs()))
                gaps["replay"].append(float((mine - ref).abs()))
                ours = kept_mask(torch.softmax(logits, -1), top_p, -1)
                theirs = kept_mask(torch.softmax(engine_logits[b : b + 1], -1), top_p, -1)
                differs += int(not torch.equal(ours, theirs))
    tokens = len(gaps["replay"])
    result = {
        f"mismatch_{k}": {"mean": round(sum(v) / tokens, 6), "max": round(max(v), 6)}
        for k, v in gaps.items()
    }
    result.update(
        top_p=top_p,
        tokens=tokens,
        kept_set_differs=round(differs / tokens, 4),
        checkpoint=str(ckpt),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
