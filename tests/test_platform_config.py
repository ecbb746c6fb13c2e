"""CPU shims (and the upstream signatures they rely on), and the typed run config."""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_sat.config import RunConfig, load_config
from megatron_sat.platform import apply_cpu_shims


def test_shims_target_the_measured_upstream_signatures():
    # When megatron-core moves one of these, the shims must be revisited: fail loudly here.
    import megatron.core
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, router_replay

    assert megatron.core.__version__.startswith("0.19.")
    assert apply_cpu_shims() is (not torch.cuda.is_available())
    params = inspect.signature(moe_utils.maybe_move_tensor_to_cpu).parameters
    assert list(params) == ["tensor", "as_numpy", "record_stream"]
    assert {"add", "fork"} <= set(vars(tp_random.CudaRNGStatesTracker))
    replay_params = inspect.signature(router_replay.RouterReplay.get_replay_topk).parameters
    assert list(replay_params)[:3] == ["self", "scores", "topk"]


def test_cpu_shims_fix_the_failures_they_name(megatron_world):
    if torch.cuda.is_available():
        pytest.skip("shims apply only without CUDA")
    apply_cpu_shims()
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.equal(
        get_default_causal_mask(3),
        torch.tensor([[False, True, True], [False, False, True], [False, False, False]]),
    )
    # clip_grads' literal device="cuda" tensors and its type assert now work on the CPU.
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    norm = clip_grads.get_grad_norm_fp32([p.grad])
    assert norm == pytest.approx(6.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=3.0, total_norm=norm)
    assert torch.allclose(p.grad, torch.full((4,), 1.5), atol=1e-5)


def test_config_yaml_overrides_and_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  group_size: 4\nobjective:\n  name: gspo\n")
    cfg = load_config(path, ["train.lr=3e-4", "objective.eps_high=4e-4", "train.use_r3=false"])
    assert (cfg.rollout.group_size, cfg.objective.name, cfg.train.lr) == (4, "gspo", 3e-4)
    assert (cfg.objective.eps_high, cfg.train.use_r3) == (4e-4, False)
    assert cfg.rollout.prompts_per_step == RunConfig().rollout.prompts_per_step
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['rollout.groupsize'\]"):
        load_config(None, ["rollout.groupsize=4"])
    with pytest.raises(ValueError, match="rollout.group_size must be >= 2"):
        load_config(None, ["rollout.group_size=1"])
    with pytest.raises(ValueError, match="config field train.num_steps must be int"):
        load_config(None, ["train.num_steps=ten"])
    with pytest.raises(ValueError, match="name"):
        load_config(None, ["objective.name=ppo2"])
    with pytest.raises(ValueError, match="train.lr must be a finite float, got 'nan'"):
        load_config(None, ["train.lr=nan"])
    with pytest.raises(ValueError, match="not of the form"):
        load_config(None, ["train.lr"])
    # a bare string for a list would be split into characters (URLs, SGLang flags)
    with pytest.raises(ValueError, match=r"rollout.server_urls must be a list .* 'http://h:1'"):
        load_config(None, ["rollout.server_urls=http://h:1"])
    with pytest.raises(ValueError, match="launch.sglang_args must be a list"):
        load_config(None, ["launch.sglang_args=--enable-ep-moe"])
    assert load_config(None, ["rollout.server_urls=[http://h:1]"]).rollout.server_urls == [
        "http://h:1"
    ]
    with pytest.raises(ValueError, match="config section rollout must be a mapping"):
        load_config(None, ["rollout=3"])
    assert load_config(None, ["parallel=null"]).parallel == RunConfig().parallel
    # null only where a field takes None: an empty `use_r3:` in YAML read as False before.
    with pytest.raises(ValueError, match="config field train.use_r3 must be bool, got null"):
        load_config(None, ["train.use_r3=null"])
    with pytest.raises(ValueError, match="config field train.num_steps must be int, got null"):
        load_config(None, ["train.num_steps=null"])
    with pytest.raises(ValueError, match="train.routing_diagnostic_interval must be int, got inf"):
        load_config(None, ["train.routing_diagnostic_interval=.inf"])
    assert load_config(None, ["train.params_dtype=null"]).train.params_dtype is None
    path.write_text("rollout: null\n")
    assert load_config(path, ["rollout.group_size=4"]).rollout.group_size == 4
    with pytest.raises(ValueError, match=r"launch.sglang_args must be a list of strings"):
        load_config(None, ["launch.sglang_args=[--tp, 2]"])
    with pytest.raises(ValueError, match="rollout.top_p must be in"):
        load_config(None, ["rollout.top_p=0"])
    with pytest.raises(ValueError, match="rollout.top_k must be -1"):
        load_config(None, ["rollout.top_k=0"])
    with pytest.raises(ValueError, match="recomputed_old' with rollout rollout.mode=bounded"):
        load_config(None, ["rollout.mode=bounded", "objective.ratio_denominator=recomputed_old"])
