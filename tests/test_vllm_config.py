"""``rollout.engine``: validation, and the RL loop's fleet for ``vllm`` (no server needed: the
fleet only builds clients until its first push)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_sat.config import RolloutConfig, RunConfig, load_config
from megatron_sat.rollout.fleet import RolloutFleet
from megatron_sat.rollout.vllm.client import VLLMClient
from megatron_sat.rollout.vllm.fleet import VLLMFleet
from megatron_sat.rollout.vllm.updater import VLLMWeightUpdater, layer_buckets, layer_key
from megatron_sat.training.engines import rollout_fleet
from megatron_sat.training.rl import validate_run

ROOT = Path(__file__).resolve().parents[1]


def test_engine_is_validated():
    assert RolloutConfig().engine == "sglang"
    with pytest.raises(ValueError, match="rollout.engine must be sglang or vllm"):
        RolloutConfig(engine="trt")
    # vLLM servers come by URL or from the launch scripts (launch.rollout_engine=vllm).
    with pytest.raises(ValueError, match="rollout.engine=vllm with launch.rollout_engine=sglang"):
        load_config(None, ["rollout.engine=vllm"])
    cfg = load_config(
        None, ["rollout.engine=vllm", "launch.rollout_engine=vllm", "launch.device=cpu"]
    )
    with pytest.raises(ValueError, match="rollout.engine=vllm needs rollout.server_urls"):
        validate_run(cfg)  # train: the launch script passes the URLs, nobody else does
    with pytest.raises(ValueError, match="launch.rollout_engine=vllm starts vLLM servers"):
        load_config(None, ["launch.rollout_engine=vllm", "launch.device=cpu"])


def test_r3_without_routed_experts_is_refused_naming_both_fields():
    assert RolloutConfig().return_routed_experts is True
    with pytest.raises(ValueError, match=r"train.use_r3=true .* rollout.return_routed_experts"):
        load_config(None, ["rollout.return_routed_experts=false"])
    cfg = load_config(None, ["rollout.return_routed_experts=false", "train.use_r3=false"])
    assert not cfg.train.use_r3 and not cfg.rollout.return_routed_experts


def _sample(index: int, routed: bool):
    import numpy as np

    from megatron_sat.rollout.types import Sample

    return Sample(
        index=index,
        group_index=0,
        prompt="1+1=",
        label="2",
        prompt_ids=[5, 6],
        response_ids=[7],
        rollout_log_probs=[-0.5],
        response_versions=[0],
        routed_experts=np.zeros((2, 4, 2), dtype=np.uint8) if routed else None,
    )


@pytest.mark.parametrize("use_r3", [True, False])
def test_rl_step_reads_routes_only_when_r3_or_present(use_r3):
    from types import SimpleNamespace

    from megatron_sat.config import TrainConfig
    from megatron_sat.training.trainer import PolicyTrainer

    trainer = SimpleNamespace(train_config=TrainConfig(use_r3=use_r3))
    reads = PolicyTrainer._reads_routes
    assert reads(trainer, [_sample(0, True), _sample(1, True)]) is True
    assert reads(trainer, []) is True  # an empty data-parallel share
    without = [_sample(0, False), _sample(1, False)]
    if use_r3:  # never a silent fall back to live routing
        with pytest.raises(ValueError, match=r"train.use_r3=true .* sample\(s\) \[0, 1\]"):
            reads(trainer, without)
    else:
        assert reads(trainer, without) is False
    with pytest.raises(ValueError, match=r"\[1\]|samples \[1\] carry no routed_experts"):
        reads(trainer, [_sample(0, True), _sample(1, False)])


def test_vllm_spans_become_per_token_versions_of_the_samples():
    from megatron_sat.rollout.client import GenerateOutput
    from megatron_sat.rollout.datasets import PromptRecord
    from megatron_sat.rollout.pool import RolloutPool
    from megatron_sat.rollout.tokenizer import build_char_tokenizer
    from megatron_sat.rollout.vllm.client import spans_to_versions

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    assert spans_to_versions(spans, 3) == ["3", "3", "4"]
    with pytest.raises(ValueError, match="spans cover 3 of 4 tokens"):
        spans_to_versions(spans, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        spans_to_versions([spans[1]], 1)

    def output(versions):
        return GenerateOutput(
            output_ids=[7, 8, 9],
            output_token_logprobs=[-1.0, -1.0, -1.0],
            finish_reason="length",
            weight_version="4",
            routed_experts=None,
            prompt_tokens=4,
            completion_tokens=3,
            output_token_versions=versions,
        )

    assert output(None).token_versions() == ["4", "4", "4"]  # SGLang: one per request
    assert output(["3", "3", "4"]).token_versions() == ["3", "3", "4"]
    with pytest.raises(ValueError, match="2 output_token_versions for 3 output tokens"):
        output(["3", "4"]).token_versions()

    class Client:
        base_url = "http://fake"

        def generate(self, prompts, params, routing=None):
            return [output(["3", "3", "4"]) for _ in prompts]

    tokenizer = build_char_tokenizer()
    pool = RolloutPool([Client()], tokenizer, lambda text, label: 0.0, routing=None)
    try:
        samples = pool.generate_groups(
            [PromptRecord(prompt="1+1=", label="2", source_index=0)],
            2,
            temperature=1.0,
            max_new_tokens=3,
        )
    finally:
        pool.close()
    # A request that ran across a weight update keeps both versions, token by token.
    assert [s.response_versions for s in samples] == [[3, 3, 4], [3, 3, 4]]


def test_vllm_engine_gives_a_vllm_fleet():
    cfg = RunConfig(rollout=RolloutConfig(engine="vllm", server_urls=["http://127.0.0.1:9"]))
    with rollout_fleet(cfg) as fleet:
        assert type(fleet) is VLLMFleet and fleet.updater_cls is VLLMWeightUpdater
        assert [type(c) for c in fleet.clients] == [VLLMClient]
        assert fleet.clients[0].base_url == "http://127.0.0.1:9"
    assert RolloutFleet.updater_cls is not VLLMWeightUpdater


def test_buckets_hold_whole_layers():
    import torch

    names = [
        "model.embed_tokens.weight",
        "model.layers.0.a.weight",
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.1.a.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert [layer_key(n) for n in names] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    tensors = [(n, torch.zeros(4)) for n in names]  # 16 bytes each
    buckets = [[n for n, _ in b] for b in layer_buckets(tensors, bucket_bytes=40)]
    # Layer 0 (32 bytes) never splits; a bucket closes before a layer that would overflow it.
    assert buckets == [names[:1], names[1:3], names[3:5], names[5:]]
    assert [n for b in buckets for n in b] == names


def test_rollout_dtype_with_server_urls_is_refused_not_ignored():
    # rollout.dtype is the embedded servers' --dtype; servers given by URL keep theirs
    assert RolloutConfig(server_urls=["http://127.0.0.1:9"]).dtype == "float32"
    with pytest.raises(ValueError, match=r"rollout\.dtype='bfloat16' applies to embedded"):
        RolloutConfig(dtype="bfloat16", server_urls=["http://127.0.0.1:9"])
    assert RolloutConfig(dtype="bfloat16").dtype == "bfloat16"


def _vllm_launch(tmp_path, *overrides):
    import json

    from megatron_sat.launch.prepare import prepare_launch

    # The warm start's config.json: the template with the char tokenizer's vocabulary.
    hf = json.loads((ROOT / "examples" / "models" / "qwen3_moe_tiny.json").read_text())
    model_config = tmp_path / "config.json"
    model_config.write_text(json.dumps(dict(hf, vocab_size=64)))
    cfg = load_config(
        ROOT / "examples" / "configs" / "tiny_cpu_launch.yaml",
        [
            "rollout.engine=vllm",
            "launch.rollout_engine=vllm",
            "train.use_r3=false",
            "rollout.return_routed_experts=false",
            f"run_dir={tmp_path / 'run'}",
            f"launch.workdir={tmp_path}",
            # The plan reads the model's config.json; a fresh clone has no warm start yet.
            f"launch.model_config={model_config}",
            *overrides,
        ],
    )
    prepared = prepare_launch(cfg, tmp_path / "launch")
    subprocess.run(["bash", "-n", str(prepared.script_path)], check=True)
    return prepared.script_path.read_text()


def _server_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "-m vllm.entrypoints.openai.api_server" in line]


def test_single_node_launch_renders_a_loopback_vllm_server_from_its_environment(tmp_path):
    text = _vllm_launch(tmp_path, "launch.launcher=torchrun")
    assert f"VLLM_PY={tmp_path}/.cache/vllm-env/bin/python\n" in text  # tools/vllm_env.sh's
    assert "export VLLM_SERVER_DEV_MODE=1\n" in text
    (line,) = _server_lines(text)
    # The command VLLMServer runs in tests/test_vllm_engine.py (rollout.vllm.args.server_args).
    assert line == (
        '"$VLLM_PY" -m vllm.entrypoints.openai.api_server --model checkpoints/warm_start '
        "--host 127.0.0.1 --port 30000 --dtype float32 --seed 1234 --enable-scale-out "
        "--logprobs-mode processed_logprobs --weight-transfer-config "
        """'{"backend": "megatron_sat_gloo"}' --enforce-eager > "$LOG_DIR/server_0.log" 2>&1 &"""
    )
    # One node: loopback, no key anywhere.
    assert "KEYGEN_PY" not in text and "VLLM_API_KEY" not in text and "--api-key" not in text
    assert 'wait_healthy "http://127.0.0.1:30000"' in text
    assert "rollout.server_urls=$SERVER_URLS" in text


def test_multi_node_vllm_launch_binds_the_node_with_the_jobs_key_off_the_text(tmp_path):
    text = _vllm_launch(
        tmp_path,
        "launch.launcher=mpirun",
        "launch.num_nodes=2",
        "launch.hosts=[n1,n2]",
        "launch.gpus_per_node=2",
        "launch.trainer_gpus_per_node=2",
        "rollout.return_routed_experts=true",
        "train.use_r3=true",
        "launch.vllm_env=/opt/vllm",
        "launch.vllm_args=[--max-model-len,'256']",
    )
    assert "VLLM_PY=/opt/vllm/bin/python\n" in text
    # The API key reaches vLLM as VLLM_API_KEY, read from the job's key file at run time.
    assert 'VLLM_API_KEY="$("$PY" -c "$API_KEY_PY" "$KEY_FILE")"' in text
    assert "sk-" not in text.replace('": sk-"', "")  # only the generator's prefix
    lines = _server_lines(text)
    assert len(lines) == 2 and all("--api-key" not in line for line in lines)
    for node, line in zip(["n2", "n2"], lines, strict=True):
        assert f"--host {node}:1 " in line and f"--host {node} --port 3000" in line
        assert "-x VLLM_SERVER_DEV_MODE -x VLLM_API_KEY" in line
        assert "--enforce-eager --enable-return-routed-experts --max-model-len 256" in line
        assert '"$REDACT_PY" "$KEY_FILE"' in line  # the server log passes the key filter
    assert '"rollout.server_key_file=$KEY_FILE"' in text


def test_gpu_vllm_launch_uses_nccl_and_tensor_parallel_servers(tmp_path):
    from megatron_sat.launch.plan import resolve_plan
    from megatron_sat.launch.render import RenderContext, render

    cfg = load_config(
        ROOT / "examples" / "configs" / "qwen3_30b_a3b_sat_gspo_r3.yaml",
        ["rollout.engine=vllm", "launch.rollout_engine=vllm", f"run_dir={tmp_path}"],
    )
    ctx = RenderContext("c.yaml", "ckpt", "/w", "python", "/w/logs", 0, 8, True, "/v/bin/python")
    (line,) = _server_lines(render(resolve_plan(cfg), ctx))
    assert line.startswith('CUDA_VISIBLE_DEVICES=4,5,6,7 "$VLLM_PY" -m vllm')
    assert "--dtype auto" in line and "--tensor-parallel-size 4" in line
    assert """'{"backend": "nccl"}'""" in line and "--enforce-eager" not in line
    assert "--enable-return-routed-experts" in line  # R3 on GPUs


def test_vllm_args_may_not_repeat_the_launchers_flags():
    with pytest.raises(ValueError, match=r"launch.vllm_args must be free of .*--api-key"):
        load_config(None, ["launch.vllm_args=[--api-key,x]"])
