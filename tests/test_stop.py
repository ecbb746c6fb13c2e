"""The preemption-safe stop (``training.stop``): the first SIGTERM / SIGUSR1 / SIGINT asks for
a stop, the second ends the process by that signal; a whole run stopped by SIGTERM saves,
exits 0, and its resume ends with the uninterrupted run's metrics."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import make_tiny_checkpoint

from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.training.stop import StopRequest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_first_signal_asks_for_a_stop_and_handlers_come_back(sig, capsys):
    before = signal.getsignal(sig)
    stop = StopRequest()
    with stop.installed():
        assert not stop.requested
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # Python runs the handler at the next bytecode of the main thread
        assert stop.signal_name == sig.name
    assert signal.getsignal(sig) is before
    assert f"megatron-sat: {sig.name}: finishing the current step" in capsys.readouterr().err


SECOND = """
import os, signal, time
from megatron_sat.training.stop import StopRequest
stop = StopRequest()
with stop.installed():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    print("first:", stop.signal_name, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("survived", flush=True)
"""


def test_second_signal_ends_the_process_by_that_signal():
    proc = subprocess.run(
        [sys.executable, "-c", SECOND], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGINT
    assert proc.stdout == "first: SIGTERM\n"
    assert "second signal (SIGINT): stopping now" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctrl_c_before_the_run_is_one_line():
    """Ctrl-C while the CLI starts (before the run's handler): one line, status 130."""
    code = textwrap.dedent(
        """
        import sys
        from megatron_sat import cli
        def interrupted(args):
            raise KeyboardInterrupt
        cli._plot = interrupted
        sys.exit(cli.main(["plot", "x"]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 130
    assert proc.stderr == "megatron-sat plot: interrupted (Ctrl-C)\n"


NUM_STEPS = 8
TIMING = ("time/", "per_s", "utilisation", "/requests")


def _cmd(run_dir: Path, data: Path, checkpoint: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron_sat.cli", "train",
        f"init_checkpoint={checkpoint}", f"run_dir={run_dir}",
        f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
        "data.num_eval_prompts=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.eval_samples_per_prompt=2", "train.seed=5",
        f"train.num_steps={NUM_STEPS}", "train.save_every=100", "train.eval_every=4",
        "train.micro_batch_size=16", *extra,
    ]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
@pytest.mark.parametrize("mode", ["sync", "fixed_lag"])
def test_sigterm_mid_run_saves_exits_0_and_resumes_to_the_same_metrics(tmp_path, mode):
    """SIGTERM once step 2 is logged (train.save_every=100: no save would be due): the step
    in flight finishes, a run checkpoint of it is written, the process exits 0 naming the
    resume; ``train.resume=true`` then ends with every non-timing metric of the uninterrupted
    run, and the HF checkpoint and summary only exist after the resumed run."""
    checkpoint = make_tiny_checkpoint(tmp_path / "init", seed=2)
    data = tmp_path / "data"
    data.mkdir()
    train, test = make_arith_splits(16, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    mode_args = {"sync": ["rollout.mode=sync"], "fixed_lag": ["rollout.mode=fixed_lag"]}[mode]
    straight = subprocess.run(
        _cmd(tmp_path / "a", data, checkpoint, *mode_args), env=env, capture_output=True, text=True
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    run_b = tmp_path / "b"
    proc = subprocess.Popen(
        _cmd(run_b, data, checkpoint, "train.resume=true", *mode_args),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600
    while _logged_steps(run_b) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # line 0 is the initial evaluation: 3 lines = step 2 logged
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    stopped = _logged_steps(run_b) - 1
    assert 2 <= stopped < NUM_STEPS, err[-3000:]
    assert f"stopped by SIGTERM after step {stopped}" in err
    assert "train.resume=true" in err and "Traceback" not in err
    assert (run_b / "checkpoints" / f"step_{stopped:08d}").is_dir()
    assert not (run_b / "summary.json").exists()
    assert not (run_b / "checkpoint").exists()

    resumed = subprocess.run(
        _cmd(run_b, data, checkpoint, "train.resume=true", *mode_args),
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(run_b) == _metrics(tmp_path / "a")
    assert (run_b / "summary.json").exists()


def test_sbatch_stop_forward_passes_sigusr1_to_the_trainer_and_keeps_its_status(tmp_path):
    """The rendered sbatch script's tail (``launch.render._STOP_FORWARD``) with a stand-in
    trainer: SIGUSR1 to the batch shell reaches the trainer, the shell waits for it to finish
    and exits with its status, not the signal's."""
    from megatron_sat.launch.render import _STOP_FORWARD

    trainer = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: (print('saving', flush=True), time.sleep(1),"
        " sys.exit(0)))\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
        "sys.exit(3)\n"
    )
    script = "\n".join(
        [
            f"{sys.executable} -c {shlex.quote(trainer)} &",
            *_STOP_FORWARD,
            'echo "status $status"',
        ]
    )
    proc = subprocess.Popen(
        ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert out == "saving\nstatus 0\n"
    assert "SIGUSR1: asking the trainer to save and stop" in err
