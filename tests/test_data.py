"""Data side: tokenizer, arithmetic dataset, prompt loader, math rewards, run logger."""

from __future__ import annotations

import importlib.util
import json
import math
import operator
import re
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from megatron_sat.rollout.arith import make_arith_rows, make_arith_splits, parse_ops
from megatron_sat.rollout.datasets import PromptRecord, load_prompt_dataset
from megatron_sat.rollout.rewards import batch_rewards, last_boxed_content, math_reward
from megatron_sat.rollout.tokenizer import build_char_tokenizer
from megatron_sat.training.run_logger import RunLogger

REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    """The tokenizer after save_pretrained + AutoTokenizer.from_pretrained."""
    folder = tmp_path_factory.mktemp("tokenizer")
    build_char_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_tokenizer_layout(saved_tokenizer):
    tok = saved_tokenizer
    # Hand-derived from the documented layout: specials 0..2, "\n" 3, " ".."~" 4..98, boxed 99.
    assert len(tok) == 100
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<|pad|>", "<|endoftext|>", "<|unk|>")
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids(["\n", " ", "0", "A", "~", "\\boxed{"]) == [
        3,
        4,
        4 + ord("0") - 32,
        4 + ord("A") - 32,
        98,
        99,
    ]
    # "\boxed{" is one token; "8" = 4 + 56 - 32 = 28, "2" = 22, "}" = 4 + 125 - 32 = 97.
    assert tok.encode("\\boxed{82}") == [99, 28, 22, 97]
    assert tok.encode("37+45=") == [23, 27, 15, 24, 25, 33]
    # The in-memory tokenizer and the reloaded one agree id for id.
    assert build_char_tokenizer().get_vocab() == tok.get_vocab()


def test_tokenizer_round_trip(saved_tokenizer):
    tok = saved_tokenizer
    alphabet = "\n" + "".join(chr(c) for c in range(32, 127))
    # Strings that the default clean-up or a space-joining decoder would alter.
    texts = [alphabet, "a , b 's n't .", "  two  spaces\n\nx", "so \\boxed{-8}.\\boxed{"]
    for text in texts:
        ids = tok.encode(text)
        assert len(ids) == len(text) - 6 * text.count("\\boxed{")
        assert tok.decode(ids) == text
    # Specials are not added on encode; skip_special_tokens removes them on decode.
    assert tok.decode(tok.encode("12") + [1, 0], skip_special_tokens=True) == "12"
    assert tok.decode([28, 1]) == "8<|endoftext|>"
    assert tok.encode("\t") == [2]


def test_tokenizer_chat_template(saved_tokenizer):
    messages = [{"role": "user", "content": "37+45="}]
    text = saved_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "37+45="


# ----------------------------------------------------------------------------- arithmetic

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_PROMPT_RE = re.compile(r"(\d+)([-+*])(\d+)=")


def test_arith_deterministic_and_disjoint():
    train, test = make_arith_splits(2000, 300, seed=0, max_digits=2, ops=("+", "-"))
    assert (train, test) == make_arith_splits(2000, 300, seed=0, max_digits=2, ops=("+", "-"))
    assert make_arith_splits(2000, 300, seed=1, max_digits=2, ops=("+", "-")) != (train, test)
    assert (len(train), len(test)) == (2000, 300)
    train_prompts = [row["prompt"] for row in train]
    test_prompts = [row["prompt"] for row in test]
    assert len(set(train_prompts)) == 2000 and len(set(test_prompts)) == 300
    assert not set(train_prompts) & set(test_prompts)


def test_arith_labels_correct():
    rows = make_arith_rows(3000, seed=7, max_digits=3, ops=("+", "-", "*"))
    for row in rows:
        match = _PROMPT_RE.fullmatch(row["prompt"])
        assert match, row
        left, op, right = int(match[1]), match[2], int(match[3])
        assert 0 <= left < 1000 and 0 <= right < 1000
        assert row["label"] == str(_OPS[op](left, right))
    assert any(row["label"].startswith("-") for row in rows)
    assert {row["prompt"][-1] for row in rows} == {"="}


def test_arith_exhausts_small_space_and_rejects_more():
    # max_digits=1, one op: exactly 100 distinct problems.
    rows = make_arith_rows(100, seed=3, max_digits=1, ops=("-",))
    assert len({row["prompt"] for row in rows}) == 100
    with pytest.raises(ValueError, match="exceeds the 100 distinct problems"):
        make_arith_rows(101, seed=3, max_digits=1, ops=("-",))
    with pytest.raises(ValueError, match="not supported"):
        make_arith_rows(1, seed=0, ops=("/",))
    with pytest.raises(ValueError, match="empty entry"):
        parse_ops("+,,-")


def test_arith_cli(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_arith_dataset", REPO_ROOT / "tools" / "make_arith_dataset.py"
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--out-dir", str(tmp_path), "--seed", "0", "--num-train", "50", "--num-test", "5"]
    assert cli.main(argv + ["--ops=-,+"]) == 0
    train, test = make_arith_splits(50, 5, seed=0, max_digits=3, ops=("-", "+"))
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == train
    assert load_prompt_dataset(tmp_path / "test.jsonl") == [
        PromptRecord(row["prompt"], row["label"], i) for i, row in enumerate(test)
    ]


# ----------------------------------------------------------------------------- loader


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_loader_ours_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": "37+45=", "label": "82"}, {"prompt": "5-13=", "label": "-8"}]
    expected = [PromptRecord("37+45=", "82", 0), PromptRecord("5-13=", "-8", 1)]
    assert load_prompt_dataset(_write_jsonl(tmp_path / "a.jsonl", rows)) == expected
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    assert load_prompt_dataset(tmp_path / "a.parquet") == expected


def test_loader_gsm8k(tmp_path):
    rows = [
        {"question": "Tom has 3 apples...", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "How many cents?", "answer": "Compute.\n#### 1,234"},
    ]
    assert load_prompt_dataset(_write_jsonl(tmp_path / "g.jsonl", rows)) == [
        PromptRecord("Tom has 3 apples...", "7", 0),
        PromptRecord("How many cents?", "1234", 1),
    ]


def test_loader_dapo_parquet_with_chat_template(tmp_path):
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": "Solve 2+2."}],
            "reward_model": {"ground_truth": "4", "style": "rule"},
        },
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": "Half of 1?"}],
            "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    records = load_prompt_dataset(tmp_path / "d.parquet", tokenizer=build_char_tokenizer())
    assert records == [
        PromptRecord("Solve 2+2.", "4", 0, _without_prompt(rows[0])),
        PromptRecord("Half of 1?", "\\frac{1}{2}", 1, _without_prompt(rows[1])),
    ]
    with pytest.raises(ValueError, match=r"row 1 .*'prompt' is a chat message list; pass tok"):
        load_prompt_dataset(tmp_path / "d.parquet")


def _without_prompt(row: dict) -> dict:
    """verl's metadata: every column but the prompt."""
    return {key: value for key, value in row.items() if key != "prompt"}


def test_loader_explicit_keys(tmp_path):
    rows = [{"q": "1+1=", "meta": {"gt": "2"}}]
    path = _write_jsonl(tmp_path / "e.jsonl", rows)
    assert load_prompt_dataset(path, input_key="q", label_key="meta.gt") == [
        PromptRecord("1+1=", "2", 0)
    ]


def test_loader_errors_name_file_row_and_field(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "x"}])
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(path)
    message = str(info.value)
    assert str(path) in message and "line 2" in message and "'label'" in message

    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": 3, "label": "2"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2 .*'prompt' must be a string"):
        load_prompt_dataset(path)
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "1+1=", \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: invalid JSON"):
        load_prompt_dataset(path)
    path.write_text('{"prompt": "1+1=", "label": 2}\n')
    with pytest.raises(ValueError, match=r"line 1 .*'label' must be a string, got int"):
        load_prompt_dataset(path)
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": " \\n\\t", "label": "2"}\n')
    with pytest.raises(ValueError, match=r"line 2 .*'prompt' is empty or whitespace only"):
        load_prompt_dataset(path)
    chat = [{"role": "system", "content": ""}, {"role": "user", "content": "  "}]
    path.write_text(json.dumps({"prompt": chat, "label": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1 .*'prompt' has only blank message contents"):
        load_prompt_dataset(path, tokenizer=build_char_tokenizer())
    path.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match=r"line 1 .*no '#### <number>'"):
        load_prompt_dataset(path)
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}}]
        ),
        tmp_path / "bad.parquet",
    )
    with pytest.raises(ValueError, match=r"bad\.parquet, row 1 .*'reward_model.ground_truth'"):
        load_prompt_dataset(tmp_path / "bad.parquet", tokenizer=build_char_tokenizer())


# ----------------------------------------------------------------------------- rewards

_REWARD_CASES = [
    ("\\boxed{82}", "82", 1.0),
    ("37+45=\\boxed{82}", "82", 1.0),
    ("\\boxed{83}", "82", 0.0),
    ("82", "82", 0.0),  # no box: no answer
    ("\\boxed{82", "82", 0.0),  # unterminated
    ("\\boxed{82} then \\boxed{8", "82", 0.0),  # the last box is unterminated
    ("\\boxed{1} \\boxed{82}", "82", 1.0),  # the last box counts
    ("\\boxed{-8}", "-8", 1.0),
    ("\\boxed{8}", "-8", 0.0),
    ("\\boxed{}", "82", 0.0),
    ("\\boxed{82.0}", "82", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{82}", "\\boxed{82}", 1.0),
]


@pytest.mark.parametrize(("response", "label", "reward"), _REWARD_CASES)
def test_math_reward_hand_cases(response, label, reward):
    assert math_reward(response, label) == reward


def test_last_boxed_content_nested():
    assert last_boxed_content("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed_content("no box") is None


def test_rewards_in_worker_thread():
    responses = [response for response, _, _ in _REWARD_CASES]
    labels = [label for _, label, _ in _REWARD_CASES]
    results: list = []
    worker = threading.Thread(target=lambda: results.append(batch_rewards(responses, labels)))
    worker.start()
    worker.join()
    assert results == [[reward for _, _, reward in _REWARD_CASES]]

    errors: list = []

    def with_timeout():
        try:
            math_reward("\\boxed{82}", "82", timeout_s=2)
        except ValueError as e:
            errors.append(str(e))

    worker = threading.Thread(target=with_timeout)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "needs the main thread" in errors[0]


def test_parse_label_is_parsed_once_per_label_and_errors_are_not_cached():
    from megatron_sat.rollout import rewards

    rewards._parse_label_cached.cache_clear()
    first = rewards.parse_label("\\frac{164}{2}")
    first.append("edited by a caller")
    again = rewards.parse_label("\\frac{164}{2}")
    assert again == first[:-1] and len(again) == 2 and again[0] == 82
    info = rewards._parse_label_cached.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    for _ in range(2):  # raised each time, nothing cached
        with pytest.raises(ValueError, match="label is empty"):
            rewards.parse_label(" ")
    assert rewards._parse_label_cached.cache_info().currsize == 1
    # the memo does not change a verdict: the group of one prompt, scored in turn
    verdicts = [math_reward(r, "82") for r in ("\\boxed{82.0}", "\\boxed{81}", "\\boxed{82}")]
    assert verdicts == [1.0, 0.0, 1.0]


def test_reward_errors():
    with pytest.raises(ValueError, match="label is empty"):
        math_reward("\\boxed{1}", " ")
    with pytest.raises(ValueError, match="1 responses but 2 labels"):
        batch_rewards(["\\boxed{1}"], ["1", "2"])


# ----------------------------------------------------------------------------- run logger


def test_run_logger(tmp_path):
    with RunLogger(tmp_path / "run") as logger:
        logger.log(0, {"reward": 0.25, "loss": torch.tensor(1.5), "count": 3})
        logger.log(1, {"reward": float("nan"), "kl": torch.tensor([2.0], dtype=torch.float64)})
        with pytest.raises(ValueError, match="'bad' is a tensor of shape"):
            logger.log(2, {"bad": torch.zeros(2)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(2, {"step": 1.0})
        summary_path = logger.write_summary({"final_reward": 0.5, "nested": {"x": [1, math.inf]}})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "reward": 0.25, "loss": 1.5, "count": 3.0},
        {"step": 1, "reward": None, "kl": 2.0},
    ]
    assert summary_path == tmp_path / "run" / "summary.json"
    assert json.loads(summary_path.read_text()) == {
        "final_reward": 0.5,
        "nested": {"x": [1, None]},
    }
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(3, {"reward": 1.0})
    # a crash after step 1 was logged, resumed from the step-0 checkpoint: step 1 runs again
    with RunLogger(tmp_path / "run", resume_step=0) as logger:
        logger.log(1, {"reward": 0.75})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert json.loads(lines[1]) == {"step": 1, "reward": 0.75}
    # a crash in the middle of writing a line: the fragment goes too
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "rew')
    RunLogger(tmp_path / "run", resume_step=1).close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]


def test_a_non_utf8_line_is_named_with_its_file_line_and_column(tmp_path):
    from megatron_sat.rollout.datasets import DatasetFormatError, load_prompt_dataset

    path = tmp_path / "train.jsonl"
    good = b'{"prompt": "1+1=", "label": "2"}\n'
    path.write_bytes(good * 2 + b'{"prompt": "caf\xe9", "label": "2"}\n' + good)
    with pytest.raises(DatasetFormatError) as info:
        load_prompt_dataset(path)
    assert str(info.value).startswith(
        f"{path}, line 3: not UTF-8 (byte 0xe9 at column 16: invalid continuation byte)"
    )


def test_a_caller_editing_a_parsed_matrix_label_does_not_change_later_rewards():
    """A pmatrix label parses to a mutable sympy matrix: the memo hands out copies, so editing
    one cannot make a wrong answer score (found by review: it did, 1.0 for a 99)."""
    from megatron_sat.rollout import rewards

    label = r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"
    rewards.parse_label(label)[0][0, 0] = 99
    assert rewards.parse_label(label)[0][0, 0] == 1
    wrong = r"\boxed{\begin{pmatrix} 99 & 2 \\ 3 & 4 \end{pmatrix}}"
    right = r"\boxed{\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}}"
    assert rewards.math_reward(wrong, label) == 0.0
    assert rewards.math_reward(right, label) == 1.0
