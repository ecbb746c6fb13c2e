"""The policy's entropy for the entropy bonus: vocab-parallel formula vs softmax by hand, and the
trainer's forward that keeps the logits gives the same log-probs as the ``labels=`` forward.
(TP2 parity of a step with the bonus: tests/test_trainer_parallel.py.)"""

from __future__ import annotations

import torch
from test_split_invariance import make_samples

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.training.logprobs import (
    forward_log_probs,
    forward_log_probs_and_entropy,
    vocab_parallel_entropy,
)
from megatron_sat.training.trainer import PolicyTrainer


def reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def test_vocab_parallel_entropy_by_hand(megatron_world):
    # uniform over 4: log 4; one-hot-like logits: ~0; plus random rows with huge offsets
    gen = torch.Generator().manual_seed(0)
    logits = torch.cat(
        [
            torch.zeros(1, 4),
            torch.tensor([[80.0, 0.0, 0.0, 0.0]]),
            torch.randn(6, 4, generator=gen) * 3 + 1e4,
        ]
    ).requires_grad_(True)
    h = vocab_parallel_entropy(logits)
    assert h.dtype == torch.float32 and torch.isfinite(h).all()
    assert abs(h[0].item() - 1.3862944) < 1e-6 and abs(h[1].item()) < 1e-6
    want = reference_entropy(logits.detach())
    torch.testing.assert_close(h.double(), want, rtol=0, atol=2e-6)
    weights = torch.randn(8, generator=gen)
    (grad,) = torch.autograd.grad((h * weights).sum(), logits)
    ref_logits = logits.detach().double().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad((reference_entropy(ref_logits) * weights).sum(), ref_logits)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=1e-5)


def test_forward_with_entropy_keeps_the_log_probs(megatron_world, tiny_checkpoint, tiny_hf_config):
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(micro_batch_size=24),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    samples = make_samples(trainer, tiny_hf_config["vocab_size"])
    (mb,) = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
    with torch.no_grad():
        plain = forward_log_probs(trainer.model, mb)
        log_probs, entropy = forward_log_probs_and_entropy(trainer.model, mb)
        logits = trainer.model(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert torch.equal(log_probs, plain)  # the same vocab-parallel cross entropy
    # both in the losses' sample layout (on the CPU this micro-batch is packed: see
    # training.packing.dense_packing_rows), compared where a sample has a token
    held = mb.to_sample_layout(torch.ones(mb.input_ids.shape)).bool()
    want = reference_entropy(mb.to_sample_layout(logits))
    torch.testing.assert_close(entropy.double()[held], want[held], rtol=0, atol=2e-6)
    assert entropy.shape == plain.shape
    # one row per micro-batch: megatron-core's cross entropy works in place on the logits,
    # which the transpose of a single row does not copy; entropy and its gradient must not see it
    trainer.train_config = TrainConfig(micro_batch_size=1)
    weight = trainer.model.module.output_layer.weight
    for one in trainer.micro_batches(samples[:3], torch.zeros(3), False):
        log_probs, entropy = forward_log_probs_and_entropy(trainer.model, one)
        (grad,) = torch.autograd.grad(entropy.sum(), weight)
        logits = trainer.model(one.input_ids, one.position_ids, one.attention_mask)
        log_p = torch.log_softmax(logits, dim=-1)
        want = -(log_p.exp() * log_p).sum(-1)
        (want_grad,) = torch.autograd.grad(want.sum(), weight)
        torch.testing.assert_close(entropy, want, rtol=0, atol=2e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)
        assert torch.equal(log_probs, forward_log_probs(trainer.model, one))
