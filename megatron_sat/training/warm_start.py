"""Supervised warm start: teach a randomly initialised model the answer format, so that RL
starts from a non-zero reward. Same megatron-core code path as RL (model, DDP, optimizer)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.rollout.datasets import PromptRecord, load_prompt_dataset
from megatron_sat.rollout.tokenizer import build_char_tokenizer
from megatron_sat.rollout.types import Sample
from megatron_sat.training.trainer import PolicyTrainer


@dataclass
class WarmStartConfig:
    """Supervised warm start.

    Attributes:
        model_config: HF ``config.json`` template of the architecture (vocab size and special
            token ids are filled in from the tokenizer).
        train_path: prompt/label dataset; the target is ``\\boxed{label}`` then end-of-text.
        out_dir: where the HF checkpoint (with tokenizer) is written.
        num_steps, batch_size, lr: optimisation.
        seed: initialisation and data-order seed.
    """

    model_config: str = "examples/models/qwen3_moe_tiny.json"
    train_path: str = "data/arith/train.jsonl"
    out_dir: str = "checkpoints/warm_start"
    num_steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"warm_start.{name} must be > 0, got {getattr(self, name)}")


def answer_text(label: str) -> str:
    """The response the task's reward accepts: ``\\boxed{label}``."""
    return "\\boxed{" + label + "}"


def sft_sample(index: int, record: PromptRecord, tokenizer) -> Sample:
    """A supervised example as a :class:`Sample`: response = answer tokens + end-of-text."""
    response = tokenizer.encode(answer_text(record.label)) + [tokenizer.eos_token_id]
    return Sample(
        index=index,
        group_index=index,
        prompt=record.prompt,
        label=record.label,
        prompt_ids=tokenizer.encode(record.prompt),
        response_ids=response,
        rollout_log_probs=[0.0] * len(response),
        response_versions=[0] * len(response),
    )


def warm_start(cfg: WarmStartConfig) -> Path:
    """Train from random initialisation and write an HF checkpoint to ``cfg.out_dir``.

    Returns:
        The checkpoint directory (config.json, model.safetensors, tokenizer files).
    """
    tokenizer = build_char_tokenizer()
    hf_config = json.loads(Path(cfg.model_config).read_text())
    hf_config.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    records = load_prompt_dataset(cfg.train_path)
    train = TrainConfig(lr=cfg.lr, micro_batch_size=cfg.batch_size, seed=cfg.seed, use_r3=False)
    trainer = PolicyTrainer(
        hf_config, train, ParallelConfig(), pad_token_id=tokenizer.pad_token_id, load_from=None
    )
    rng = random.Random(cfg.seed)
    order: list[int] = []
    progress = tqdm(range(cfg.num_steps), desc="warm start", unit="step")
    for _ in progress:
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(records)), len(records))
        batch, order = order[: cfg.batch_size], order[cfg.batch_size :]
        samples = [sft_sample(i, records[i], tokenizer) for i in batch]
        metrics = trainer.sft_step(samples)
        progress.set_postfix(loss=f"{metrics['loss']:.3f}")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    trainer.save_hf(out, tokenizer_dir=out)
    return out
