"""Crash-exact resume: kill a short RL run with SIGKILL at random points, resume it, compare.

One uninterrupted run of ``megatron-sat train`` (a tiny random Qwen3-MoE, the arithmetic
task, one embedded rollout server, checkpoints every 2 steps) is the reference. Then, for
each of ``--points`` kill points, a fresh run is killed -- either at a random moment of its
wall time, or between the run checkpoint commit's steps (``MEGATRON_SAT_CRASH_AT``, phases
writing/written/renamed/committed) -- and resumed with ``train.resume=true`` until it
finishes. A kill point counts as identical when every non-timing metric of
``metrics.jsonl`` and every tensor of the final ``checkpoint/model.safetensors`` equal the
reference's bit for bit. A timed kill that would land after the run has ended (runs are
faster than the reference, whose time includes cold caches) is drawn again within that run's
own time, on a fresh run (3 tries); a point never killed tested no resume: not identical.
``orphans`` counts the processes of the killed runs still alive 15 s after each kill: every
process whose environment carries the kill point's tag (``CRASH_RESUME_TAG``, inherited by
all the trainer's children: embedded servers, forked checkpoint writers, the resource
tracker), or whose command line names the run's checkpoint.

The last line is JSON: ``resumed_identical`` (fraction of kill points, goal 1.0),
``orphans`` (goal 0), the kill points (a point that is not identical names what differs:
the first differing metrics and the tensors, with their largest difference), the seconds of
the reference run. ``--keep DIR`` runs in ``DIR`` (new) and keeps the run folders and logs.
``--mode``: sync, fixed_lag (lag 1) or bounded (lag 2 on the logical clock,
``rollout.clock_tokens=2``). Usage:
``python bench/crash_resume.py [--points 5] [--mode sync] [--seed 0] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMING = ("time/", "per_s", "utilisation")
# Bounded mode runs on the logical clock (rollout.clock_tokens), the one that repeats; the
# requests a server finished between two logs then count the rounds that ended while the
# trainer stepped, a wall-clock measure.
MODE_ARGS = {
    "sync": (),
    "fixed_lag": ("rollout.lag=1",),
    "bounded": ("rollout.lag=2", "rollout.clock_tokens=2"),
}
MODE_TIMING = {"sync": (), "fixed_lag": (), "bounded": ("/requests",)}
PHASES = ("writing", "written", "renamed", "committed")  # checkpoint.run_state.COMMIT_PHASES
TAG = "CRASH_RESUME_TAG"


def make_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny random Qwen3-MoE with the char tokenizer, and an arithmetic train/test split."""
    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint
    from megatron_sat.rollout.arith import make_arith_splits
    from megatron_sat.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    ckpt = make_tiny_checkpoint(
        "Qwen3MoeForCausalLM",
        root / "init",
        seed=2,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(ckpt)
    data = root / "data"
    data.mkdir()
    train, test = make_arith_splits(32, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data


def command(run_dir: Path, ckpt: Path, data: Path, mode: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron_sat.cli", "train",
        f"init_checkpoint={ckpt}", f"run_dir={run_dir}",
        f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
        "data.num_eval_prompts=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.eval_samples_per_prompt=2", f"rollout.mode={mode}",
        "train.seed=5", "train.num_steps=6", "train.save_every=2", "train.eval_every=3",
        "train.micro_batch_size=16", *MODE_ARGS[mode], *extra,
    ]  # fmt: skip


def metrics(run_dir: Path, mode: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timing = TIMING + MODE_TIMING[mode]
    return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in rows]


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoint" / "model.safetensors")


def differences(
    run_dir: Path, want_metrics: list[dict], want_weights: dict, mode: str
) -> list[str]:
    """What differs from the reference: up to 5 metrics (step, name, reference, got) and every
    tensor that is missing, extra or not bitwise equal (with its largest absolute difference)."""
    got_metrics, got = metrics(run_dir, mode), weights(run_dir)
    out = []
    if len(got_metrics) != len(want_metrics):
        out.append(f"{len(got_metrics)} metric rows, reference {len(want_metrics)}")
    for want, row in zip(want_metrics, got_metrics):
        for k in sorted(want.keys() | row.keys()):
            if not same(want.get(k), row.get(k)) and len(out) < 5:
                out.append(f"step {want.get('step')}: {k} {want.get(k)!r} vs {row.get(k)!r}")
    for k in sorted(want_weights.keys() ^ got.keys()):
        out.append(f"tensor {k} only in {'reference' if k in want_weights else 'resumed run'}")
    for k in sorted(want_weights.keys() & got.keys()):
        a, b = want_weights[k], got[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"tensor {k}: {b.dtype}{list(b.shape)} vs {a.dtype}{list(a.shape)}")
        elif not torch_equal(a, b):
            out.append(f"tensor {k}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}")
    return out


def same(a, b) -> bool:
    """Equal metric values (a NaN equals a NaN: both runs logged the same undefined value)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def torch_equal(a, b) -> bool:
    """Bitwise equality (NaN equals NaN of the same bits)."""
    return bool((a.view(-1).view(torch_int(a)) == b.view(-1).view(torch_int(b))).all().item())


def torch_int(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def alive_of(text: str, tag: str) -> list[int]:
    """Live processes whose command line contains ``text`` or whose environment has ``tag``
    (``NAME=value``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        mine = text in cmdline or tag.encode() in environ
        if mine and state != "Z" and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def orphans_after(ckpt: Path, tag: str, wait_s: float = 15.0) -> int:
    deadline = time.time() + wait_s
    while time.time() < deadline and alive_of(str(ckpt), tag):
        time.sleep(0.2)
    left = alive_of(str(ckpt), tag)
    for pid in left:  # reported, then ended (only processes of this benchmark's runs)
        print(f"orphan {pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
        os.kill(pid, signal.SIGKILL)
    return len(left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=5)
    parser.add_argument("--mode", default="sync", choices=["sync", "fixed_lag", "bounded"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="run in this new folder and keep it")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    if args.keep is not None:
        args.keep.mkdir(parents=True)  # a new folder: FileExistsError names an old one
        where = contextlib.nullcontext(str(args.keep.resolve()))
    else:
        where = tempfile.TemporaryDirectory(prefix="crash_resume_")
    with where as tmp:
        root = Path(tmp)
        ckpt, data = make_inputs(root)
        t0 = time.time()
        ref = subprocess.run(
            command(root / "ref", ckpt, data, args.mode), env=env, capture_output=True
        )
        ref_s = time.time() - t0
        if ref.returncode != 0:
            raise SystemExit(ref.stderr.decode()[-3000:])
        want_metrics, want_weights = metrics(root / "ref", args.mode), weights(root / "ref")
        identical, orphans, points = 0, 0, []
        for i in range(args.points):
            run_dir = root / f"kill{i}"
            resume = command(run_dir, ckpt, data, args.mode, "train.resume=true")
            tag = f"{TAG}={os.getpid()}.{i}"
            tagged = {**env, TAG: tag.split("=", 1)[1]}
            if i % 2 == 0:  # between the commit's steps, at a checkpointed step
                point = f"{PHASES[rng.randrange(len(PHASES))]}:{rng.choice([2, 4])}"
                with open(root / f"kill{i}.log", "wb") as log:  # read below if not killed
                    proc = subprocess.run(
                        resume,
                        env={**tagged, "MEGATRON_SAT_CRASH_AT": point},
                        stdout=log,
                        stderr=log,
                    )
                killed = proc.returncode == -signal.SIGKILL
            else:  # at a random moment (checkpoint writes included)
                # A run that finishes before its kill (faster than the reference, whose time
                # includes cold caches) tested no resume: it is run again from scratch with the
                # moment drawn within its own time (up to 3 tries; then reported, not killed).
                span = ref_s
                for attempt in range(3):
                    delay = rng.uniform(0.3, 0.9) * span
                    point = f"t={delay:.1f}s" + (f" (try {attempt + 1})" if attempt else "")
                    t1 = time.time()
                    with open(root / f"kill{i}.log", "wb") as log:
                        proc = subprocess.Popen(resume, env=tagged, stdout=log, stderr=log)
                        try:
                            proc.wait(timeout=delay)
                            killed = False
                        except subprocess.TimeoutExpired:
                            proc.send_signal(signal.SIGKILL)
                            proc.wait()
                            killed = True
                    if killed or proc.returncode != 0 or attempt == 2:
                        break
                    span = time.time() - t1
                    shutil.rmtree(run_dir)
            orphans += orphans_after(ckpt, tag)
            if killed:
                done = subprocess.run(resume, env=env, capture_output=True)
                ok = done.returncode == 0
                if not ok and (run_dir / "summary.json").exists():
                    # Killed after it had written its summary (at exit): the resume refuses,
                    # with nothing left to run; its outputs are compared as they are.
                    ok = b"nothing to resume" in done.stderr
                    point += " (after the summary)"
                if not ok:
                    tail = done.stderr.decode(errors="replace")[-1500:]
                    print(f"kill point {i}: the resume failed (rc {done.returncode}): {tail}")
            else:  # it ended by itself: no resume tested, so not identical (a failure reported)
                ok = False
                tail = (root / f"kill{i}.log").read_text(errors="replace")[-1500:]
                print(f"kill point {i} ended by itself, not killed (rc {proc.returncode}): {tail}")
            diff = differences(run_dir, want_metrics, want_weights, args.mode) if ok else []
            ok = ok and not diff
            identical += ok
            points.append({"point": point, "killed": killed, "identical": bool(ok)})
            if diff:
                points[-1]["differs"] = diff
            print(json.dumps(points[-1]), flush=True)
    print(
        json.dumps(
            {
                "mode": args.mode,
                "resumed_identical": identical / max(1, args.points),
                "orphans": orphans,
                "points": points,
                "reference_run_s": round(ref_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
