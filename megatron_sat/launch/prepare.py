"""``megatron-sat launch``: resolve and validate the plan, write the resolved config and the
launcher's script into the launch directory."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_sat.launch.plan import LaunchPlan, resolve_plan
from megatron_sat.launch.render import RenderContext, render, script_name, write_executable


@dataclass(frozen=True)
class PreparedLaunch:
    """The outcome of :func:`prepare_launch`: the plan, the script and the config it loads."""

    plan: LaunchPlan
    script_path: Path
    config_path: Path


def render_context(cfg, config_path: Path) -> RenderContext:
    """The paths and values a script needs besides the plan, with the launch section's
    defaults resolved (interpreter, working directory, log directory)."""
    la = cfg.launch
    workdir = la.workdir or os.getcwd()
    return RenderContext(
        config_path=str(config_path),
        model_path=cfg.init_checkpoint,
        workdir=workdir,
        python=la.python or sys.executable,
        log_dir=str(Path(workdir) / (la.log_dir or Path(cfg.run_dir) / "logs")),
        seed=cfg.train.seed,
        max_running_requests=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        return_routed_experts=cfg.rollout.return_routed_experts,
        vllm_python=str(
            Path(la.vllm_env or Path(workdir) / ".cache" / "vllm-env") / "bin" / "python"
        ),
        sglang_python=str(
            Path(la.sglang_env or Path(workdir) / ".cache" / "sglang-env") / "bin" / "python"
        ),
    )


def prepare_launch(cfg, out_dir: str | Path | None = None) -> PreparedLaunch:
    """Validate ``cfg`` (a RunConfig), then write ``<out_dir>/config.yaml`` (the config with
    every override applied; fields a rule fills stay null: ``RunConfig.to_dict``) and the
    launcher's script (``torchrun.sh``, ``job.sbatch`` or ``mpirun.sh``), and
    create the log directory.

    Args:
        cfg: the run config.
        out_dir: launch directory; None = ``<run_dir>/launch``.

    Raises:
        ValueError: from :func:`~megatron_sat.launch.plan.resolve_plan`, naming each bad field.
    """
    plan = resolve_plan(cfg)
    out = Path(out_dir or Path(cfg.run_dir) / "launch").absolute()
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    ctx = render_context(cfg, config_path)
    Path(ctx.log_dir).mkdir(parents=True, exist_ok=True)  # sbatch --output needs it at submit
    text = render(plan, ctx)
    script = write_executable(out / script_name(cfg.launch.launcher), text)
    return PreparedLaunch(plan=plan, script_path=script, config_path=config_path)
