"""The launch scripts for real on this machine: the small CPU job (tiny Qwen3-MoE, 2 RL steps)
through sbatch under a single-node SLURM (munge + slurmctld + slurmd from Debian's packages,
installed and started here when missing) and through Open MPI's mpirun. Each test renders the
job with the example wrapper script, runs it to completion and checks the run's outputs and
per-node logs. Skipped only where the packages are missing and apt-get is unavailable."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sat.rollout.arith import make_arith_splits

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/configs/tiny_cpu_launch.yaml"
# Trainer ranks of the small job (data parallel 2).
TRAINER_RANKS = 2

pytestmark = pytest.mark.slow

# The caller's environment as a process that ran torch.distributed leaves it (the test session
# itself does, through init_distributed): the scripts must not let it decide the ranks.
STALE_RANK_ENV = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job_overrides(tiny_checkpoint, tmp_path_factory):
    """Overrides that point the tiny CPU launch config at a tiny checkpoint and data."""
    data = tmp_path_factory.mktemp("launch_data")
    train, test = make_arith_splits(200, 20, seed=0, max_digits=2)
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def overrides(run_dir: Path) -> list[str]:
        return [
            f"init_checkpoint={tiny_checkpoint}",
            f"run_dir={run_dir}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}",
            f"launch.trainer_gpus_per_node={TRAINER_RANKS}",
            f"launch.gpus_per_node={TRAINER_RANKS + 1}",
            "launch.master_port=0",  # found free by the script itself, just before use
            f"launch.rollout_base_port={_free_port()}",
        ]

    return overrides


def _apt_install(*packages: str) -> None:
    if shutil.which("apt-get") is None:
        pytest.skip(f"{packages} missing and apt-get unavailable")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
        check=True,
        env=env,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    """A running single-node SLURM; yields its SLURM_CONF and stops the daemons it started."""
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        ["bash", "examples/local_cluster/slurm_up.sh", str(state), "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if up.returncode == 3:
        pytest.skip("SLURM packages missing and apt-get unavailable")
    assert up.returncode == 0, up.stderr[-3000:]
    yield str(state / "slurm.conf")
    subprocess.run(["bash", "examples/local_cluster/slurm_down.sh", str(state)], cwd=ROOT)


def _check_run(run_dir: Path, output: str) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == 2 and summary["objective"] == "sat-gspo", output
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/staleness_max"] == 0 for r in rows[1:])  # lag 1: on-policy batches
    assert (run_dir / "checkpoint" / "config.json").is_file()


def _logs(run_dir: Path) -> str:
    logs = sorted((run_dir / "logs").rglob("*")) if (run_dir / "logs").exists() else []
    return "\n".join(
        f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file()
    )


def test_sbatch_script_runs_the_small_cpu_job(slurm_conf, job_overrides, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(STALE_RANK_ENV, SLURM_CONF=slurm_conf, SBATCH_WAIT="1", PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "examples/launch_slurm.sh", CONFIG, *job_overrides(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = proc.stdout + proc.stderr + _logs(run_dir)
    assert proc.returncode == 0, output
    _check_run(run_dir, output)
    host = subprocess.run(
        ["scontrol", "show", "hostnames"], env=env, capture_output=True, text=True
    ).stdout
    host = socket.gethostname().split(".")[0] if not host.strip() else host.split()[0]
    logs = run_dir / "logs"
    trainer_log = (logs / f"trainer_{host}.log").read_text()
    for rank in range(TRAINER_RANKS):
        assert f"rank {rank} of {TRAINER_RANKS} (from torchrun)" in trainer_log, output
    assert (logs / f"server_0_{host}.log").read_text().count("loaded") >= 1, output
    (sbatch_log,) = logs.glob("sbatch_*.log")
    text = sbatch_log.read_text()
    assert "rollout server http://" in text and "trainer exited with status 0" in text


def test_mpirun_script_runs_the_small_cpu_job(job_overrides, tmp_path):
    if shutil.which("mpirun") is None:
        _apt_install("openmpi-bin")
    run_dir = tmp_path / "run"
    env = dict(STALE_RANK_ENV, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "examples/launch_mpirun.sh", CONFIG, *job_overrides(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = proc.stdout + proc.stderr + _logs(run_dir)
    assert proc.returncode == 0, output
    _check_run(run_dir, output)
    for rank in range(TRAINER_RANKS):
        stderr = (run_dir / f"logs/trainer/1/rank.{rank}/stderr").read_text()
        assert f"rank {rank} of {TRAINER_RANKS} (from openmpi)" in stderr, output
    assert "trainer exited with status 0" in proc.stderr
