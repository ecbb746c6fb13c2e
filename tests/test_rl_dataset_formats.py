"""The main job trains for two steps on a verl parquet and on a slime jsonl (its own keys,
the chat template on), and every trained sample carries its row's metadata."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sat.config import load_config
from megatron_sat.rollout.arith import make_arith_splits


def _verl(rows: list[dict], path) -> list[str]:
    """The rows as verl's examples/data_preprocess scripts write them."""
    table = [
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["label"]},
            "extra_info": {"split": path.stem, "index": i},
        }
        for i, row in enumerate(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path.with_suffix(".parquet"))
    return []


def _slime(rows: list[dict], path) -> list[str]:
    """The rows as slime's jsonl with its own keys: --input-key problem --label-key solution
    --metadata-key info --apply-chat-template."""
    lines = [
        json.dumps(
            {
                "problem": row["prompt"],
                "solution": row["label"],
                "info": {"split": path.stem, "index": i},
            }
        )
        for i, row in enumerate(rows)
    ]
    path.with_suffix(".jsonl").write_text("".join(line + "\n" for line in lines))
    return [
        "data.input_key=problem",
        "data.label_key=solution",
        "data.metadata_key=info",
        "data.apply_chat_template=true",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("fmt, suffix", [(_verl, ".parquet"), (_slime, ".jsonl")])
def test_main_job_trains_two_steps_on_the_format(
    tmp_path, tiny_checkpoint, megatron_world, monkeypatch, fmt, suffix
):
    import megatron_sat.training.rl as rl

    train, test = make_arith_splits(32, 4, seed=1, max_digits=1)
    keys = fmt(train, tmp_path / "train")
    fmt(test, tmp_path / "test")
    trained = []

    def recording(trainer, samples, *args, **kwargs):
        trained.extend(samples or [])  # None: a resumed batch (not in this run)
        return train_batch(trainer, samples, *args, **kwargs)

    train_batch = rl.train_rollout_batch
    monkeypatch.setattr(rl, "train_rollout_batch", recording)
    run_dir = tmp_path / "run"
    rl.run_rl(
        load_config(
            None,
            [
                f"init_checkpoint={tiny_checkpoint}",
                f"run_dir={run_dir}",
                f"data.train_path={tmp_path / ('train' + suffix)}",
                f"data.eval_path={tmp_path / ('test' + suffix)}",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=3",
                "rollout.eval_samples_per_prompt=1",
                "train.num_steps=2",
                "train.eval_every=2",
                *keys,
            ],
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math_finite(r["train/loss"]) for r in rows[1:])
    assert "eval/acc_greedy" in rows[-1]
    # 2 steps x 2 prompts x 2 samples, each with its own row's metadata and label.
    assert len(trained) == 8
    by_prompt = {row["prompt"]: (i, row["label"]) for i, row in enumerate(train)}
    for sample in trained:
        index, label = by_prompt[sample.prompt]
        assert sample.label == label
        info = {"split": "train", "index": index}
        if fmt is _verl:
            assert sample.metadata == {
                "data_source": "arith",
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": label},
                "extra_info": info,
            }
        else:
            assert sample.metadata == info


def math_finite(value) -> bool:
    return isinstance(value, float) and value == value and abs(value) != float("inf")
