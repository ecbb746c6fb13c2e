"""The log-prob gap between a bf16 and a float32 log-softmax of the same bf16 logits.

    python bench/logprob_precision.py

The tests' tiny Qwen3-MoE (4 layers, 8 experts) in bf16 on the CPU, 16 random samples: the
trainer's log-probs (``training.logprobs.fp32_log_probs``: logits cast to float32 before the
vocab-parallel cross entropy) against a bf16 log-softmax of the same logits, and both against
a float64 log-softmax of those logits; over response tokens. Last line JSON:
``bf16_vs_fp32_max_abs`` / ``bf16_vs_fp32_mean_abs`` (nats: what computing log-probs in bf16
would add to the train-rollout mismatch), ``fp32_vs_fp64_max_abs``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist"))


def main() -> None:
    from r3_common import make_samples

    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.training.logprobs import fp32_log_probs
    from megatron_sat.training.trainer import PolicyTrainer

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(
            "Qwen3MoeForCausalLM", Path(tmp) / "ckpt", num_hidden_layers=4, num_experts=8
        )
        hf = json.loads((ckpt / "config.json").read_text())
        trainer = PolicyTrainer(
            hf,
            TrainConfig(micro_batch_size=16, params_dtype="bf16"),
            ParallelConfig(),
            pad_token_id=0,
            load_from=ckpt,
        )
        num_layers, top_k, num_experts = trainer.routing_shape
        shape = dict(hf, num_hidden_layers=num_layers, num_experts_per_tok=top_k)
        samples = make_samples([(4, 12)] * 16, dict(shape, num_experts=num_experts), seed=3)
        (mb,) = trainer.micro_batches(samples, torch.zeros(16), with_routes=False)
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert logits.dtype == torch.bfloat16
    labels, mask = mb.labels, mb.loss_mask.bool()
    f64 = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    bf16 = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0].double()
    fp32 = fp32_log_probs(logits.clone(), labels).double()
    gap = (bf16 - fp32).abs()[mask]
    print(
        json.dumps(
            {
                "bf16_vs_fp32_max_abs": round(float(gap.max()), 6),
                "bf16_vs_fp32_mean_abs": round(float(gap.mean()), 6),
                "fp32_vs_fp64_max_abs": float((fp32 - f64).abs()[mask].max()),
                "mean_log_prob": round(float(fp32[mask].mean()), 4),
                "tokens": int(mask.sum()),
            }
        )
    )


if __name__ == "__main__":
    main()
