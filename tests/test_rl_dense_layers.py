"""Models with dense decoder layers train through the real RL loop (trainer + embedded server).

SGLang 0.5.23 returns ``routed_experts`` rows for every decoder layer: its capture buffer is
zero-initialised and only MoE layers write into it (``state_capturer/base.py``,
``BaseDeviceCache``), so a dense layer's row names expert 0 ``top_k`` times. The trainer must
check and replay only the MoE layers' rows. One RL step with R3 on and one with it off, for a
Qwen3-MoE with a dense first layer (``mlp_only_layers``), a Qwen2-MoE with a dense layer and a
DeepSeek-V3 (``first_k_dense_replace``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_sat.checkpoint.tiny_models import make_tiny_hf_model
from megatron_sat.config import load_config
from megatron_sat.rollout.arith import make_arith_splits

DENSE_MODELS = {
    "qwen3_moe_mlp_only_layers": ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0])),
    "qwen2_moe_mlp_only_layers": ("Qwen2MoeForCausalLM", dict(mlp_only_layers=[0])),
    "deepseek_v3_first_k_dense": ("DeepseekV3ForCausalLM", dict(first_k_dense_replace=1)),
}


def dense_checkpoint(path: Path, architecture: str, **overrides) -> Path:
    """A tiny random ``architecture`` checkpoint with the char tokenizer (arith prompts)."""
    from megatron_sat.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = make_tiny_hf_model(
        architecture,
        seed=0,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **overrides,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def arith_data(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dense_data")
    train, test = make_arith_splits(32, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


@pytest.mark.parametrize("model", sorted(DENSE_MODELS))
def test_embedded_engine_fills_dense_rows_with_expert_zero(tmp_path, model):
    # As SGLang's zero-initialised capture buffer: the dense layer's rows are [0] * top_k, the
    # MoE layer's rows are its router's distinct choices.
    from megatron_sat.rollout.client import SamplingParams
    from megatron_sat.rollout.embedded.engine import EngineRequest, GenerationEngine

    architecture, overrides = DENSE_MODELS[model]
    engine = GenerationEngine(str(dense_checkpoint(tmp_path, architecture, **overrides)), seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    (out,) = engine.generate([EngineRequest([5, 6, 7, 8], params)])
    routed = out.routed_experts
    assert routed.shape == (4 + len(out.output_ids) - 1, 2, engine.top_k)
    assert (routed[:, 0] == 0).all()
    ordered = np.sort(routed[:, 1], axis=-1)
    assert (ordered[:, 1:] != ordered[:, :-1]).all()
    assert ((0 <= routed[:, 1]) & (routed[:, 1] < engine.num_experts)).all()


@pytest.mark.slow
@pytest.mark.parametrize("use_r3", [True, False], ids=["r3", "no_r3"])
@pytest.mark.parametrize("model", sorted(DENSE_MODELS))
def test_rl_steps_with_dense_layers(tmp_path, arith_data, megatron_world, model, use_r3):
    from megatron_sat.training.rl import run_rl

    architecture, overrides = DENSE_MODELS[model]
    checkpoint = dense_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    hf_config = json.loads((checkpoint / "config.json").read_text())
    assert hf_config["num_hidden_layers"] == 2  # layer 1 dense, layer 2 MoE
    cfg = load_config(
        None,
        [
            f"init_checkpoint={checkpoint}",
            f"run_dir={tmp_path / 'run'}",
            f"data.train_path={arith_data / 'train.jsonl'}",
            f"data.eval_path={arith_data / 'test.jsonl'}",
            "data.num_eval_prompts=2",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            "rollout.eval_samples_per_prompt=1",
            "rollout.temperature=1.0",
            "train.num_steps=2",
            "train.eval_every=2",
            "train.routing_diagnostic_interval=1",  # the live metrics on every row
            "train.micro_batch_size=2",  # two micro-batches per step
            f"train.use_r3={str(use_r3).lower()}",
            "train.lr=0.01",
            # Rewards of a random tiny model are all 0 (no advantage): the entropy bonus gives
            # every step a gradient, so the weights move and each push must carry them.
            "objective.entropy_coef=0.01",
        ],
    )
    run_rl(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # Only layer 2 has a router: the agreement counts its rows, never the dense layer's
        # zeros (which would make it at most 0.5 with R3 on).
        if use_r3:
            assert row["train/topk_match_r3"] == 1.0
        assert 0.0 <= row["train/topk_match_live"] <= 1.0
        assert row["train/grad_norm"] > 0
        # The server was pushed the weights of the step before: its log-probs are the
        # trainer's (fp32 both; the dense layer served and trained alike).
        assert row["train/mismatch_abs_logratio"] < 1e-4
