"""The warm start's step loop alone and beside a competing CPU load, with and without the thread
policy of ``megatron_sat.platform.threads``.

Each measurement runs in a fresh subprocess (the OpenMP runtime reads its environment once, at
load): the tiny model of the main job (examples/models/qwen3_moe_tiny.json) is built as
``training.warm_start.warm_start`` builds it, and ``PolicyTrainer.sft_step`` runs on synthetic
arithmetic prompts of the main job's form (batch ``--batch-size``, default the warm start's 64)
for ``--warmup`` steps, then for ``--seconds`` of wall time (at least ``--min-steps``); the
figure is steps per second over the timed steps. "Loaded": ``--load-procs`` (default 2) busy
processes run beside it, each a loop of 256x256 float32 matmuls on one thread, started before
the worker and ended (SIGTERM by pid, then SIGKILL) after it; each bounds itself to
``--load-timeout`` seconds anyway.

Variants, each alone and loaded:

- ``default``: today's environment of the main job (``OMP_NUM_THREADS=2`` as examples/run_cpu.sh
  sets; the OpenMP runtime's own wait policy);
- ``policy``: the same count, and ``platform.threads.configure_threads`` at process start
  (``OMP_WAIT_POLICY=PASSIVE``, ``KMP_BLOCKTIME=0``);
- ``policy_1thread`` (information: a count of 1 would change the main job's float reduction
  order, so it is not the default): ``configure_threads`` with ``OMP_NUM_THREADS=1``.

``contention_slowdown`` = steps/s alone / steps/s loaded, with the policy (goal <= 3.0);
``contention_slowdown_default`` the same without it. Robust to the machine's other jobs: each
variant runs ``--repeats`` (default 3) alone/loaded pairs, the two runs of a pair back to back
(round-robin over the variants), and each figure is the median pair's ratio (every pair's in
``slowdown_per_pair``). ``spin_cpu_per_wall`` (per variant, alone):
process CPU seconds per wall second over a loop of one 2-thread parallel op followed by 2 ms
of sleep: about 1 when idle workers sleep, up to 2+ when they spin (it shows whether the wait
policy takes effect in this build). The machine's load average is printed with the result:
the figures are only comparable within one run.

Usage: ``python bench/cpu_contention.py [--seconds 20 --batch-size 64]``. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "default": {"policy": False, "env": {"OMP_NUM_THREADS": "2"}},
    "policy": {"policy": True, "env": {"OMP_NUM_THREADS": "2"}},
    "policy_1thread": {"policy": True, "env": {"OMP_NUM_THREADS": "1"}},
}


def burn(seconds: float) -> None:
    """One busy process: single-threaded float32 matmuls until ``seconds`` pass."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = a @ a
        a /= np.abs(a).max() + 1.0


def spin_probe(rounds: int = 200) -> float:
    """Process CPU seconds per wall second over ``rounds`` of (a parallel op, 2 ms sleep)."""
    import torch

    x = torch.randn(4_000_000)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        x.mul_(1.0000001)  # over ATen's grain size: runs on every OpenMP thread
        time.sleep(0.002)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def worker(args) -> None:
    """One measurement (see the module docstring); prints ``CONTENTION {...}``."""
    policy = None
    if args.policy:
        from megatron_sat.platform.threads import configure_threads

        policy = configure_threads()  # before torch loads OpenMP
    import random

    import torch

    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.rollout.datasets import PromptRecord
    from megatron_sat.rollout.tokenizer import build_char_tokenizer
    from megatron_sat.training.trainer import PolicyTrainer
    from megatron_sat.training.warm_start import sft_sample

    spin = spin_probe() if args.spin_probe else None
    tokenizer = build_char_tokenizer()
    hf_config = json.loads((ROOT / "examples/models/qwen3_moe_tiny.json").read_text())
    hf_config.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    train = TrainConfig(lr=2e-3, micro_batch_size=args.batch_size, seed=1234, use_r3=False)
    trainer = PolicyTrainer(
        hf_config, train, ParallelConfig(), pad_token_id=tokenizer.pad_token_id, load_from=None
    )
    rng = random.Random(0)
    records = []
    for i in range(512):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        records.append(PromptRecord(prompt=f"What is {a} + {b}?", label=str(a + b), source_index=i))

    def step(n: int) -> None:
        batch = [(n * args.batch_size + j) % len(records) for j in range(args.batch_size)]
        trainer.sft_step([sft_sample(i, records[i], tokenizer) for i in batch])

    for n in range(args.warmup):
        step(n)
    steps, t0 = 0, time.perf_counter()
    while steps < args.min_steps or time.perf_counter() - t0 < args.seconds:
        step(args.warmup + steps)
        steps += 1
    wall = time.perf_counter() - t0
    out = {
        "steps_per_s": steps / wall,
        "steps": steps,
        "wall_s": wall,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "policy_source": policy.source if policy else None,
        "spin_cpu_per_wall": spin,
        "threads_in_process": len(os.listdir("/proc/self/task")),
    }
    print("CONTENTION " + json.dumps(out), flush=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure(args, variant: str, loaded: bool) -> dict:
    """Run one worker subprocess (with the load beside it when ``loaded``)."""
    spec = VARIANTS[variant]
    env = {
        k: v
        for k, v in os.environ.items()
        # every input of platform.threads' decision: each variant sets its own
        if k
        not in (
            "OMP_NUM_THREADS",
            "OMP_WAIT_POLICY",
            "KMP_BLOCKTIME",
            "MEGATRON_SAT_THREADS",
            "MEGATRON_SAT_THREADS_CHOSEN",
            "MEGATRON_SAT_LOCAL_PROCESSES",
            "LOCAL_WORLD_SIZE",
        )
    }
    env.update(spec["env"], PYTHONPATH=str(ROOT))
    load: list[subprocess.Popen] = []
    if loaded:
        burn_env = dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--burn", str(args.load_timeout)]
        load = [subprocess.Popen(cmd, env=burn_env) for _ in range(args.load_procs)]
        time.sleep(1.0)  # the load is running before the worker starts
    cmd = [sys.executable, __file__, "--worker", "--seconds", str(args.seconds)]
    cmd += ["--warmup", str(args.warmup), "--min-steps", str(args.min_steps)]
    cmd += ["--batch-size", str(args.batch_size)]
    if spec["policy"]:
        cmd.append("--policy")
    if not loaded:
        cmd.append("--spin-probe")
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.load_timeout
        )
    finally:
        _stop(load)
    line = [x for x in proc.stdout.splitlines() if x.startswith("CONTENTION ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{variant} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line[0].removeprefix("CONTENTION "))
    where = "loaded" if loaded else "alone"
    print(f"{variant} {where} (load {os.getloadavg()[0]:.1f}): {json.dumps(out)}", file=sys.stderr)
    return out


def _median_pair(pairs: list[dict]) -> dict:
    """The pair of the median slowdown (the lower middle one of an even count)."""
    ranked = sorted(pairs, key=lambda p: p["slowdown"])
    return ranked[(len(ranked) - 1) // 2]


def main() -> None:
    """Run the bench; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed wall time per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--load-procs", type=int, default=2)
    parser.add_argument("--load-timeout", type=float, default=600.0, help="bound of every run")
    parser.add_argument("--variants", default="default,policy,policy_1thread")
    parser.add_argument("--repeats", type=int, default=3, help="alone/loaded pairs per variant")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spin-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--burn", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.burn is not None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        burn(args.burn)
        return
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()
    pairs: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
    for _ in range(args.repeats):
        for variant, done in pairs.items():
            # alone and loaded back to back: the other jobs' load is about the same for both
            pair = {"alone": measure(args, variant, loaded=False)}
            pair["loaded"] = measure(args, variant, loaded=True)
            pair["slowdown"] = pair["alone"]["steps_per_s"] / pair["loaded"]["steps_per_s"]
            done.append(pair)
    load_after = os.getloadavg()
    runs = {v: _median_pair(done) for v, done in pairs.items()}
    result: dict = {}
    for variant, r in runs.items():
        suffix = "" if variant == "policy" else f"_{variant}"
        result[f"contention_slowdown{suffix}"] = round(r["slowdown"], 2)
    result["goal_contention_slowdown"] = 3.0
    result["repeats"] = args.repeats
    for variant, r in runs.items():
        result[variant] = {
            "slowdown_per_pair": [round(p["slowdown"], 2) for p in pairs[variant]],
            "alone_steps_per_s": round(r["alone"]["steps_per_s"], 3),
            "loaded_steps_per_s": round(r["loaded"]["steps_per_s"], 3),
            "torch_threads": r["alone"]["torch_threads"],
            "omp_wait_policy": r["alone"]["omp_wait_policy"],
            "spin_cpu_per_wall": round(r["alone"]["spin_cpu_per_wall"], 2),
            "threads_in_process": r["alone"]["threads_in_process"],
            "steps": [r["alone"]["steps"], r["loaded"]["steps"]],
        }
    result["load_avg_before"] = [round(x, 2) for x in load_before]
    result["load_avg_after"] = [round(x, 2) for x in load_after]
    result["cores"] = len(os.sched_getaffinity(0))
    result["seconds"] = args.seconds
    result["batch_size"] = args.batch_size
    self_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["children_cpu_s"] = round(self_cpu.ru_utime + self_cpu.ru_stime, 1)
    for variant, r in runs.items():
        print(
            f"{variant}: alone {r['alone']['steps_per_s']:.2f} steps/s, beside "
            f"{args.load_procs} busy processes {r['loaded']['steps_per_s']:.2f} steps/s "
            f"(x{r['alone']['steps_per_s'] / r['loaded']['steps_per_s']:.1f} slower); "
            f"{r['alone']['torch_threads']} torch threads, wait policy "
            f"{r['alone']['omp_wait_policy'] or 'runtime default'}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
