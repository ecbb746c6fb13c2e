"""20 SFT steps of a tiny Qwen3-MoE in bf16 and in fp32 from the same checkpoint (one CPU
process): the bf16 run must reduce the loss like the fp32 run.

    python bench/bf16_loss.py

The main job's warm-start checkpoint is built by its own pipeline (not present in a fresh
checkout), so the model here is the tests' tiny Qwen3-MoE (4 layers, 8 experts) and the steps
are supervised (``PolicyTrainer.sft_step``) on 16 fixed random sequences. Last line JSON:
``loss_fp32`` / ``loss_bf16`` (first and last), ``drop_ratio`` (bf16 drop / fp32 drop; goal
within 0.9-1.1) and ``max_abs_gap`` between the two curves.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist"))


def curve(dtype: str, ckpt: Path, steps: int) -> list[float]:
    from megatron.core import parallel_state
    from r3_common import make_samples

    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.training.trainer import PolicyTrainer

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    hf = json.loads((ckpt / "config.json").read_text())
    t = PolicyTrainer(
        hf,
        TrainConfig(lr=3e-3, micro_batch_size=8, params_dtype=dtype),
        ParallelConfig(),
        pad_token_id=0,
        load_from=ckpt,
    )
    num_layers, top_k, num_experts = t.routing_shape
    shape = dict(hf, num_hidden_layers=num_layers, num_experts_per_tok=top_k)
    samples = make_samples([(4, 12)] * 16, dict(shape, num_experts=num_experts), seed=5)
    return [t.sft_step(samples)["loss"] for _ in range(steps)]


def main() -> None:
    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(
            "Qwen3MoeForCausalLM", Path(tmp) / "ckpt", num_hidden_layers=4, num_experts=8
        )
        fp32, bf16 = curve("fp32", ckpt, 20), curve("bf16", ckpt, 20)
    drop32, drop16 = fp32[0] - fp32[-1], bf16[0] - bf16[-1]
    print(
        json.dumps(
            {
                "loss_fp32": [round(fp32[0], 4), round(fp32[-1], 4)],
                "loss_bf16": [round(bf16[0], 4), round(bf16[-1], 4)],
                "drop_ratio": round(drop16 / drop32, 4),
                "max_abs_gap": round(max(abs(a - b) for a, b in zip(fp32, bf16)), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
