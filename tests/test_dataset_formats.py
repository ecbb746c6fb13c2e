"""Dataset formats as their projects write them: verl's parquet (``examples/data_preprocess``:
data_source, prompt messages, ability, reward_model, extra_info) and slime's jsonl with its
``--input-key`` / ``--label-key`` / ``--metadata-key`` / ``--tool-key``; the metadata reaches
``Sample.metadata`` through both rollout pools and the asynchronous pool's checkpoint."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
from megatron_sat.rollout.client import GenerateOutput, SamplingParams
from megatron_sat.rollout.datasets import (
    DatasetFormatError,
    PromptRecord,
    json_value,
    load_prompt_dataset,
)
from megatron_sat.rollout.pool import RolloutPool
from megatron_sat.rollout.tokenizer import build_char_tokenizer


def verl_gsm8k_row(index: int, question: str, answer: str, solution: str) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it (its `process_fn`)."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": "train", "index": index, "answer": answer, "question": question},
    }


def test_verl_parquet_reads_prompt_label_and_every_other_column_as_metadata(tmp_path):
    rows = [
        verl_gsm8k_row(0, "Tom has 3+4 apples.", "3+4=7\n#### 7", "7"),
        verl_gsm8k_row(1, "Half of 2?", "2/2=1\n#### 1", "1"),
    ]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "Be brief. "})
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records = load_prompt_dataset(path, tokenizer=build_char_tokenizer())
    # The char tokenizer's template concatenates the contents (tokenizer.CHAT_TEMPLATE).
    assert [r.prompt for r in records] == [
        "Tom has 3+4 apples. Let's think step by step.",
        "Be brief. Half of 2? Let's think step by step.",
    ]
    assert [r.label for r in records] == ["7", "1"]
    assert records[1].metadata == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {
            "split": "train",
            "index": 1,
            "answer": "2/2=1\n#### 1",
            "question": "Half of 2?",
        },
    }
    # A metadata key alone keeps detection and replaces verl's metadata by that column.
    (r0, _) = load_prompt_dataset(path, metadata_key="extra_info", tokenizer=build_char_tokenizer())
    assert (r0.label, r0.metadata["index"], sorted(r0.metadata)) == (
        "7",
        0,
        ["answer", "index", "question", "split"],
    )


def test_verl_parquet_with_numpy_and_nested_lists_stays_exact_json(tmp_path):
    # pandas writes verl's parquet in practice; list columns come back as lists, int64 as int.
    row = verl_gsm8k_row(5, "1+1?", "#### 2", "2")
    row["extra_info"]["tools_kwargs"] = {"calc": {"create_kwargs": {"ground_truth": "2"}}}
    row["extra_info"]["scores"] = [0.5, 1.25]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    (record,) = load_prompt_dataset(path, tokenizer=build_char_tokenizer())
    assert record.metadata["extra_info"]["scores"] == [0.5, 1.25]
    assert record.metadata["extra_info"]["tools_kwargs"]["calc"]["create_kwargs"] == {
        "ground_truth": "2"
    }
    assert json.loads(json.dumps(record.metadata)) == record.metadata
    # numpy values (a datasets/pandas reader's) become their Python numbers and lists.
    value = {"a": np.array([1, 2], dtype=np.int64), "b": np.float32(0.5), "c": (np.int8(-3),)}
    out = json_value(value, "m", "f, row 1")
    assert out == {"a": [1, 2], "b": 0.5, "c": [-3]}
    assert [type(v) for v in (out["a"][0], out["b"], out["c"][0])] == [int, float, int]


class RecordingTokenizer:
    """A chat template that shows what it was given: the messages, tools and kwargs."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, dict]] = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        assert tokenize is False and add_generation_prompt is True
        self.calls.append((messages, kwargs))
        tools = ",".join(t["name"] for t in kwargs.get("tools") or [])
        return f"<{tools}>" + "|".join(f"{m['role']}:{m['content']}" for m in messages)


def test_slime_jsonl_with_custom_keys_metadata_and_tools(tmp_path):
    tools = [{"name": "python", "parameters": {"type": "object"}}]
    rows = [
        {"problem": "2+2?", "answer": "4", "meta": {"rm_type": "math", "source_name": "a"}},
        {"problem": "3+3?", "answer": "6", "meta": {"rm_type": "f1"}, "tools": tools},
        # slime also reads the tools as a JSON string of the list
        {"problem": "4+4?", "answer": "8", "meta": {}, "tools": json.dumps(tools)},
    ]
    path = tmp_path / "slime.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = RecordingTokenizer()
    records = load_prompt_dataset(
        path,
        input_key="problem",
        label_key="answer",
        metadata_key="meta",
        tool_key="tools",
        apply_chat_template=True,
        apply_chat_template_kwargs={"enable_thinking": False},
        tokenizer=tokenizer,
    )
    assert records == [
        PromptRecord("<>user:2+2?", "4", 0, {"rm_type": "math", "source_name": "a"}),
        PromptRecord("<python>user:3+3?", "6", 1, {"rm_type": "f1", "tools": tools}),
        PromptRecord("<python>user:4+4?", "8", 2, {"tools": tools}),
    ]
    assert tokenizer.calls[0] == ([{"role": "user", "content": "2+2?"}], {"enable_thinking": False})
    assert tokenizer.calls[1][1] == {"enable_thinking": False, "tools": tools}
    # Without apply_chat_template, slime's string inputs are used as written.
    plain = load_prompt_dataset(path, input_key="problem", label_key="answer", metadata_key="meta")
    assert [(r.prompt, r.metadata) for r in plain] == [
        (row["problem"], row["meta"]) for row in rows
    ]


def test_prompt_label_rows_carry_their_metadata_object(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "1+1=", "label": "2", "metadata": {"k": [1, None, True]}}]
    rows.append({"prompt": "2+2=", "label": "4"})  # no metadata: empty, as in slime
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.metadata for r in load_prompt_dataset(path)] == [{"k": [1, None, True]}, {}]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "rows, keys, message",
    [
        (
            [{"q": "1", "a": "1", "m": {}}, {"q": "2", "a": "2"}],
            {"metadata_key": "m"},
            r"e\.jsonl, line 2 \(explicit keys schema\): missing field 'm'",
        ),
        (
            [{"q": "1", "a": "1", "m": ["x"]}],
            {"metadata_key": "m"},
            r"line 1 .*field 'm' must be an object, got list",
        ),
        (
            [{"q": "1", "a": "1", "m": {"s": 1}}, {"q": "2", "a": "2", "m": {"s": float("nan")}}],
            {"metadata_key": "m"},
            r"line 2 .*field 'm\.s' is nan \(not JSON\)",
        ),
        (
            [{"q": "1", "a": "1", "t": [{"name": "f"}]}],
            {"tool_key": "t"},
            r"line 1 .*has tools but its string prompt does not go through the chat template",
        ),
        (
            [{"q": "1", "a": "1", "t": "[{oops"}],
            {"tool_key": "t", "apply_chat_template": True},
            r"line 1 .*field 't' is a string but not JSON",
        ),
        (
            [{"q": "1", "a": "1", "t": ["f"]}],
            {"tool_key": "t", "apply_chat_template": True},
            r"line 1 .*field 't' must be a list of tool objects",
        ),
    ],
)
def test_bad_slime_rows_name_file_row_and_field(tmp_path, rows, keys, message):
    path = _jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(DatasetFormatError, match=message):
        load_prompt_dataset(
            path, input_key="q", label_key="a", tokenizer=RecordingTokenizer(), **keys
        )


def test_metadata_parquet_can_not_hold_is_refused_naming_row_and_field(tmp_path):
    row = verl_gsm8k_row(0, "q", "#### 1", "1")
    rows = [dict(row, blob=None), dict(row, blob=b"\x00\x01")]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(
        DatasetFormatError, match=r"bad\.parquet, row 2 \(verl schema\): field 'blob' is bytes"
    ):
        load_prompt_dataset(path, tokenizer=build_char_tokenizer())
    # A non-string ground truth is not a label.
    row = dict(
        verl_gsm8k_row(0, "q", "#### 1", "1"), reward_model={"style": "rule", "ground_truth": 1}
    )
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(
        DatasetFormatError, match=r"row 1 .*'reward_model.ground_truth' must be a string, got int"
    ):
        load_prompt_dataset(path, tokenizer=build_char_tokenizer())
    with pytest.raises(DatasetFormatError, match=r"field 'm' has the key 1 \(int\)"):
        json_value({1: "a"}, "m", "x")


def test_parquet_map_columns_become_objects(tmp_path):
    # verl's extra_info written as a map<string, string>: pyarrow's default hands it out as
    # a list of (key, value) pairs, which would reach the reward function as a list
    row = verl_gsm8k_row(0, "q", "#### 1", "1")
    extra = pa.array([[("split", "train"), ("idx", "7")]], type=pa.map_(pa.string(), pa.string()))
    table = (
        pa.Table.from_pylist([row]).drop_columns(["extra_info"]).append_column("extra_info", extra)
    )
    path = tmp_path / "map.parquet"
    pq.write_table(table, path)
    (record,) = load_prompt_dataset(path, tokenizer=build_char_tokenizer())
    assert record.metadata["extra_info"] == {"split": "train", "idx": "7"}
    # a map with integer keys is not JSON; a key twice is refused naming the row
    rows = [[(1, "a")], [(2, "b")]]
    table = pa.table({"prompt": ["p", "p"], "label": ["1", "1"]})
    meta = pa.array(rows, type=pa.map_(pa.int64(), pa.string()))
    pq.write_table(table.append_column("metadata", meta), path)
    with pytest.raises(DatasetFormatError, match=r"row 1 .*field 'metadata' has the key 1"):
        load_prompt_dataset(path)
    meta = pa.array(
        [[("a", "1")], [("a", "1"), ("a", "2")]], type=pa.map_(pa.string(), pa.string())
    )
    pq.write_table(table.append_column("metadata", meta), path)
    with pytest.raises(
        DatasetFormatError, match=r"map\.parquet, row 2: a map column holds a key twice"
    ):
        load_prompt_dataset(path)


def test_metadata_tools_clash_and_huge_integers_name_the_row(tmp_path):
    rows = [
        {"q": "1", "a": "1", "t": [{"name": "f"}]},
        {"q": "2", "a": "2", "t": [{"name": "f"}], "metadata": {"tools": "mine"}},
    ]
    with pytest.raises(
        DatasetFormatError, match=r"e\.jsonl, line 2 .*metadata has its own 'tools'"
    ):
        load_prompt_dataset(
            _jsonl(tmp_path / "e.jsonl", rows),
            input_key="q",
            label_key="a",
            tool_key="t",
            apply_chat_template=True,
            tokenizer=RecordingTokenizer(),
        )
    path = tmp_path / "big.jsonl"
    path.write_text(
        '{"prompt": "a", "label": "1"}\n{"prompt": "a", "label": "1", "metadata": {"x": '
        + "9" * 5000
        + "}}\n"
    )
    with pytest.raises(DatasetFormatError, match=r"big\.jsonl, line 2: unreadable JSON \(Exceeds"):
        load_prompt_dataset(path)


def test_input_key_and_label_key_both_walk_into_objects(tmp_path):
    rows = [{"x": {"q": "What?"}, "y": {"a": "1"}}]
    (record,) = load_prompt_dataset(
        _jsonl(tmp_path / "n.jsonl", rows), input_key="x.q", label_key="y.a"
    )
    assert (record.prompt, record.label) == ("What?", "1")
    rows = [{"x.q": "What?", "a": "1"}]  # a literal dotted key cannot be named: said so
    with pytest.raises(
        DatasetFormatError, match=r"missing field 'x' \(the row has a key with the dots"
    ):
        load_prompt_dataset(_jsonl(tmp_path / "d.jsonl", rows), input_key="x.q", label_key="a")


# ------------------------------------------------------------------ through the rollout pools


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if 32 <= i < 127)


class FakeClient:
    """A server answering two tokens at the weight version ``holder['version']``."""

    def __init__(self, name, holder):
        self.base_url = f"fake://{name}"
        self.holder = holder

    def generate(self, input_ids, sampling, routing=None):
        output = {
            "output_ids": [50, 51],
            "output_token_logprobs": [-0.1, -0.2],
            "finish_reason": "stop",
            "weight_version": str(self.holder["version"]),
            "routed_experts": None,
            "completion_tokens": 2,
        }
        return [GenerateOutput(prompt_tokens=len(ids), **output) for ids in input_ids]


def meta_records(start: int = 0):
    for i in itertools.count(start):
        meta = {"data_source": "t", "extra_info": {"index": i}}
        yield PromptRecord(f"{i % 50}+1=", str(i % 50 + 1), i, meta)


def test_metadata_reaches_every_sample_of_the_synchronous_pool():
    pool = RolloutPool(
        [FakeClient("a", {"version": 0})],
        CharTokenizer(),
        lambda text, label: 0.0,
        routing=None,
    )
    records = list(itertools.islice(meta_records(), 3))
    samples = pool.generate_groups(records, 2, temperature=1.0, max_new_tokens=2)
    pool.close()
    assert [s.metadata["extra_info"]["index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    samples[0].metadata["extra_info"]["index"] = 99  # each sample holds its own copy
    assert samples[1].metadata["extra_info"]["index"] == 0
    assert records[0].metadata["extra_info"]["index"] == 0


def test_metadata_survives_the_asynchronous_pool_and_its_checkpoint():
    def pool(start):
        return AsyncRolloutPool(
            [FakeClient("a", holder)],
            CharTokenizer(),
            lambda text, label: 0.0,
            meta_records(start),
            AsyncPoolConfig(mode="bounded", lag=2, prompts_per_batch=2, group_size=2),
            SamplingParams(max_new_tokens=2),
        )

    def check(batch):
        for s in batch:
            assert s.metadata == {"data_source": "t", "extra_info": {"index": int(s.label) - 1}}

    holder = {"version": 0}
    a = pool(0)
    a.start()
    check(a.get_batch(0, timeout_s=30))
    holder["version"] = 1
    a.set_version(1)
    state = a.export_state(1)
    a.stop()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as the run checkpoint holds it
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    saved = [s for b in state["batches"] for g in b["groups"].values() for s in g if s]
    saved += [job["record"] for job in state["queue"]]
    assert saved and all("extra_info" in entry["metadata"] for entry in saved)
    b = pool(state["drawn"])
    b.restore_state(state)
    b.start()
    for step in range(3):
        check(b.get_batch(step, timeout_s=30))
        holder["version"] += 1
        b.set_version(step + 1)
    b.stop()


def test_data_config_keys_from_overrides_and_their_checks():
    from megatron_sat.config import load_config

    cfg = load_config(
        None,
        [
            "data.input_key=problem",
            "data.label_key=reward_model.ground_truth",
            "data.apply_chat_template=true",
            "data.apply_chat_template_kwargs={enable_thinking: false}",
        ],
    )
    assert cfg.data.loader_kwargs() == {
        "input_key": "problem",
        "label_key": "reward_model.ground_truth",
        "metadata_key": None,
        "tool_key": None,
        "apply_chat_template": True,
        "apply_chat_template_kwargs": {"enable_thinking": False},
    }
    with pytest.raises(ValueError, match=r"data.metadata_key must be a non-empty string"):
        load_config(None, ["data.metadata_key=' '"])
    with pytest.raises(ValueError, match=r"data.apply_chat_template_kwargs sets 'tools'"):
        load_config(None, ["data.apply_chat_template_kwargs={tools: []}"])
    with pytest.raises(ValueError, match=r"data.apply_chat_template_kwargs must be a mapping"):
        load_config(None, ["data.apply_chat_template_kwargs=[1]"])
