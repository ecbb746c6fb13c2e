"""``data.num_eval_prompts``: the first N held-out prompts are evaluated; a file holding fewer
is said once (the accuracy's noise then grows), never cut silently."""

from __future__ import annotations

import json
import warnings

import pytest

from megatron_sat.config import load_config
from megatron_sat.training.rl import _prompt_sources


def _cfg(tmp_path, n_eval, num_eval_prompts):
    for name, n in (("train", 4), ("test", n_eval)):
        rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        overrides=[
            f"data.train_path={tmp_path / 'train.jsonl'}",
            f"data.eval_path={tmp_path / 'test.jsonl'}",
            f"data.num_eval_prompts={num_eval_prompts}",
        ]
    )


def test_a_short_eval_file_is_said_with_both_numbers(tmp_path):
    cfg = _cfg(tmp_path, n_eval=3, num_eval_prompts=500)
    with pytest.warns(UserWarning, match=r"data.num_eval_prompts=500 but .*test\.jsonl holds 3"):
        _, records = _prompt_sources(cfg, None, None, first_step=1)
    assert [r.label for r in records] == ["1", "2", "3"]
    cfg = _cfg(tmp_path, n_eval=3, num_eval_prompts=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough prompts: no warning
        _, records = _prompt_sources(cfg, None, None, first_step=1)
    assert [r.label for r in records] == ["1", "2"]
