"""The launch plan's host memory of a trainer node (``launch.host_memory``), for the paper's
recipe: numbers computed by hand from the recipe's shape."""

from pathlib import Path

import pytest

from megatron_sat.config import load_config
from megatron_sat.launch.memory import GIB
from megatron_sat.launch.plan import format_plan, resolve_plan

RECIPE = Path(__file__).resolve().parents[1] / "examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml"


def test_recipe_node_total_by_hand():
    plan = resolve_plan(load_config(RECIPE))
    param = plan.memory.param_bytes
    optimizer = plan.memory_offload_toggled.optimizer_bytes  # offloaded: what the host holds
    assert optimizer == 6 * param  # fp32 main weights + two Adam moments vs bf16 weights
    # one batch: 256 x 16 samples of 512 prompt + 8,192 response tokens, 48 x 8 uint8 routes
    # plus 80 B of ids, log-probs and versions per token; DP 1: each rank holds all of it
    batch = 256 * 16 * (512 + 8192) * (48 * 8 + 80)
    node = 4 * (optimizer + 2 * param + batch) + batch  # + the pool of one batch (sync mode)
    text = format_plan(plan)
    assert f"host memory of trainer node 0: {node / GIB:.1f} GiB = 4 rank(s)" in text
    assert f"{2 * param / GIB:.1f} reference policy + {batch / GIB:.1f} batch share" in text


def test_reference_on_device_and_no_offload_leave_the_host():
    on_device = format_plan(resolve_plan(load_config(RECIPE, ["train.reference_on_device=true"])))
    assert "offloaded optimizer + 0.0 reference policy" in on_device
    big_gpu = ["train.optimizer_cpu_offload=false", "launch.gpu_memory_gib=1000"]
    assert "(0.0 offloaded optimizer" in format_plan(resolve_plan(load_config(RECIPE, big_gpu)))


def test_a_node_too_small_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"launch.host_memory_gib=256: trainer node 0 needs 5\d\d"):
        resolve_plan(load_config(RECIPE, ["launch.host_memory_gib=256"]))
    assert resolve_plan(load_config(RECIPE, ["launch.host_memory_gib=2048"]))
    with pytest.raises(ValueError, match="host_memory_gib"):
        load_config(RECIPE, ["launch.host_memory_gib=0"])


def _host_error(overrides):
    with pytest.raises(ValueError, match="launch.host_memory_gib=256") as err:
        resolve_plan(load_config(RECIPE, ["launch.host_memory_gib=256", *overrides]))
    return str(err.value).split("fixes: ")[1]


def test_the_host_memory_error_suggests_only_the_fixes_that_apply():
    # the recipe: sync mode, offloaded optimizer, the reference policy in host memory
    param = resolve_plan(load_config(RECIPE)).memory.param_bytes
    fixes = _host_error([])
    assert f"train.reference_on_device=true (-{4 * 2 * param / GIB:.1f} GiB" in fixes
    assert f"train.optimizer_cpu_offload=false (-{4 * 6 * param / GIB:.1f} GiB" in fixes
    assert "only where the device has room for the optimizer state" in fixes
    assert "rollout.lag" not in fixes  # sync mode's pool holds one batch whatever the lag
    assert "fewer trainer ranks per node (launch.trainer_gpus_per_node" in fixes
    lagged = _host_error(["rollout.mode=fixed_lag", "rollout.lag=2"])
    assert "a lower rollout.lag (the pool holds lag + 1 = 3 batches" in lagged
    assert "rollout.lag" not in _host_error(["rollout.mode=fixed_lag", "rollout.lag=0"])
    assert "reference_on_device" not in _host_error(["train.reference_on_device=true"])
    assert "reference_on_device" not in _host_error(["objective.kl_coef=0"])
    no_offload = ["train.optimizer_cpu_offload=false", "launch.gpu_memory_gib=1000"]
    assert "optimizer_cpu_offload" not in _host_error([*no_offload, "rollout.group_size=64"])
