"""Runs that survive crashes: the run checkpoint's commit protocol at every crash point, files
with the user's umask, children that die with a SIGKILLed parent, and a wrong layout or an
over-long prompt refused by ``train`` (and its ``--dry-run``) before anything is built."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_checkpoint
from test_checkpoint_resume import train_step

from megatron_sat.checkpoint import run_state
from megatron_sat.checkpoint.hf_io import current_umask, write_hf_checkpoint
from megatron_sat.checkpoint.run_state import (
    COMMIT_PHASES,
    latest_run_checkpoint,
    load_run_checkpoint,
    save_run_checkpoint,
    set_commit_hook,
)
from megatron_sat.config import TrainConfig
from megatron_sat.launch.plan import check_train_layout
from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.training.distributed import ParallelConfig
from megatron_sat.training.trainer import PolicyTrainer


class _Crash(Exception):
    """Stands for the SIGKILL the launch layer's hook sends: the disk state is the same (the
    hook runs after the phase's files and fsyncs), the test process survives to look."""


@pytest.fixture
def trainer(megatron_world, tiny_checkpoint, tiny_hf_config) -> PolicyTrainer:
    cfg = TrainConfig(lr=1e-3, micro_batch_size=4, seed=3)
    trainer = PolicyTrainer(
        tiny_hf_config, cfg, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
    )
    train_step(trainer, 1, tiny_hf_config["vocab_size"])  # Adam state to checkpoint
    return trainer


def _save(trainer: PolicyTrainer, run_dir: Path, step: int) -> Path:
    return save_run_checkpoint(
        run_dir, model=trainer.model, optimizer=trainer.optimizer, step=step, weight_version=step
    )


@pytest.mark.parametrize("phase", COMMIT_PHASES)
def test_crash_between_commit_steps_is_used_or_ignored(trainer, tmp_path, phase, capsys):
    _save(trainer, tmp_path, 5)

    def crash(at: str, step: int) -> None:
        if at == phase and step == 10:
            raise _Crash(at)

    set_commit_hook(crash)
    try:
        with pytest.raises(_Crash):
            _save(trainer, tmp_path, 10)
    finally:
        set_commit_hook(None)
    root = tmp_path / "checkpoints"
    left = sorted(p.name for p in root.glob("step_*"))
    committed = phase == "committed"
    expected_left = {
        "written": ["step_00000005", "step_00000010.tmp"],
        "renamed": ["step_00000005", "step_00000010"],  # the window of the old FileExistsError
        "committed": ["step_00000005", "step_00000010"],
    }[phase]
    assert left == expected_left
    assert latest_run_checkpoint(tmp_path).name == (
        "step_00000010" if committed else "step_00000005"
    )

    # The resumed run: the uncommitted folder is removed with a log line and never used ...
    state = load_run_checkpoint(tmp_path, model=trainer.model, optimizer=trainer.optimizer)
    assert state.step == (10 if committed else 5)
    assert state.weight_version == state.step
    out = capsys.readouterr().out
    assert ("removing uncommitted" in out) != committed
    assert sorted(p.name for p in root.glob("step_*")) == (
        ["step_00000005", "step_00000010"] if committed else ["step_00000005"]
    )
    # ... and it checkpoints step 10 again (it did raise FileExistsError after "renamed").
    if not committed:
        assert _save(trainer, tmp_path, 10).name == "step_00000010"
        assert latest_run_checkpoint(tmp_path).name == "step_00000010"
    with pytest.raises(FileExistsError, match="step_00000010"):
        _save(trainer, tmp_path, 10)  # a committed checkpoint is never overwritten


def test_crash_before_the_first_commit_leaves_nothing_to_resume(trainer, tmp_path):
    def crash(at: str, step: int) -> None:
        raise _Crash(at)

    set_commit_hook(crash)
    try:
        with pytest.raises(_Crash):
            _save(trainer, tmp_path, 5)
    finally:
        set_commit_hook(None)
    assert latest_run_checkpoint(tmp_path) is None
    assert run_state.clean_uncommitted(tmp_path) == [tmp_path / "checkpoints/step_00000005.tmp"]
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_checkpoint_files_follow_the_umask(tmp_path, tiny_hf_config, umask):
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        out = write_hf_checkpoint(
            [("model.embed_tokens.weight", torch.zeros(4, 2))], tiny_hf_config, tmp_path / "hf"
        )
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask  # safetensors alone gives 0600
    assert modes["model.safetensors"] == modes["config.json"]


CHILDREN = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from megatron_sat.platform.lifetime import fork_manager_for_dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert fork_manager_for_dist_checkpointing()
    queue = filesystem_async.get_write_results_queue()  # what the checkpoint writer calls
    worker = mp.get_context("fork").Process(target=time.sleep, args=(600,))
    worker.start()
    kids = [int(p) for p in os.listdir("/proc") if p.isdigit()
            and open(f"/proc/{p}/stat").read().split()[3] == str(os.getpid())]
    print(" ".join(map(str, kids)), flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_sigkilled_parent():
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILDREN], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        kids = [int(p) for p in proc.stdout.readline().split()]
        # The checkpoint writer's results-queue manager, the worker, the resource tracker.
        assert len(kids) >= 2, kids
        assert all(_alive(k) for k in kids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.1)
        assert [k for k in kids if _alive(k)] == []
    finally:
        proc.kill()


SERVER_LIKE = textwrap.dedent(
    """
    import os, subprocess, sys
    from megatron_sat.platform.lifetime import parent_env
    # A child that execs a program and needs {delay} s before it reaches end_with_parent
    # (the embedded server imports torch and loads its model first).
    child = (
        "import time; time.sleep({delay}); "
        "from megatron_sat.platform.lifetime import end_with_parent; "
        "end_with_parent(poll_s=600); print('watching', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], env={{**os.environ, **parent_env()}},
                            start_new_session=True)
    print(proc.pid, flush=True)
    proc.wait()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("delay", [0.0, 3.0])
def test_exec_child_ends_with_a_sigkilled_parent(delay):
    """A server-like child (its own session, another program) ends at once when its parent is
    SIGKILLed before it set the signal (delay 3: killed during its start-up) or after (delay
    0); its poll is 600 s here, so only the signal or the start-up check can end it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_LIKE.format(delay=delay)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(proc.stdout.readline())
        if delay == 0.0:
            time.sleep(2.0)  # it has set the signal by now (imports take < 2 s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + delay + 20
        while time.time() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        proc.kill()


def test_layout_checked_at_the_trainer_world(tiny_hf_config):
    from megatron_sat.config import load_config

    cfg = load_config(None, ["parallel.expert_model_parallel_size=2"])
    seven = dict(tiny_hf_config, num_experts=7)
    with pytest.raises(
        ValueError,
        match=r"parallel.expert_model_parallel_size=2 does not divide "
        r"the model's experts \(7\)",
    ):
        check_train_layout(cfg, 2, seven)
    check_train_layout(cfg, 2, tiny_hf_config)  # 8 experts at EP2 on 2 ranks: fine
    with pytest.raises(ValueError, match="does not divide the 1 trainer ranks"):
        check_train_layout(cfg, 1, tiny_hf_config)


@pytest.fixture(scope="module")
def arith(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("crash_data")
    train, test = make_arith_splits(16, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def _dry_run(
    checkpoint: Path, train: Path, eval_: Path, *extra: str
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    return subprocess.run(
        [
            sys.executable, "-m", "megatron_sat.cli", "train", "--dry-run",
            f"init_checkpoint={checkpoint}", f"data.train_path={train}",
            f"data.eval_path={eval_}", *extra,
        ],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_train_dry_run_refuses_seven_experts_at_ep2(tmp_path, arith):
    seven = make_tiny_checkpoint(tmp_path / "seven", num_experts=7)
    ok = _dry_run(seven, arith / "train.jsonl", arith / "test.jsonl")
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _dry_run(
        seven, arith / "train.jsonl", arith / "test.jsonl", "parallel.expert_model_parallel_size=2"
    )
    assert bad.returncode == 1
    assert "parallel.expert_model_parallel_size=2 does not divide the model's experts (7)" in (
        bad.stderr
    )


def test_train_dry_run_refuses_an_overlong_prompt_naming_the_row(tmp_path, arith, tiny_checkpoint):
    rows = [json.loads(line) for line in (arith / "train.jsonl").read_text().splitlines()]
    rows[3]["prompt"] = "1+" * 70 + "1="  # 142 characters: over the 128-token context
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = _dry_run(tiny_checkpoint, long, arith / "test.jsonl")
    assert bad.returncode == 1
    assert f"{long} row 3:" in bad.stderr
    assert "rollout.max_new_tokens" in bad.stderr and "context length 128" in bad.stderr


# -- seeded sampling and the whole run ---------------------------------------------------------


def test_seeded_requests_ignore_the_engine_state_and_the_batch(tiny_checkpoint):
    from megatron_sat.rollout.client import SamplingParams
    from megatron_sat.rollout.embedded.engine import EngineRequest, GenerationEngine
    from megatron_sat.rollout.seeds import request_seed

    def params(seed):
        return SamplingParams(temperature=1.0, max_new_tokens=12, sampling_seed=seed)

    prompt = [5, 6, 7, 8]
    seed = request_seed(7, 3, 11, 1)
    a = GenerationEngine(str(tiny_checkpoint), seed=0)
    b = GenerationEngine(str(tiny_checkpoint), seed=12345)  # a "restarted" server
    alone = a.generate([EngineRequest(prompt, params(seed))])[0]
    torch.multinomial(torch.ones(9), 3, generator=b.generator)  # another generator state
    batched = b.generate(
        [
            EngineRequest([9, 9], params(None)),
            EngineRequest(prompt, params(seed)),
            EngineRequest([4, 3, 2, 1, 5], params(request_seed(7, 3, 12, 0))),
        ]
    )[1]
    assert batched.output_ids == alone.output_ids
    assert batched.output_token_logprobs == pytest.approx(alone.output_token_logprobs, abs=1e-5)
    # Resuming from the partial output continues the same draws (positions carry on).
    head = alone.output_ids[:5]
    if len(alone.output_ids) > 5:
        rest = a.generate(
            [
                EngineRequest(
                    prompt + head,
                    SamplingParams(temperature=1.0, max_new_tokens=7, sampling_seed=seed),
                )
            ]
        )[0]
        assert head + rest.output_ids == alone.output_ids
    others = [
        a.generate([EngineRequest(prompt, params(request_seed(7, 3, 11, k)))])[0].output_ids
        for k in range(2, 6)
    ]
    assert any(o != alone.output_ids for o in others)  # the seed does decide the draw
    assert request_seed(7, 3, 11, 1) != request_seed(7, 3, 11, 1, "eval")


def _run_cmd(run_dir: Path, data: Path, checkpoint: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron_sat.cli", "train",
        f"init_checkpoint={checkpoint}", f"run_dir={run_dir}",
        f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
        "data.num_eval_prompts=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.eval_samples_per_prompt=2", "train.seed=5",
        "train.num_steps=6", "train.save_every=2", "train.eval_every=3",
        "train.micro_batch_size=16", *extra,
    ]  # fmt: skip


TIMING = ("time/", "per_s", "utilisation")


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid() and _alive(int(pid)):
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "kills"),
    [("sync", ("renamed:2", "committed:4")), ("fixed_lag", ("written:4",))],
)
def test_run_killed_at_commit_points_resumes_bit_identical(tmp_path, arith, mode, kills):
    """SIGKILL between the commit's steps (before the first commit: the run starts over;
    after one: it resumes from it; fixed lag: the batches generated ahead are restored)."""
    from safetensors.torch import load_file

    checkpoint = make_tiny_checkpoint(tmp_path / "init", seed=2)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    mode_args = [f"rollout.mode={mode}"] + (["rollout.lag=1"] if mode != "sync" else [])
    straight = subprocess.run(
        _run_cmd(tmp_path / "a", arith, checkpoint, *mode_args),
        env=env,
        capture_output=True,
        text=True,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_b = tmp_path / "b"
    for crash_at in kills:
        killed = subprocess.run(
            _run_cmd(run_b, arith, checkpoint, "train.resume=true", *mode_args),
            env={**env, "MEGATRON_SAT_CRASH_AT": crash_at},
            capture_output=True,
            text=True,
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        deadline = time.time() + 15  # the embedded server polls its parent every 2 s
        while time.time() < deadline and _processes_mentioning(str(checkpoint)):
            time.sleep(0.2)
        assert _processes_mentioning(str(checkpoint)) == []
    resumed = subprocess.run(
        _run_cmd(run_b, arith, checkpoint, "train.resume=true", *mode_args),
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(run_b) == _metrics(tmp_path / "a")
    want = load_file(tmp_path / "a" / "checkpoint" / "model.safetensors")
    got = load_file(run_b / "checkpoint" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
