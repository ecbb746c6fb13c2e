"""A trainer built from random initialisation is reproducible: train.seed fixes the weights
(megatron-core draws them on the CPU from torch's default generator), so the main job's warm
start gives the same model on every run."""

from __future__ import annotations

import torch

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.training.trainer import PolicyTrainer


def initial_weights(hf_config: dict, seed: int, before: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(before)  # whatever the generator held before must not matter
    trainer = PolicyTrainer(
        hf_config, TrainConfig(seed=seed), ParallelConfig(), pad_token_id=0, load_from=None
    )
    return {name: t.clone() for name, t in trainer.hf_tensors()}


def test_random_initialisation_is_seeded(megatron_world, tiny_hf_config):
    a, b = initial_weights(tiny_hf_config, 7, 1), initial_weights(tiny_hf_config, 7, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = initial_weights(tiny_hf_config, 8, 1)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
