"""Micro-batches staged on the device one at a time (``training.staging``).

The step builds its micro-batches in host memory; every pass moves one to the device just
before its forward and drops it after its backward (or its no-grad forward). On the CPU the
move is a no-op, so the policy is checked by recording ``staging.staged``, the one function
that moves a whole micro-batch: during an RL step at most one is staged at a time, every
forward of the model runs inside one, and each pass stages each micro-batch once.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_split_invariance import attach_rollout_log_probs, make_samples

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.training import staging
from megatron_sat.training.trainer import PolicyTrainer


def test_pin_is_identity_off_cuda():
    t = torch.ones(2)
    assert staging.pin(t, torch.device("cpu")) is t


@pytest.mark.slow  # one RL step of the tiny model with a KL term: ~20 s under load
def test_one_micro_batch_on_the_device_at_a_time(
    megatron_world, tiny_checkpoint, tiny_hf_config, monkeypatch
):
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(lr=1e-3, micro_batch_size=24, use_r3=True),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
        reference=True,
    )
    samples = make_samples(trainer, tiny_hf_config["vocab_size"])
    attach_rollout_log_probs(trainer, samples)
    trainer.train_config.micro_batch_size = 6  # 4 micro-batches
    events: list[str] = []
    depth = [0]
    original = staging.staged

    @contextlib.contextmanager
    def recorded(mb, device):
        depth[0] += 1
        events.append(f"stage {mb.input_ids.shape[0]}x{mb.input_ids.shape[1]}")
        try:
            with original(mb, device) as moved:
                yield moved
        finally:
            depth[0] -= 1

    monkeypatch.setattr(staging, "staged", recorded)
    for module in ("passes", "train_pass"):
        monkeypatch.setattr(f"megatron_sat.training.{module}.staged", recorded)
    forwards_at_depth: list[int] = []
    handle = trainer.model.module.register_forward_pre_hook(
        lambda *_: forwards_at_depth.append(depth[0])
    )
    try:
        objective = ObjectiveConfig(name="sat-gspo", kl_coef=1e-3)
        advantages = torch.linspace(-1.0, 1.0, len(samples))
        trainer.rl_step(samples, advantages, objective, routing_diagnostic=True)
    finally:
        handle.remove()
    # live, replayed (SAT's global q), reference and training passes: 4 forwards of 4 batches
    assert forwards_at_depth == [1] * 16
    assert len(events) == 16 and depth == [0]
