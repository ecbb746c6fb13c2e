"""Forward passes per RL step, by configuration: the training pass and the no-grad passes.

    python bench/forward_passes.py

One tiny Qwen3-MoE trainer (4 layers, 8 experts, a reference policy), 16 samples in 4
micro-batches; every forward of the GPTModel is counted by a forward pre-hook, split into
training forwards (grad enabled) and no-grad forwards. A pass is one forward of every
micro-batch, so passes = forwards / micro-batches. Configurations: the recipe's objective
(SAT-GSPO with R3 and kl_coef 1e-3, ``examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml``),
SAT-GSPO without KL, GRPO with and without KL (both R3); each on an ordinary step (no
live-routing diagnostic: the default of ``train.routing_diagnostic_interval`` runs it on
evaluation steps only) and on a diagnostic step.

Goal (issue 20): beside the training pass, at most one no-grad pass when the objective needs
mu-ratios only (SAT's global quantile over a split batch), plus the reference pass when
kl_coef > 0. Last line JSON: ``forward_equivalents_per_step`` (passes of the recipe's ordinary
step, training pass included), ``no_grad_passes`` per configuration and step kind, and
``goal_met``.

Mini-batches (issue 23, ``train.global_batch_size`` = batch / 4, ``training.mini_batches``):
``forward_equivalents_per_rollout_batch`` counts every forward of one rollout batch of 4
optimizer steps, in passes of the whole batch, beside the same objective as one step
(``one_step``): with a recomputed old policy the old log-probs are one no-grad pass of the
batch before the first step, so 4 mini-batches cost what one step costs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dist"))

CONFIGS = {
    "sat-gspo+r3+kl (recipe)": dict(name="sat-gspo", kl_coef=1e-3),
    "sat-gspo+r3": dict(name="sat-gspo"),
    "grpo+r3+kl": dict(name="grpo", kl_coef=1e-3),
    "grpo+r3": dict(name="grpo"),
}
NUM_SAMPLES, MICRO_BATCH = 16, 4
MINI_BATCH_CONFIGS = {
    "grpo+r3 recomputed_old": dict(name="grpo", ratio_denominator="recomputed_old"),
    "gspo+r3 recomputed_old": dict(name="gspo", ratio_denominator="recomputed_old"),
    "sat-gspo+r3": dict(name="sat-gspo"),
}


def count_rollout_batch(trainer, samples, objective, global_batch_size) -> float:
    """Forwards of one rollout batch through ``distributed_rollout_batch`` (ordinary step),
    in passes of the whole batch (training and no-grad together)."""
    from megatron_sat.config import RunConfig, TrainConfig
    from megatron_sat.config.run import RolloutConfig
    from megatron_sat.training.mini_batches import distributed_rollout_batch

    cfg = RunConfig(
        rollout=RolloutConfig(prompts_per_step=4, group_size=4, return_routed_experts=True),
        train=TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=global_batch_size),
        objective=objective,
    )
    counts = [0]

    def hook(module, args, kwargs):
        counts[0] += 1

    handle = trainer.model.module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        advantages = torch.linspace(-1.0, 1.0, len(samples))
        distributed_rollout_batch(trainer, samples, advantages, cfg, None, routing_diagnostic=False)
    finally:
        handle.remove()
    return counts[0] / len(trainer.micro_batch_rows(samples))


def count_passes(trainer, samples, objective, diagnostic: bool) -> tuple[float, float]:
    """(training passes, no-grad passes) of one ``rl_step``."""
    counts = {"train": 0, "no_grad": 0}

    def hook(module, args, kwargs):
        counts["train" if torch.is_grad_enabled() else "no_grad"] += 1

    gpt = trainer.model.module  # the GPTModel inside megatron-core's DDP
    handle = gpt.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        advantages = torch.linspace(-1.0, 1.0, len(samples))
        trainer.rl_step(samples, advantages, objective, routing_diagnostic=diagnostic)
    finally:
        handle.remove()
    num = len(trainer.micro_batch_rows(samples))
    return counts["train"] / num, counts["no_grad"] / num


def main() -> None:
    from r3_common import make_samples

    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.objectives import ObjectiveConfig
    from megatron_sat.training.trainer import PolicyTrainer

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(
            "Qwen3MoeForCausalLM", Path(tmp) / "ckpt", num_hidden_layers=4, num_experts=8
        )
        hf = json.loads((ckpt / "config.json").read_text())
        trainer = PolicyTrainer(
            hf,
            TrainConfig(lr=1e-4, micro_batch_size=MICRO_BATCH, use_r3=True),
            ParallelConfig(),
            pad_token_id=0,
            load_from=ckpt,
            reference=True,
        )
        num_layers, top_k, num_experts = trainer.routing_shape
        shape = dict(hf, num_hidden_layers=num_layers, num_experts_per_tok=top_k)
        samples = make_samples([(4, 8)] * NUM_SAMPLES, dict(shape, num_experts=num_experts))
        rows = {}
        for label, fields in CONFIGS.items():
            objective = ObjectiveConfig(**fields)
            for kind, diagnostic in (("ordinary", False), ("diagnostic", True)):
                train, no_grad = count_passes(trainer, samples, objective, diagnostic)
                assert train == 1.0, (label, kind, train)
                rows[f"{label} / {kind} step"] = no_grad
        mini = {}
        for label, fields in MINI_BATCH_CONFIGS.items():
            objective = ObjectiveConfig(**fields)
            mini[label] = {
                "one_step": count_rollout_batch(trainer, samples, objective, None),
                "4_mini_batches": count_rollout_batch(
                    trainer, samples, objective, NUM_SAMPLES // 4
                ),
            }
    for key, value in rows.items():
        print(f"{key:40s} training pass 1 + no-grad passes {value:g}")
    for key, value in mini.items():
        print(f"{key:40s} passes per rollout batch: {value}")
    goal = all(
        rows[f"{label} / ordinary step"]
        <= (1 if fields["name"].startswith("sat") else 0) + (fields.get("kl_coef", 0) > 0)
        for label, fields in CONFIGS.items()
    )
    recipe = 1 + rows["sat-gspo+r3+kl (recipe) / ordinary step"]
    print(
        json.dumps(
            {
                "forward_equivalents_per_step": recipe,
                "no_grad_passes": rows,
                "micro_batches": NUM_SAMPLES // MICRO_BATCH,
                "forward_equivalents_per_rollout_batch": mini,
                "goal_met": goal,
            }
        )
    )


if __name__ == "__main__":
    main()
