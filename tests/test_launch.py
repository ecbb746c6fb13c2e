"""Launch plan, dry-run, renderers, rank discovery and evaluation metrics (no cluster needed).

Oracles: transformers' own models built on the meta device (parameter counts), megatron-core's
RankGenerator (process groups), hand-computed sharding and pass@k, ``bash -n`` (scripts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_sat.cli import main
from megatron_sat.config import load_config
from megatron_sat.config.layout import layout_errors
from megatron_sat.launch.env import resolve_rank_env
from megatron_sat.launch.eval_job import EvalOptions, eval_metrics, pass_at_k
from megatron_sat.launch.memory import GIB, count_parameters
from megatron_sat.launch.plan import rank_groups, resolve_plan
from megatron_sat.launch.prepare import prepare_launch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml"
QWEN3_30B = json.loads((ROOT / "examples/models/qwen3_30b_a3b.json").read_text())


def _meta_count(hf: dict) -> int:
    import torch
    import transformers

    arch = hf["architectures"][0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    return sum(p.numel() for p in model.parameters())


SMALL_MODELS = {
    "qwen3_moe_dense_tied_bias": dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=100,
        tie_word_embeddings=True,
        decoder_sparse_step=2,
        mlp_only_layers=[0],
        attention_bias=True,
    ),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=100,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=100,
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        vocab_size=100,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    ),
}


# -- parameter counts and memory ------------------------------------------------------------
def test_qwen3_30b_a3b_parameter_count_matches_transformers_and_model_card():
    count = count_parameters(QWEN3_30B)
    assert count.total == 30_532_122_624 == _meta_count(QWEN3_30B)
    assert count.non_embedding == 29_909_792_768
    # Model card: "30.5B in total", "29.9B non-embedding".
    assert round(count.total / 1e9, 1) == 30.5 and round(count.non_embedding / 1e9, 1) == 29.9


@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
def test_parameter_count_matches_transformers(name):
    hf = SMALL_MODELS[name]
    assert count_parameters(hf).total == _meta_count(hf)


def test_unknown_architecture_is_named():
    with pytest.raises(ValueError, match="architectures=.*LlamaForCausalLM"):
        count_parameters(dict(QWEN3_30B, architectures=["LlamaForCausalLM"]))


# -- process groups -------------------------------------------------------------------------
@pytest.mark.parametrize("tp,dp,pp,ep", [(2, 2, 2, 1), (4, 1, 1, 4), (2, 4, 1, 2), (2, 2, 3, 2)])
def test_rank_groups_equal_megatron_rank_generator(tp, dp, pp, ep):
    from megatron.core.parallel_state import RankGenerator

    sizes = {"tp": tp, "cp": 1, "ep": 1, "dp": dp, "pp": pp}
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for token in ("tp", "pp", "dp", "tp-pp"):
        assert rank_groups(sizes, tuple(token.split("-"))) == gen.get_ranks(token)
    edp = tp * dp * pp // (ep * pp)
    expert_sizes = {"tp": 1, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    gen = RankGenerator(tp=1, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for token in ("ep", "dp", "tp"):
        assert rank_groups(expert_sizes, (token,)) == gen.get_ranks(token)


# -- the paper's recipe ---------------------------------------------------------------------
def test_paper_recipe_dry_run_prints_valid_8_gpu_topology(capsys):
    assert main(["launch", "--config", str(RECIPE), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "allocation: 1 node(s) x 8 GPUs = 8; trainer 4" in out
    assert "world 4 = TP 4 x PP 1 x DP 1" in out
    assert "EP 4 x expert-TP 1 x expert-DP 1; sequence parallel on" in out
    assert "server 0: node 0, devices 4,5,6,7, port 30000, sglang --tp-size 4" in out
    assert "--enable-return-routed-experts" in out
    assert "one group of 5 ranks" in out and "backend nccl" in out
    assert "tensor parallel          [[0, 1, 2, 3]]" in out
    assert "experts 96-127, embedding rows 113952-151935" in out
    # Hand count of the heaviest rank: per layer attention (q, k, v, o) / TP 4 + replicated
    # norms and router + 128 experts / EP 4; embedding and output split over TP 4.
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    replicated = 2 * 128 + 2 * 2048 + 128 * 2048
    experts = 128 * 3 * 2048 * 768
    per_rank = 48 * (attention // 4 + replicated + experts // 4) + 2 * 151936 * 2048 // 4 + 2048
    assert per_rank == 7_642_626_048
    assert f"{per_rank:,} parameters -> params {per_rank * 2 / GIB:.1f} GiB" in out
    # As built (optimizer in host memory): 6 B/param = 2 + 4; without the offload 18 B/param
    # = 2 + 4 + 4 + 8, printed as the alternative.
    assert f"= {per_rank * 6 / GIB:.1f} GiB of 139 GiB" in out
    assert f"= {per_rank * 18 / GIB:.1f} GiB of 139 GiB" in out
    assert f"bf16 weights {30_532_122_624 * 2 // 4 / GIB:.1f} GiB (TP 4)" in out


def test_recipe_plan_values():
    plan = resolve_plan(load_config(RECIPE))
    assert (plan.world_size, plan.tp, plan.ep, plan.etp, plan.dp) == (4, 4, 4, 1, 1)
    assert [(r.tp, r.ep) for r in plan.ranks] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [s.sync_ranks for s in plan.servers] == [(1, 2, 3, 4)]
    # A token budget per micro-batch: the count is set by the lengths (0 here).
    assert plan.samples_per_step == 256 * 16 and plan.micro_batches_per_dp_rank == 0


VARIANTS = {
    "sat_gspo_r3_lag8": {("rollout", "update_weights_interval"): 8},
    "grpo_r3": {("objective", "name"): "grpo"},
    "gspo_r3": {("objective", "name"): "gspo"},
    "gspo_token_r3": {("objective", "name"): "gspo-token"},
    "sat_grpo_r3": {("objective", "name"): "sat-grpo"},
    "dppo_tv_r3": {("objective", "name"): "dppo-tv"},
    "dppo_kl_r3": {("objective", "name"): "dppo-kl"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_recipe_variants_differ_only_where_named(variant):
    base = load_config(RECIPE).to_dict()
    other = load_config(ROOT / f"examples/configs/qwen3_30b_a3b_{variant}.yaml").to_dict()
    assert other["run_dir"] == f"runs/qwen3_30b_a3b_{variant}"
    for (section, key), value in VARIANTS[variant].items():
        assert other[section][key] == value != base[section][key]
        other[section][key] = base[section][key]
    other["run_dir"] = base["run_dir"]
    assert other == base
    resolve_plan(load_config(ROOT / f"examples/configs/qwen3_30b_a3b_{variant}.yaml"))


def test_recipe_holds_the_paper_settings():
    cfg = load_config(RECIPE)
    assert (cfg.train.lr, cfg.train.adam_beta1, cfg.train.adam_beta2) == (1e-6, 0.9, 0.98)
    assert (cfg.objective.name, cfg.objective.eps_low, cfg.objective.eps_high) == (
        "sat-gspo",
        0.2,
        0.2,
    )
    assert cfg.objective.kl_coef == 1e-3 and cfg.train.use_r3
    ro = cfg.rollout
    assert (ro.prompts_per_step, ro.group_size, ro.top_p, ro.top_k) == (256, 16, 1.0, -1)
    assert ro.update_weights_interval == 1 and ro.eval_samples_per_prompt == 16
    assert cfg.train.eval_every == 5 and "aime24" in cfg.data.eval_path


# -- ten (and more) wrong configurations ------------------------------------------------------
WRONG = [
    # (overrides on the paper recipe, the field the message must name)
    (["launch.trainer_gpus_per_node=6"], "parallel.tensor_model_parallel_size=4 x parallel.pip"),
    (
        [
            "launch.trainer_gpus_per_node=6",
            "parallel.tensor_model_parallel_size=2",
            "parallel.expert_model_parallel_size=3",
        ],
        "parallel.expert_model_parallel_size=3",
    ),
    (
        [
            "launch.trainer_gpus_per_node=6",
            "parallel.tensor_model_parallel_size=3",
            "parallel.expert_model_parallel_size=1",
        ],
        "parallel.tensor_model_parallel_size=3 does not "
        "divide the model's num_attention_heads (32)",
    ),
    (
        [
            "launch.gpus_per_node=16",
            "launch.trainer_gpus_per_node=8",
            "parallel.tensor_model_parallel_size=8",
            "parallel.expert_model_parallel_size=1",
        ],
        "parallel.tensor_model_parallel_size=8 does not divide the model's num_key_value_heads",
    ),
    (
        [
            "launch.trainer_gpus_per_node=5",
            "parallel.tensor_model_parallel_size=1",
            "parallel.expert_model_parallel_size=5",
        ],
        "parallel.expert_model_parallel_size=5 does not divide the model's experts (128)",
    ),
    (
        [
            "parallel.tensor_model_parallel_size=1",
            "parallel.expert_model_parallel_size=1",
            "parallel.pipeline_model_parallel_size=5",
            "launch.gpus_per_node=9",
            "launch.trainer_gpus_per_node=5",
        ],
        "parallel.pipeline_model_parallel_size=5 does not divide the model's layers (48)",
    ),
    (["launch.gpus_per_node=7"], "launch.rollout_server_tp=4 does not divide the 3 rollout"),
    (
        ["train.max_tokens_per_micro_batch=null", "train.micro_batch_size=3"],
        "train.micro_batch_size=3",
    ),
    (
        [
            "launch.gpus_per_node=16",
            "launch.trainer_gpus_per_node=12",
            "rollout.prompts_per_step=256",
        ],
        "rollout.prompts_per_step=256 is not divisible by DP 3",
    ),
    (["launch.gpu_memory_gib=80"], "launch.gpu_memory_gib=80"),
    (["launch.trainer_nodes=2"], "launch.trainer_nodes must be <= num_nodes=1"),
    (["launch.trainer_gpus_per_node=9"], "launch.trainer_gpus_per_node must be <= gpus_per_node"),
    (["launch.launcher=pbs"], "launch.launcher must be one of"),
    (["launch.num_nodes=2"], "launch.launcher must be slurm or mpirun for num_nodes > 1"),
    (["launch.rollout_engine=embedded"], "launch.rollout_engine must be sglang on device=cuda"),
    (["rollout.server_urls=[http://elsewhere:30000]"], "rollout.server_urls="),
    (["launch.trainer_gpus_per_node=8"], "launch.trainer_gpus_per_node: every device runs"),
    (["launch.model_config=examples/models/missing.json"], "launch.model_config"),
    (["launch.sglang_args=[--tp-size, '2']"], "launch.sglang_args must be free of the flags"),
    (["launch.num_nodes=2", "launch.launcher=mpirun", "launch.hosts=[a]"], "launch.hosts"),
    (
        [
            "launch.num_nodes=2",
            "launch.launcher=mpirun",
            "launch.hosts=[a,b]",
            "launch.master_port=0",
        ],
        "launch.master_port must be a fixed port for mpirun on several nodes",
    ),
]


@pytest.mark.parametrize("overrides,field", WRONG, ids=[w[1][:40] for w in WRONG])
def test_wrong_config_fails_naming_the_field(overrides, field, capsys):
    assert main(["launch", "--config", str(RECIPE), "--dry-run", *overrides]) == 1
    err = capsys.readouterr().err
    assert field in err, err


def test_sequence_parallel_off_with_moe_and_tp_is_an_error():
    errors = layout_errors(QWEN3_30B, world=4, tp=4, pp=1, ep=4, etp=1, sp=False)
    assert errors == [
        "parallel.sequence_parallel=False with MoE and parallel.tensor_model_parallel_size=4: "
        "megatron-core requires sequence parallelism for MoE with TP > 1"
    ]
    assert layout_errors(QWEN3_30B, world=4, tp=4, pp=1, ep=4, etp=1, sp=True) == []


# -- renderers --------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "mpirun"])
def test_rendered_scripts_are_valid_bash_with_the_plan(launcher, tmp_path):
    cfg = load_config(RECIPE, [f"launch.launcher={launcher}", f"run_dir={tmp_path / 'run'}"])
    prepared = prepare_launch(cfg)
    text = prepared.script_path.read_text()
    subprocess.run(["bash", "-n", str(prepared.script_path)], check=True)
    assert "-m sglang.launch_server --model-path checkpoints/Qwen3-30B-A3B-Base" in text
    assert "--tp-size 4 --enable-return-routed-experts --weight-version 0" in text
    # SGLang 0.5.23 honours a request's sampling_seed only with deterministic inference on.
    servers = [line for line in text.splitlines() if "-m sglang.launch_server" in line]
    assert servers and all(
        "--weight-version 0 --enable-deterministic-inference --random-seed" in line
        for line in servers
    )
    assert "--mem-fraction-static 0.8" in text
    assert f"--config {prepared.config_path}" in text
    assert "pkill" not in text and "killall" not in text
    if launcher == "torchrun":
        assert "CUDA_VISIBLE_DEVICES=4,5,6,7 " in text and "CUDA_VISIBLE_DEVICES=0,1,2,3 " in text
        assert "MASTER_PORT=29500\n" in text
        assert '--nproc-per-node=4 --master-addr=127.0.0.1 --master-port="$MASTER_PORT"' in text
    if launcher == "slurm":
        assert "#SBATCH --nodes=1" in text and "#SBATCH --gres=gpu:8" in text
        assert (
            '--nodelist="${NODES[0]}" --output="$LOG_DIR/server_0_%N.log" '
            'env CUDA_VISIBLE_DEVICES=4,5,6,7 "$SGLANG_PY" -m sglang.launch_server' in text
        )
        assert "export CUDA_VISIBLE_DEVICES=0,1,2,3; exec" in text
        assert '--node-rank="$SLURM_PROCID" --nproc-per-node=4' in text
        assert '--output="$LOG_DIR/trainer_%N.log"' in text
    if launcher == "mpirun":
        assert "-np 4 --host" in text and '-x MASTER_PORT="$MASTER_PORT"' in text
        assert "MASTER_PORT=29500\n" in text
    # The resolved config loads back to the same config.
    assert load_config(prepared.config_path).to_dict() == cfg.to_dict()


def test_sbatch_for_many_nodes_places_servers_on_rollout_nodes(tmp_path):
    cfg = load_config(
        RECIPE,
        [
            "launch.launcher=slurm",
            "launch.num_nodes=3",
            "launch.trainer_nodes=2",
            "launch.trainer_gpus_per_node=8",
            "launch.rollout_server_tp=2",
            f"run_dir={tmp_path / 'run'}",
            "rollout.prompts_per_step=128",
        ],
    )
    plan = resolve_plan(cfg)
    assert (plan.world_size, plan.dp) == (16, 4)
    assert [(s.node, s.devices, s.port) for s in plan.servers] == [
        (2, (0, 1), 30000),
        (2, (2, 3), 30001),
        (2, (4, 5), 30002),
        (2, (6, 7), 30003),
    ]
    assert plan.sync_world_size == 9
    text = prepare_launch(cfg).script_path.read_text()
    assert "#SBATCH --nodes=3" in text
    for devices in ("0,1", "2,3", "4,5", "6,7"):
        assert f"env CUDA_VISIBLE_DEVICES={devices} " in text
    assert text.count('--nodelist="${NODES[2]}"') == 4
    assert "export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7; exec" in text
    assert '--nnodes=2 --node-rank="$SLURM_PROCID" --nproc-per-node=8' in text
    assert 'TRAINER_NODELIST="$(IFS=,; echo "${NODES[*]:0:2}")"' in text


# -- rank discovery ---------------------------------------------------------------------------
def test_openmpi_variables_map_to_torch_env():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }
    assert resolve_rank_env(env) == "openmpi"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "4",
        "1",
        "2",
    )


def test_torchrun_variables_win_and_partial_or_missing_ones_fail():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMPI_COMM_WORLD_RANK": "0"}
    with pytest.raises(ValueError, match="stale variables"):
        resolve_rank_env(dict(env))
    env["TORCHELASTIC_RUN_ID"] = "job"  # torchrun started by mpirun: its variables win
    assert resolve_rank_env(env) == "torchrun" and env["RANK"] == "1"
    with pytest.raises(ValueError, match="not \\['LOCAL_RANK'\\]"):
        resolve_rank_env({"RANK": "0", "WORLD_SIZE": "1"})
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_LOCAL_RANK is not"):
        resolve_rank_env(dict(mpi))
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        resolve_rank_env(dict(mpi, OMPI_COMM_WORLD_LOCAL_RANK="0"))
    assert resolve_rank_env({}) == "single"


# -- evaluation metrics -----------------------------------------------------------------------
def test_pass_at_k_closed_form():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 1, 16) == 1.0
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)
    assert pass_at_k(16, 2, 8) == pytest.approx(1 - math.comb(14, 8) / math.comb(16, 8))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_eval_metrics_by_hand():
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    m = eval_metrics(rewards, (1, 2, 4))
    assert m["avg_at_4"] == pytest.approx((0.25 + 1 + 0) / 3)
    per = [0.25, 1.0, 0.0]
    mean = sum(per) / 3
    assert m["avg_at_4_stderr"] == pytest.approx(
        math.sqrt(sum((p - mean) ** 2 for p in per) / 3 / 3)
    )
    assert m["pass_at_1"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert m["pass_at_2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["pass_at_4"] == pytest.approx(2 / 3)
    assert EvalOptions("x.jsonl", num_samples=16).ks == (1, 2, 4, 8, 16)
    assert EvalOptions("x.jsonl", num_samples=6).ks == (1, 2, 4, 6)
    with pytest.raises(ValueError, match="--pass-k"):
        EvalOptions("x.jsonl", num_samples=4, pass_ks=(8,))


@pytest.mark.slow
def test_eval_command_writes_jsonl_and_tensorboard(tiny_checkpoint, tmp_path):
    rows = [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6)]]
    data = tmp_path / "aime_like.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    argv = ["eval", "--data", str(data), "--prompt-key", "problem", "--label-key", "answer"]
    argv += ["--num-samples", "4", "--step", "7", "--max-new-tokens", "4"]
    argv += [f"init_checkpoint={tiny_checkpoint}", f"run_dir={run_dir}"]
    assert main(argv) == 0
    per_problem = [json.loads(x) for x in (run_dir / "eval/aime_like_step7.jsonl").open()]
    assert [r["label"] for r in per_problem] == ["3", "7", "11"]
    assert all(len(r["rewards"]) == 4 and r["weight_versions"] == [7] for r in per_problem)
    result = json.loads((run_dir / "eval/results.jsonl").read_text().splitlines()[-1])
    rewards = [r["rewards"] for r in per_problem]
    assert result["metrics"] == pytest.approx(eval_metrics(rewards, (1, 2, 4)))
    assert result["sampling"] == {
        "num_samples": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 4,
    }
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = events.Scalars("eval_aime_like/avg_at_4")
    assert [(e.step, round(e.value, 6)) for e in scalars] == [
        (7, round(result["metrics"]["avg_at_4"], 6))
    ]


def test_config_yaml_of_recipe_is_the_committed_one():
    # The recipe file parses as plain YAML with the sections RunConfig knows.
    tree = yaml.safe_load(RECIPE.read_text())
    assert set(tree) == {
        "init_checkpoint",
        "run_dir",
        "data",
        "rollout",
        "train",
        "objective",
        "parallel",
        "launch",
    }


def test_gpu_check_script_skips_with_a_message_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: run tests/gpu/check_gpu.py itself")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/gpu/check_gpu.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("SKIP: no CUDA device")


def test_convert_subcommand_reaches_the_converter(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])
    assert exit_info.value.code == 0
    assert "hf-to-mcore" in capsys.readouterr().out


def test_launch_subcommand_prints_the_script_path(tmp_path, capsys):
    argv = ["launch", "--config", str(RECIPE), "--launcher", "slurm", f"run_dir={tmp_path}"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "launch" / "job.sbatch")
    assert f"run it with: sbatch {tmp_path / 'launch' / 'job.sbatch'}" in err
    assert (tmp_path / "logs").is_dir()  # sbatch --output needs the directory at submit time


def test_weight_sync_options_follow_the_launch_section():
    from megatron_sat.weight_sync.options import weight_sync_options

    cfg = load_config(RECIPE)
    opts = weight_sync_options(cfg.launch, 1, {"MASTER_ADDR": "node017"})
    assert opts == {"master_address": "node017", "backend": "nccl", "ranks_per_server": [4]}
    cpu = load_config(ROOT / "examples/configs/tiny_cpu_launch.yaml").launch
    assert weight_sync_options(cpu, 2, {}) == {
        "master_address": "127.0.0.1",
        "backend": "gloo",
        "ranks_per_server": [1, 1],
    }


RENDERED = ROOT / "examples/rendered"


def _render_recipe(launcher: str) -> str:
    from megatron_sat.launch.render import RenderContext, render

    cfg = load_config(RECIPE, [f"launch.launcher={launcher}", "launch.hosts=[node0]"])
    ctx = RenderContext(
        config_path="runs/qwen3_30b_a3b_sat_gspo_r3/launch/config.yaml",
        model_path=cfg.init_checkpoint,
        workdir="/path/to/megatron-sat",
        python=".venv/bin/python",
        log_dir="/path/to/megatron-sat/runs/qwen3_30b_a3b_sat_gspo_r3/logs",
        seed=cfg.train.seed,
        max_running_requests=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        sglang_python="/path/to/megatron-sat/.cache/sglang-env/bin/python",
    )
    return render(resolve_plan(cfg), ctx)


@pytest.mark.parametrize(
    "launcher,name", [("torchrun", "torchrun.sh"), ("slurm", "job.sbatch"), ("mpirun", "mpirun.sh")]
)
def test_rendered_examples_are_current(launcher, name):
    """examples/rendered/ holds the paper recipe's scripts as `megatron-sat launch` renders them
    (placeholder paths); regenerate with REGENERATE_RENDERED=1 pytest -k rendered_examples."""
    import os

    text = _render_recipe(launcher)
    if os.environ.get("REGENERATE_RENDERED"):
        (RENDERED / name).write_text(text)
    assert (RENDERED / name).read_text() == text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--config", str(RECIPE), "rollout.lag=-1"], "rollout.lag must be >= 0, got -1"),
        (["train", "--config", str(RECIPE), "rollout.nope=1"], "['rollout.nope']"),
        (["train", "--config", "missing.yaml"], "missing.yaml"),
        (["eval", "--config", str(RECIPE), "train.lr=abc"], "train.lr"),
    ],
)
def test_cli_config_errors_exit_2_naming_the_field(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"megatron-sat {argv[0]}: config error:" in err and message in err
    assert "Traceback" not in err
