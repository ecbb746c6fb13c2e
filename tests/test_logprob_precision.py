"""Log-probs from float32 logits (``training.logprobs.fp32_log_probs``).

On the CPU the model runs in float32, so casting the logits changes nothing: the log-probs are
bitwise those of megatron-core's own ``labels=`` forward (its vocab-parallel cross entropy),
which the main job used before. With bf16 logits the cast keeps the log-softmax in float32:
checked against a float64 log-softmax of the same logits.
"""

from __future__ import annotations

import torch
from test_split_invariance import make_samples

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.training.logprobs import fp32_log_probs, model_log_probs
from megatron_sat.training.trainer import PolicyTrainer


def test_fp32_log_probs_of_bf16_logits_match_a_float64_log_softmax(megatron_world):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 32, generator=gen) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 32, (2, 5), generator=gen)
    want = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    got = fp32_log_probs(logits.clone(), labels)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5
    bf16 = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    assert (bf16.double() - want).abs().max() > 1e-3  # what a bf16 log-softmax would lose


def test_cpu_log_probs_bitwise_megatron_labels_forward(
    megatron_world, tiny_checkpoint, tiny_hf_config
):
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(micro_batch_size=24),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    samples = make_samples(trainer, tiny_hf_config["vocab_size"])
    (mb,) = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
    model = trainer.model
    model.eval()
    with torch.no_grad():
        ours = model_log_probs(model, mb)
        megatron = -model(mb.input_ids, mb.position_ids, mb.attention_mask, labels=mb.labels)
    assert ours.dtype == torch.float32 and ours.shape == mb.labels.shape
    assert torch.equal(ours, megatron.float())
