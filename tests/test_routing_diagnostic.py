"""The live-routing diagnostic forward made optional (``train.routing_diagnostic_interval``).

A step without it runs one no-grad forward fewer, leaves ``topk_match_live`` /
``mismatch_abs_logratio_live`` out of its metrics (absent, not zero) and trains exactly as a
step with it: every other metric and every parameter are bitwise the same. Without R3 the live
forward is also the trained routing's (old log-probs, SAT's global q), so it still runs there.
"""

from __future__ import annotations

import pytest
import torch
from test_split_invariance import make_samples

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.training.rl import routing_diagnostic_due
from megatron_sat.training.trainer import PolicyTrainer

LIVE_KEYS = {"topk_match_live", "mismatch_abs_logratio_live"}


def build(tiny_hf_config, tiny_checkpoint, use_r3: bool) -> PolicyTrainer:
    return PolicyTrainer(
        tiny_hf_config,
        TrainConfig(lr=1e-2, clip_grad=0.0, micro_batch_size=8, use_r3=use_r3),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )


def batch(trainer: PolicyTrainer, vocab: int):
    """24 samples (3 micro-batches of 8) with random rollout routes and log-probs."""
    samples = make_samples(trainer, vocab)
    gen = torch.Generator().manual_seed(1)
    for s in samples:
        s.rollout_log_probs = (-torch.rand(len(s.response_ids), generator=gen) * 3).tolist()
    return samples, torch.linspace(-1.0, 1.0, len(samples))


def count_live_forwards(trainer: PolicyTrainer) -> list[bool]:
    """Record the ``replay`` flag of every no-grad forward the trainer runs."""
    calls: list[bool] = []
    original = trainer._no_grad_log_probs

    def counted(mbs, replay, reference=False):
        calls.append(replay)
        return original(mbs, replay, reference)

    trainer._no_grad_log_probs = counted
    return calls


def test_interval():
    assert [s for s in range(1, 10) if routing_diagnostic_due(1, s)] == list(range(1, 10))
    assert [s for s in range(1, 10) if routing_diagnostic_due(3, s)] == [3, 6, 9]
    assert not any(routing_diagnostic_due(0, s) for s in range(1, 10))
    with pytest.raises(ValueError, match="interval=-1"):
        routing_diagnostic_due(-1, 1)
    with pytest.raises(ValueError, match="step=0"):
        routing_diagnostic_due(1, 0)
    with pytest.raises(ValueError, match="train.routing_diagnostic_interval"):
        TrainConfig(routing_diagnostic_interval=-1)
    # by default with the evaluations only: ordinary steps run no diagnostic forward
    assert TrainConfig().routing_diagnostic_interval == TrainConfig().eval_every == 10
    assert TrainConfig(eval_every=7).routing_diagnostic_interval == 7
    assert TrainConfig(eval_every=7, routing_diagnostic_interval=0).routing_diagnostic_interval == 0


@pytest.mark.slow  # two trainers and steps: ~30 s on this machine under load
def test_step_without_the_diagnostic(megatron_world, tiny_checkpoint, tiny_hf_config):
    with_it = build(tiny_hf_config, tiny_checkpoint, use_r3=True)
    without = build(tiny_hf_config, tiny_checkpoint, use_r3=True)
    samples, advantages = batch(with_it, tiny_hf_config["vocab_size"])
    objective = ObjectiveConfig(name="sat-gspo")
    calls_with, calls_without = count_live_forwards(with_it), count_live_forwards(without)

    a = with_it.rl_step(samples, advantages, objective, routing_diagnostic=True)
    b = without.rl_step(samples, advantages, objective, routing_diagnostic=False)

    # several micro-batches: SAT's global q needs the replayed no-grad forward in both
    assert calls_with.count(False) == 1 and calls_without.count(False) == 0
    assert calls_with.count(True) == calls_without.count(True) == 1
    assert LIVE_KEYS <= set(a) and not LIVE_KEYS & set(b)
    assert 0.0 <= a["topk_match_live"] < 1.0  # random routes: live routing disagrees
    assert a["topk_match_r3"] == b["topk_match_r3"] == 1.0
    assert {k: v for k, v in a.items() if k not in LIVE_KEYS} == b
    for (name, p), (_, q) in zip(
        with_it.model.named_parameters(), without.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_without_r3_the_live_forward_is_the_trained_routing(
    megatron_world, tiny_checkpoint, tiny_hf_config
):
    trainer = build(tiny_hf_config, tiny_checkpoint, use_r3=False)
    samples, advantages = batch(trainer, tiny_hf_config["vocab_size"])
    calls = count_live_forwards(trainer)
    sat = trainer.rl_step(
        samples, advantages, ObjectiveConfig(name="sat-gspo"), routing_diagnostic=False
    )
    assert calls == [False]  # SAT's q over several micro-batches needs it: it still runs
    assert not LIVE_KEYS & set(sat)
    calls.clear()
    plain = trainer.rl_step(
        samples, advantages, ObjectiveConfig(name="gspo"), routing_diagnostic=False
    )
    assert calls == [] and not LIVE_KEYS & set(plain)  # nothing needs it: skipped
