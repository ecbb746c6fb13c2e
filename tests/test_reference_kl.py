"""The k3 KL to a frozen reference policy in the real PolicyTrainer (SAT paper: kl_coef 1e-3).

The reference is the initial checkpoint, kept in host memory and swapped into the model for its
forward, run with the same (R3) routing. At the first step the policy equals it, so the KL is
exactly 0; after an update the step's ``kl_loss`` equals k3 of the two policies' log-probs
computed here by hand; the reference stays the initial policy and swapping it out restores the
trained one bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from test_split_invariance import attach_rollout_log_probs, make_samples

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.training.trainer import PolicyTrainer


@pytest.fixture(scope="module")
def trainer(megatron_world, tiny_checkpoint, tiny_hf_config) -> PolicyTrainer:
    return PolicyTrainer(
        tiny_hf_config,
        TrainConfig(lr=1e-2, clip_grad=0.0, micro_batch_size=24, use_r3=True),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
        reference=True,
    )


def k3_token_mean(log_probs, ref_log_probs, masks) -> float:
    """sum over active tokens of exp(-x) - 1 + x, x = log pi - log pi_ref, / their count."""
    total = count = 0.0
    for lp, ref, mask in zip(log_probs, ref_log_probs, masks, strict=True):
        x = (lp - ref).double()[mask.bool()]
        total += float((torch.exp(-x) - 1 + x).sum())
        count += float(mask.sum())
    return total / count


def test_kl_to_the_initial_policy(trainer, tiny_hf_config):
    samples = make_samples(trainer, tiny_hf_config["vocab_size"])
    attach_rollout_log_probs(trainer, samples)
    advantages = torch.linspace(-1.0, 1.0, len(samples))
    objective = ObjectiveConfig(name="sat-gspo", kl_coef=0.5, loss_agg_mode="token-mean")
    mbs = trainer.micro_batches(samples, advantages, with_routes=True)

    def log_probs(reference: bool) -> list[torch.Tensor]:
        return [lp for lp, _ in trainer._no_grad_log_probs(mbs, replay=True, reference=reference)]

    initial = log_probs(reference=False)
    first = trainer.rl_step(samples, advantages, objective)
    assert first["kl_loss"] == 0.0  # the policy is still the reference, bit for bit

    policy, reference = log_probs(reference=False), log_probs(reference=True)
    expected = k3_token_mean(policy, reference, [mb.loss_mask for mb in mbs])
    second = trainer.rl_step(samples, advantages, objective)
    assert expected > 1e-6  # the update moved the policy away from the reference
    assert second["kl_loss"] == pytest.approx(expected, rel=1e-4)

    # the reference is the initial policy, and swapping it in and out restores the policy
    before = log_probs(reference=False)
    for got, want in zip(log_probs(reference=True), initial, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(log_probs(reference=False), before, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(before[0], initial[0])


def test_kl_without_a_reference_is_refused(megatron_world, tiny_checkpoint, tiny_hf_config):
    plain = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(micro_batch_size=12),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    samples = make_samples(plain, tiny_hf_config["vocab_size"])
    with pytest.raises(ValueError, match="reference=True"):
        plain.rl_step(samples, torch.ones(len(samples)), ObjectiveConfig(name="grpo", kl_coef=1e-3))


@pytest.mark.parametrize("on_device", [False, True])
def test_reference_swap_restores_the_policy_without_fresh_buffers(on_device):
    from megatron_sat.training.reference import ReferencePolicy

    model = torch.nn.Linear(3, 2)
    initial = [p.detach().clone() for p in model.parameters()]
    reference = ReferencePolicy(model, torch.device("cpu"), on_device=on_device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the policy moves away from the reference
    policy = [p.detach().clone() for p in model.parameters()]
    storages = []
    for _ in range(2):  # two steps
        with reference.swapped_in():
            for p, want in zip(model.parameters(), initial, strict=True):
                assert torch.equal(p, want)
            if on_device:  # the parameters hold the reference's own storage: nothing copied
                assert [p.data_ptr() for p in model.parameters()] == [
                    r.data_ptr() for _, r in reference.pairs
                ]
        for p, want in zip(model.parameters(), policy, strict=True):
            assert torch.equal(p, want)
        buffers = reference.policy_buffers
        storages.append(None if buffers is None else [b.data_ptr() for b in buffers])
    if on_device:
        assert storages == [None, None]
    else:  # the policy's weights waited in the same host buffers both steps
        assert storages[0] is not None and storages[0] == storages[1]
