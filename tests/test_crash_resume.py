"""Runs that survive crashes: the run checkpoint's commit protocol at every crash point, files
with the user's umask, children that die with a SIGKILLed parent, and a wrong layout or an
over-long prompt refused by ``train`` (and its ``--dry-run``) before anything is built."""

from __future__ import annotations

import json
import os
import random
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
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.config.layout import check_train_layout
from megatron_sat.rollout.arith import make_arith_splits
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
        "writing": ["step_00000005", "step_00000010.tmp"],  # dist/ only, unsynced
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
    # daemon: should this script fail, it exits at once rather than wait for the sleeper
    worker = mp.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    worker.start()

    def parent_of(pid):
        try:  # a process of the busy machine may end between listdir and open
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
        except OSError:
            return None

    kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_of(p) == str(os.getpid())]
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


def test_embedded_server_whose_parent_died_exits_before_importing_torch(tmp_path):
    """A server whose parent is gone (its recorded parent pid is not its parent) exits at its
    first import, before torch: a trainer killed while its server imports leaves nothing
    (the import times Python prints show how far it got)."""
    from megatron_sat.platform.lifetime import PARENT_PID_ENV, PDEATHSIG_ENV

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_sat.rollout.embedded.server", "--model-path",
         str(tmp_path), "--port", "1"],
        env={**os.environ, PARENT_PID_ENV: "1", PDEATHSIG_ENV: "0", "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()]
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The guard's own line never comes: Python prints an import when it completes.
    assert "megatron_sat.rollout.embedded" in imported
    assert "torch" not in imported and "uvicorn" not in imported


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


NUM_STEPS, SAVE_EVERY = 20, 3


def _run_cmd(run_dir: Path, data: Path, checkpoint: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron_sat.cli", "train",
        f"init_checkpoint={checkpoint}", f"run_dir={run_dir}",
        f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
        "data.num_eval_prompts=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.eval_samples_per_prompt=2", "train.seed=5",
        f"train.num_steps={NUM_STEPS}", f"train.save_every={SAVE_EVERY}", "train.eval_every=10",
        "train.micro_batch_size=16", *extra,
    ]  # fmt: skip


TIMING = ("time/", "per_s", "utilisation")
# What a server crash changes and nothing else does: the incident's own counters.
INCIDENT = ("rollout/reissued", "rollout/server_restarts", "rollout/dead_servers", "/failures")
INCIDENT += ("/requests",)


def _metrics(run_dir: Path, drop: tuple[str, ...] = ()) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING + drop)} for r in rows]


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``tag`` (every child of a run inherits it:
    forked checkpoint writers, the resource tracker, the embedded servers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if tag.encode() in environ.split(b"\0") and int(pid) != os.getpid() and _alive(int(pid)):
            found.append(int(pid))
    return found


def kill_plan(seed: int, num_kills: int = 5) -> list[str]:
    """``num_kills`` seeded ``MEGATRON_SAT_CRASH_AT`` points at distinct checkpointed steps,
    in step order (so each resumed process gets past the kill before it: the chain ends), at
    any commit phase (mid-write included)."""
    rng = random.Random(seed)
    due = list(range(SAVE_EVERY, NUM_STEPS, SAVE_EVERY))  # the last step's save excluded
    steps = sorted(rng.sample(due, num_kills))
    return [f"{rng.choice(COMMIT_PHASES)}:{step}" for step in steps]


def _committed_after(point: str) -> int:
    """The step a run killed at ``point`` resumes from."""
    phase, step = point.split(":")
    return int(step) if phase == "committed" else int(step) - SAVE_EVERY


@pytest.fixture(scope="module")
def crash_inputs(tmp_path_factory, arith) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("crash_runs")
    return make_tiny_checkpoint(root / "init", seed=2), arith


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(
    ("mode", "seed"),
    [("sync", 20), ("fixed_lag", 16), ("bounded", 3)],
)
def test_run_killed_five_times_resumes_bit_identical(tmp_path, crash_inputs, mode, seed):
    """The 20-step run SIGKILLed at 5 seeded points (mid-write and between the commit's
    steps), chained in one run directory and resumed each time, ends with every non-timing
    metric and every final weight of the uninterrupted run, bit for bit; nothing of a killed
    run survives it. Sync mode: the second process also loses its rollout server in the
    middle of a generation (the fleet restarts and re-syncs it; the per-request seeds keep
    the run on its path), and the restart count survives the later resumes. Fixed lag: the
    batches generated ahead are restored from each checkpoint. Bounded (lag 2, on the logical
    clock of rounds of 2 tokens, so samples span versions): the pool as it stands at each
    checkpoint's pause, partial requests included."""
    from safetensors.torch import load_file

    checkpoint, arith_dir = crash_inputs
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    mode_args = {
        "sync": ["rollout.mode=sync"],
        "fixed_lag": ["rollout.mode=fixed_lag", "rollout.lag=1"],
        "bounded": ["rollout.mode=bounded", "rollout.lag=2", "rollout.clock_tokens=2"],
    }[mode]
    straight = subprocess.run(
        _run_cmd(tmp_path / "a", arith_dir, checkpoint, *mode_args),
        env=env,
        capture_output=True,
        text=True,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    plan = kill_plan(seed)
    # The server crash lands in process 1, which must commit once after it (so that a
    # resume has the restart count to restore): its kill point is past the next save.
    assert _committed_after(plan[1]) > _committed_after(plan[0]) + SAVE_EVERY - 1, plan
    run_b = tmp_path / "b"
    server_crash = {"MEGATRON_SAT_SERVER_CRASH_AT": f"2:{tmp_path / 'server_crashed'}"}
    for i, crash_at in enumerate([*plan, None]):
        tag = f"MEGATRON_SAT_TEST_RUN={tmp_path.name}.{i}"
        extra = {"MEGATRON_SAT_CRASH_AT": crash_at} if crash_at else {}
        if mode == "sync" and i == 1:
            extra.update(server_crash)
        proc = subprocess.run(
            _run_cmd(run_b, arith_dir, checkpoint, "train.resume=true", *mode_args),
            env={**env, **extra, tag.split("=")[0]: tag.split("=")[1]},
            capture_output=True,
            text=True,
        )
        want_rc = 0 if crash_at is None else -signal.SIGKILL
        assert proc.returncode == want_rc, (crash_at, proc.stderr[-3000:])
        deadline = time.time() + 15  # signals act at once; the servers' poll is a backstop
        while time.time() < deadline and _tagged(tag):
            time.sleep(0.2)
        assert _tagged(tag) == [], crash_at
    if mode == "sync":
        assert (tmp_path / "server_crashed").exists()  # the server did die mid-generation
    # Bounded: the requests a server finished between two logs count the rounds that ended
    # while the trainer stepped, a wall-clock measure like samples_per_s.
    drop = {"sync": INCIDENT, "fixed_lag": (), "bounded": ("/requests",)}[mode]
    rows = _metrics(run_b, drop)
    assert rows == _metrics(tmp_path / "a", drop)
    if mode == "bounded":
        # Version 0 finishes batches 0-2; from version 1 on each overlap round starts the
        # batch just admitted, which the next version finishes: batch b >= 3 is 2 old.
        ages = [(r["rollout/staleness_mean"], r["rollout/staleness_max"]) for r in rows[1:]]
        assert ages == [(0.0, 0.0), (1.0, 1.0)] + [(2.0, 2.0)] * (NUM_STEPS - 2)
    restarts = [r.get("rollout/server_restarts", 0.0) for r in _metrics(run_b)]
    assert restarts[-1] == (1.0 if mode == "sync" else 0.0)
    assert restarts == sorted(restarts)  # cumulative across the resumes
    want = load_file(tmp_path / "a" / "checkpoint" / "model.safetensors")
    got = load_file(run_b / "checkpoint" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


# -- bounded mode: the pool as it stands at a checkpoint ---------------------------------------


class _PausableFake:
    """A deterministic server: a fresh request gets one token and is aborted (as by a weight
    push), a resumed one finishes; while ``holder["paused"]`` resumed requests are aborted
    with nothing (a paused server), so they stay partial in the queue. Tokens depend on the
    request's seed and position only, versions on ``holder["version"]``."""

    base_url = "fake://pausable"
    max_new_tokens = 3

    def __init__(self, holder: dict) -> None:
        self.holder = holder

    def generate(self, input_ids, sampling, routing=None):
        from megatron_sat.rollout.client import GenerateOutput

        time.sleep(0.002)
        outs = []
        for ids, params in zip(input_ids, sampling, strict=True):
            fresh = params.max_new_tokens == self.max_new_tokens
            if fresh:
                n, reason = 1, "abort"
            elif self.holder["paused"]:
                n, reason = 0, "abort"
            else:
                n, reason = params.max_new_tokens, "stop"
            tokens = [48 + (params.sampling_seed + len(ids) + i) % 10 for i in range(n)]
            outs.append(
                GenerateOutput(
                    output_ids=tokens,
                    output_token_logprobs=[-0.01 * t for t in tokens],
                    finish_reason=reason,
                    weight_version=str(self.holder["version"]),
                    routed_experts=None,
                    prompt_tokens=len(ids),
                    completion_tokens=n,
                )
            )
        return outs


def _bounded_pool(holder: dict, skip: int = 0):
    from test_async_pool import CharTokenizer, records

    from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
    from megatron_sat.rollout.client import SamplingParams

    prompts = records()
    for _ in range(skip):
        next(prompts)
    return AsyncRolloutPool(
        [_PausableFake(holder)],
        CharTokenizer(),
        lambda text, label: float(len(text) % 2),
        prompts,
        AsyncPoolConfig(mode="bounded", lag=1, prompts_per_batch=2, group_size=2),
        SamplingParams(max_new_tokens=_PausableFake.max_new_tokens),
        seed_of=lambda b, drawn, slot: 1000 * b + 10 * drawn + slot,
    )


def test_bounded_pool_state_at_a_checkpoint_is_restored_exactly():
    """Bounded mode cannot re-create its batches ahead by a rule (which version produced
    which token depends on timing), so the checkpoint holds them as they stand: the resumed
    pool exports the same state, and finishes the partial requests exactly as the original
    pool does from the same instant."""
    import io
    from dataclasses import asdict

    holder = {"version": 0, "paused": False}
    a = _bounded_pool(holder)
    a.start()
    for step in range(3):
        a.get_batch(step, timeout_s=30)
        if step == 2:
            holder["paused"] = True  # what is in flight now stays partial
        holder["version"] = step + 1
        a.set_version(step + 1)
    deadline = time.time() + 30
    while time.time() < deadline and a.meter.snapshot().servers[0].requests < 10:
        time.sleep(0.01)  # batch 4's first tokens came back, its resumptions bounce
    state = a.export_state(3)
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as the run checkpoint stores it
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert saved["mode"] == "bounded" and saved["version"] == 0
    assert len(saved["batches"]) == 2  # batches 3 and 4 (lag 1), relative indices 0 and 1
    partial = [j for j in saved["queue"] if j["response_ids"]]
    assert partial and all(len(j["response_ids"]) == 1 for j in partial)
    # Batch 3's first tokens came from version 2 (or 3, if it was queued at the push), batch
    # 4's from version 3.
    assert all(set(j["versions"]) <= {2, 3} for j in saved["queue"])

    b = _bounded_pool(holder, skip=saved["drawn"])
    b.restore_state(saved)
    again = b.export_state(0)
    assert {**again, "drawn": saved["drawn"]} == saved
    holder["paused"] = False
    b.start()
    got_a = [asdict(s) for k in (3, 4) for s in a.get_batch(k, timeout_s=30)]
    got_b = [asdict(s) for k in (0, 1) for s in b.get_batch(k, timeout_s=30)]
    a.stop()
    b.stop()
    assert got_b == got_a
    assert all(len(s["response_ids"]) == 3 for s in got_a)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_bounded_run_resumes_from_the_pool_as_it_stood(tmp_path, crash_inputs):
    """Bounded mode is not repeatable (which version produces which token depends on timing:
    two uninterrupted runs differ from step 2 on), so a resumed run cannot equal a reference
    one. What is exact: the step after the checkpoint resumed from. Its batch is finished by
    the checkpoint's version in both processes (the next push waits for that step), from the
    restored samples and partial requests, so the killed process's step and the resumed
    one's are bit-identical; re-drawing the batches ahead instead (the old resume) regenerates
    them from the prompt at another version."""
    checkpoint, arith_dir = crash_inputs
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    args = ["rollout.mode=bounded", "rollout.lag=2", "train.num_steps=8", "train.save_every=2"]
    run = tmp_path / "run"
    for crash_at in ("written:6", None):
        tag = f"{tmp_path.name}.{crash_at}"
        extra = {"MEGATRON_SAT_CRASH_AT": crash_at} if crash_at else {}
        proc = subprocess.run(
            _run_cmd(run, arith_dir, checkpoint, "train.resume=true", *args),
            env={**env, **extra, "MEGATRON_SAT_TEST_RUN": tag},
            capture_output=True,
            text=True,
        )
        assert proc.returncode == (0 if crash_at is None else -signal.SIGKILL), proc.stderr[-3000:]
        deadline = time.time() + 15
        while time.time() < deadline and _tagged(f"MEGATRON_SAT_TEST_RUN={tag}"):
            time.sleep(0.2)
        assert _tagged(f"MEGATRON_SAT_TEST_RUN={tag}") == []
        if crash_at is not None:
            killed = _metrics(run, INCIDENT)  # steps 0..6; the checkpoint of step 4 is latest
    resumed = _metrics(run, INCIDENT)
    assert [r["step"] for r in killed] == list(range(7))
    assert [r["step"] for r in resumed] == list(range(9))
    assert resumed[:5] == killed[:5]  # kept from the killed process
    assert resumed[5] == killed[5]  # generated again after the resume: the same
    assert killed[5]["rollout/staleness_max"] <= 2


@pytest.mark.slow
def test_resume_with_a_pool_of_another_shape_is_refused_before_the_servers(tmp_path, crash_inputs):
    """Found by review: a bounded run checkpointed at lag 2 and resumed at lag 1 was accepted
    and gave samples 2 versions old. It is refused at the resume, naming the field, before a
    server starts."""
    checkpoint, arith_dir = crash_inputs
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    args = ["rollout.mode=bounded", "rollout.clock_tokens=2", "train.save_every=2"]
    run = tmp_path / "run"
    first = subprocess.run(
        _run_cmd(run, arith_dir, checkpoint, *args, "rollout.lag=2", "train.num_steps=2"),
        env=env,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(
        _run_cmd(run, arith_dir, checkpoint, *args, "rollout.lag=1", "train.resume=true"),
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1
    assert "rollout.lag=2 in the checkpoint, 1 here" in again.stderr
    assert "check_pool_state" in again.stderr and "_lead" not in again.stderr  # before servers
