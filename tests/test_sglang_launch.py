"""SGLang servers in a launch: their own environment (``launch.sglang_env``) in every rendered
script, and the flags ``launch.sglang_args`` may not carry, with SGLang 0.5.23's own argument
declarations as the truth (``tests/sglang_reference.py`` ``cli_flags``: every spelling its
parser registers, ``srt/arg_groups/fields/*.py`` read as ``arg_groups/arg_utils.py``
``add_cli_args_from_dataclass`` registers them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import sglang_reference as ref

from megatron_sat.config import load_config
from megatron_sat.config.launch import SGLANG_SERVER_FLAGS, SGLANG_SIZE_FLAGS, LaunchConfig
from megatron_sat.launch.prepare import prepare_launch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "configs" / "qwen3_30b_a3b_sat_gspo_r3.yaml"
# The ServerArgs fields the launcher sets (rollout/sglang/args.py launch_args, --config for keys;
# the keys themselves are the launcher's).
LAUNCHER_FIELDS = (
    "model_path",
    "host",
    "port",
    "tp_size",
    "weight_version",
    "enable_return_routed_experts",
    "enable_deterministic_inference",
    "random_seed",
    "config",
    "api_key",
    "admin_api_key",
)

LAUNCHERS = {
    "torchrun": [],
    "slurm": ["launch.num_nodes=2", "launch.gpus_per_node=8"],
    "mpirun": ["launch.num_nodes=2", "launch.hosts=[n1,n2]", "launch.gpus_per_node=8"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_rendered_sglang_servers_start_from_the_sglang_env(launcher, tmp_path):
    cfg = load_config(
        RECIPE,
        [
            f"launch.launcher={launcher}",
            *LAUNCHERS[launcher],
            "launch.sglang_env=/opt/sglang-0.5.23",
            f"run_dir={tmp_path / 'run'}",
            f"launch.workdir={tmp_path}",
        ],
    )
    script = prepare_launch(cfg, tmp_path / "launch").script_path
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "SGLANG_PY=/opt/sglang-0.5.23/bin/python\n" in text
    assert '[[ -x "$SGLANG_PY" ]] ||' in text  # a missing environment stops the script
    servers = [line for line in text.splitlines() if "-m sglang.launch_server" in line]
    assert len(servers) == len(resolve(cfg).servers) >= 1
    for line in servers:
        assert '"$SGLANG_PY" -m sglang.launch_server' in line
        assert '"$PY" -m sglang' not in line
    # The trainer keeps its own interpreter.
    trainer = [line for line in text.splitlines() if "megatron_sat.cli train" in line]
    assert trainer and all("SGLANG_PY" not in line for line in trainer)


def resolve(cfg):
    from megatron_sat.launch.plan import resolve_plan

    return resolve_plan(cfg)


def test_the_default_sglang_env_is_under_the_workdir(tmp_path):
    cfg = load_config(RECIPE, [f"run_dir={tmp_path / 'run'}", f"launch.workdir={tmp_path}"])
    text = prepare_launch(cfg, tmp_path / "launch").script_path.read_text()
    assert f"SGLANG_PY={tmp_path}/.cache/sglang-env/bin/python\n" in text


def test_reserved_flags_are_every_spelling_of_the_launchers_fields():
    flags = ref.cli_flags()
    want = {spelling for name in LAUNCHER_FIELDS for spelling in flags[name]}
    assert set(SGLANG_SERVER_FLAGS) == want
    assert "--tensor-parallel-size" in want and "--model" in want
    assert {s for names in SGLANG_SIZE_FLAGS for s in names} == {
        *flags["dp_size"],
        *flags["pp_size"],
    }
    # `--tp` is no flag of SGLang's; its parser (abbreviations allowed) reads it as --tp-size.
    every = {s for spellings in flags.values() for s in spellings}
    assert "--tp" not in every
    assert [f for f in every if f.startswith("--tp")] == ["--tp-size"]
    # No real flag is a prefix of a reserved one, so the prefix rule refuses no real flag.
    free = every - set(SGLANG_SERVER_FLAGS) - {s for names in SGLANG_SIZE_FLAGS for s in names}
    assert not [(f, r) for f in free for r in SGLANG_SERVER_FLAGS if r.startswith(f)]


@pytest.mark.parametrize(
    "args",
    [
        ["--tensor-parallel-size", "8"],
        ["--tp-size=8"],
        ["--tp", "8"],
        ["--model", "/other"],
        ["--random-seed", "3"],
        ["--api-key", "k"],
        ["--config", "x.yaml"],
    ],
)
def test_sglang_args_may_not_repeat_a_launcher_flag_in_any_spelling(args):
    with pytest.raises(ValueError, match=r"launch.sglang_args must be free of the flags"):
        LaunchConfig(sglang_args=args)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--dp-size", "2"], "refuses weight updates from distributed with data-parallel"),
        (["--data-parallel-size=4"], "refuses weight updates from distributed with data-parallel"),
        (["--pp-size", "2"], "rank_offset \\+ tp_rank on every pipeline stage"),
        (["--pipeline-parallel-size", "2"], "rank_offset \\+ tp_rank on every pipeline stage"),
    ],
)
def test_data_and_pipeline_parallel_servers_are_refused_with_the_reason(args, why):
    with pytest.raises(ValueError, match=why):
        LaunchConfig(sglang_args=args)


def test_other_flags_and_sizes_of_one_pass():
    args = [
        "--dp-size",
        "1",
        "--pp-size=1",
        "--mem-fraction-static",
        "0.8",
        "--pp-max-micro-batch-size",
        "4",
    ]
    assert LaunchConfig(sglang_args=args).sglang_args == args
