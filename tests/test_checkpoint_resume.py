"""Run checkpoints with the real PolicyTrainer: a run stopped after step k and resumed in a
fresh trainer gives bit-identical loss and weights at step k + 1 (weights, Adam state, RNG,
run state restored); latest pointer, refusal to overwrite, rotation, world-size check."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_sat.checkpoint.run_state import (
    latest_run_checkpoint,
    load_run_checkpoint,
    save_run_checkpoint,
    should_save,
)
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.rollout.types import Sample
from megatron_sat.training.trainer import PolicyTrainer

K = 2  # stop after step K, resume for step K + 1
TRAIN = TrainConfig(lr=3e-3, micro_batch_size=4, clip_grad=1.0, use_r3=True, seed=7)


def draw_batch(trainer: PolicyTrainer, vocab: int) -> tuple[list[Sample], torch.Tensor]:
    """A random RL batch from the *global* RNGs (torch: tokens and log-probs, numpy: routes,
    python: response lengths), so that a resume that did not restore them draws another."""
    layers, top_k, experts = trainer.routing_shape
    samples = []
    for i in range(6):
        p, r = 3, random.randint(2, 5)
        tokens = torch.randint(3, vocab, (p + r,)).tolist()
        routes = np.stack(
            [
                np.stack([np.random.permutation(experts)[:top_k] for _ in range(layers)])
                for _ in range(p + r - 1)
            ]
        ).astype(np.uint8)
        samples.append(
            Sample(
                index=i,
                group_index=i // 3,
                prompt="",
                label="",
                prompt_ids=tokens[:p],
                response_ids=tokens[p:],
                rollout_log_probs=(-2.0 + 0.3 * torch.randn(r)).tolist(),
                response_versions=[0] * r,
                routed_experts=routes,
            )
        )
    return samples, torch.randn(len(samples))


def train_step(trainer: PolicyTrainer, step: int, vocab: int) -> float:
    """Step 1 is supervised, later steps are RL (GRPO-style objective, R3 replay)."""
    samples, advantages = draw_batch(trainer, vocab)
    if step == 1:
        return trainer.sft_step(samples)["loss"]
    return trainer.rl_step(samples, advantages, ObjectiveConfig())["loss"]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}


@pytest.fixture
def make_trainer(megatron_world, tiny_checkpoint, tiny_hf_config):
    def make() -> PolicyTrainer:
        return PolicyTrainer(
            tiny_hf_config, TRAIN, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
        )

    return make


def test_resume_after_step_k_is_bit_identical(make_trainer, tiny_hf_config, tmp_path):
    vocab = tiny_hf_config["vocab_size"]
    # Uninterrupted run: steps 1 .. K + 1.
    seed_all(11)
    straight = make_trainer()
    losses = [train_step(straight, step, vocab) for step in range(1, K + 2)]
    expected_weights = weights(straight)

    # Interrupted run: steps 1 .. K, checkpoint, then the process "dies".
    seed_all(11)
    first = make_trainer()
    for step in range(1, K + 1):
        assert train_step(first, step, vocab) == losses[step - 1]
    ckpt = save_run_checkpoint(
        tmp_path,
        model=first.model,
        optimizer=first.optimizer,
        step=K,
        weight_version=K,
        data_state={"epoch": 0, "offset": 6 * K},
        rollout_state={"pending": [{"index": 99, "versions": [K - 1]}]},
    )
    assert latest_run_checkpoint(tmp_path) == ckpt
    del first

    # A fresh trainer (new weights would come from the HF checkpoint, other RNG) resumes.
    seed_all(12345)
    resumed = make_trainer()
    state = load_run_checkpoint(tmp_path, model=resumed.model, optimizer=resumed.optimizer)
    assert (state.step, state.weight_version) == (K, K)
    assert state.data_state == {"epoch": 0, "offset": 6 * K}
    assert state.rollout_state == {"pending": [{"index": 99, "versions": [K - 1]}]}
    loss = train_step(resumed, K + 1, vocab)

    assert loss == losses[K]  # bitwise: same float
    got = weights(resumed)
    assert sorted(got) == sorted(expected_weights)
    different = [n for n, w in expected_weights.items() if not torch.equal(got[n], w)]
    assert not different, f"weights differ after the resumed step: {different[:5]}"
    # The step changed the weights (so equality above is not vacuous).
    assert any(not torch.equal(got[n], w) for n, w in weights(make_trainer()).items())


def test_resume_without_optimizer_or_rng_state_differs(make_trainer, tiny_hf_config, tmp_path):
    """Controls: the exactness above needs the restored RNG and Adam state."""
    vocab = tiny_hf_config["vocab_size"]
    seed_all(3)
    trainer = make_trainer()
    for step in range(1, K + 1):
        train_step(trainer, step, vocab)
    save_run_checkpoint(tmp_path, model=trainer.model, optimizer=trainer.optimizer, step=K)
    reference_loss = train_step(trainer, K + 1, vocab)
    reference = weights(trainer)

    seed_all(99)
    no_rng = make_trainer()
    load_run_checkpoint(tmp_path, model=no_rng.model, optimizer=no_rng.optimizer, load_rng=False)
    assert train_step(no_rng, K + 1, vocab) != reference_loss  # another batch was drawn

    no_adam = make_trainer()
    load_run_checkpoint(tmp_path, model=no_adam.model, optimizer=no_adam.optimizer)
    for opt in getattr(no_adam.optimizer, "chained_optimizers", [no_adam.optimizer]):
        opt.optimizer.state.clear()  # forget the moments and step counts
    assert train_step(no_adam, K + 1, vocab) == reference_loss  # same weights and batch ...
    changed = [n for n, w in weights(no_adam).items() if not torch.equal(w, reference[n])]
    assert changed  # ... but another update


def test_run_checkpoint_bookkeeping(make_trainer, tmp_path):
    trainer = make_trainer()
    assert [s for s in range(1, 10) if should_save(s, 3)] == [3, 6, 9]
    assert not should_save(5, 0)
    for step in (1, 2, 3):
        save_run_checkpoint(
            tmp_path, model=trainer.model, optimizer=trainer.optimizer, step=step, keep_last=2
        )
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == ["step_00000002", "step_00000003"]
    assert latest_run_checkpoint(tmp_path).name == "step_00000003"
    with pytest.raises(FileExistsError, match="step_00000003"):
        save_run_checkpoint(tmp_path, model=trainer.model, optimizer=trainer.optimizer, step=3)
    with pytest.raises(FileNotFoundError, match="no run checkpoint"):
        load_run_checkpoint(tmp_path / "nowhere", model=trainer.model, optimizer=trainer.optimizer)
    meta = (tmp_path / "checkpoints" / "step_00000003" / "meta.json").read_text()
    assert '"world_size": 1' in meta
