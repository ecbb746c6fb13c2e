"""Shared fixtures: a tiny random Qwen3-MoE HF checkpoint and a 1-process megatron-core world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(
    script: str,
    *args: str,
    done: str,
    timeout: int = 600,
    env: dict | None = None,
    nproc: int = 2,
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc script args`` (2 by default) from the repository root
    (one thread per rank, this checkout's package first on the path); asserts exit 0 and the
    ``done`` marker in stdout, showing the tails of both streams otherwise."""
    torchrun = Path(sys.executable).with_name("torchrun")
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.run(
        [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", script, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


TINY_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    tie_word_embeddings=False,
    router_aux_loss_coef=0.0,
)


def make_tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny Qwen3-MoE (transformers) with the char tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_sat.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    cfg = dict(
        TINY_CONFIG,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    # transformers initialises some weights (norms) to constants; randomise everything so a
    # wrong mapping of any tensor shows up in the logits.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1).add_(1.0 if param.dim() == 1 else 0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_hf_config(tiny_checkpoint) -> dict:
    return json.loads((tiny_checkpoint / "config.json").read_text())


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, 1 process) + megatron-core parallel state, once per session."""
    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed

    init_distributed(ParallelConfig(), seed=1234)
    yield
