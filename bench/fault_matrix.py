"""Fault matrix: every fault of issue 22 on the main job's model, and what the project does.

The model is the main job's (``examples/models/qwen3_moe_tiny.json``: 4 layers, 8 experts,
top-2) at random weights with the character tokenizer. Each fault is one short case:

- **checkpoint files** (in this process): two run checkpoints (steps 1 and 2) of a trainer of
  that model; for each file kind of step 2 (``dist/__0_0.distcp``, ``dist/.metadata``,
  ``dist/metadata.json``, ``state.pt``, ``rng/rank_00000.pt``, ``meta.json``,
  ``manifest.json``) a copy of the run with 64 bytes inverted in the middle of that file, and one
  with the file cut to half, resumed with ``load_run_checkpoint``. Named: the resume falls back
  to step 1 (its weights bit for bit) saying which file failed, or raises naming it.
- **crafted files**: ``state.pt`` and ``dist/.metadata`` replaced by a pickle that would touch a
  marker file, with the manifest forged to match. Named: refused naming the file, no marker.
- **full disk**: the run saved into a tmpfs too small for a second checkpoint (mounted here when
  the OS allows it; otherwise the save's ``torch.save`` is patched to raise ENOSPC, and the
  detail says "simulated"). Named: ``DiskFullError`` naming the file; step 1 still resumes.
- **rollout protocol** (``tests/fake_sglang.py``, a fake SGLang server on loopback, through the
  real ``SGLangClient``): positive log-prob, NaN log-prob, future weight version, truncated JSON,
  a 300 MB reply (Content-Length), an 8 MB reply without a length, a hung server (1 s timeout).
  Named: the error names the server URL and ``/generate``.
- **bad top-k**: the model config with ``num_experts_per_tok: 9`` (8 experts) through the
  trainer's checks before step 1. Named: the error names ``num_experts_per_tok``.
- **non-UTF-8 dataset**: a jsonl with a Latin-1 byte on line 3. Named: file and line.
- **SIGTERM mid-step** (a subprocess ``megatron-sat train``, 6 steps, ``save_every`` 100): the
  signal once step 2 is logged. Named: exit 0 with the resume line; data lost when a logged
  step is newer than the run checkpoint it wrote.

Per fault: ``outcome`` is ``named`` (refused or recovered, saying what and where), ``silent``
(accepted as if nothing happened: a silent acceptance) or ``unnamed`` (failed without naming
the culprit); ``data_lost`` when a committed checkpoint is gone or a computed step was not
saved. The last line is JSON: ``silent_acceptances`` (goal 0), ``data_lost`` (goal 0),
``named_errors`` (goal: ``faults``), ``faults``, ``details``. A few minutes on 2 cores.

Usage: ``python bench/fault_matrix.py [--keep DIR] [--skip-sigterm]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fake SGLang server is the tests' own

TEMPLATE = ROOT / "examples" / "models" / "qwen3_moe_tiny.json"
KINDS = (
    "dist/__0_0.distcp",
    "dist/.metadata",
    "dist/metadata.json",
    "state.pt",
    "rng/rank_00000.pt",
    "meta.json",
    "manifest.json",
)


def saved_steps(checkpoints: Path) -> list[int]:
    """The rollout batches the committed run checkpoints in ``checkpoints`` hold, ascending:
    N of ``step_N`` and of a stop's mid-batch ``step_N_mini_j`` (batch N done, part of N + 1);
    ``step_N.tmp`` (uncommitted) and other names are left out."""
    from megatron_sat.checkpoint.run_state import folder_position

    positions = (
        folder_position(p) for p in checkpoints.glob("step_*") if not p.name.endswith(".tmp")
    )
    return sorted({pos[0] for pos in positions if pos is not None})


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def make_model(root: Path) -> Path:
    """The main job's model at random weights, with the character tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_sat.rollout.tokenizer import build_char_tokenizer

    torch_seed(0)
    tokenizer = build_char_tokenizer()
    fields = json.loads(TEMPLATE.read_text())
    fields.pop("architectures")
    fields.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    out = root / "init"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def make_data(root: Path) -> Path:
    from megatron_sat.rollout.arith import make_arith_splits

    data = root / "data"
    data.mkdir()
    train, test = make_arith_splits(32, 8, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


class Case:
    """One fault's record."""

    def __init__(self, fault: str) -> None:
        self.fault, self.outcome, self.data_lost, self.message = fault, "silent", False, ""
        self.t0 = time.time()

    def done(self, outcome: str, message: str, data_lost: bool = False, **extra) -> dict:
        self.outcome, self.message, self.data_lost = outcome, message, data_lost
        row = {
            "fault": self.fault,
            "outcome": outcome,
            "data_lost": data_lost,
            "message": " ".join(message.split())[:300],
            "seconds": round(time.time() - self.t0, 2),
        }
        row.update(extra)
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row


@contextlib.contextmanager
def captured() -> io.StringIO:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        yield out


# -- checkpoint faults ----------------------------------------------------------------------


def build_trainer(init: Path):
    from megatron_sat.checkpoint.hf_io import read_hf_config
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.training.trainer import PolicyTrainer

    init_distributed(ParallelConfig())
    hf = read_hf_config(init)
    cfg = TrainConfig(lr=1e-3, micro_batch_size=4, seed=3)
    trainer = PolicyTrainer(
        hf, cfg, ParallelConfig(), pad_token_id=hf["pad_token_id"], load_from=init
    )
    return trainer, hf


def nudge(trainer, step: int = 1) -> None:
    """One RL step on a random batch (the tests' ``train_step``): weights and Adam states
    change, so the checkpoints differ and hold every optimizer state."""
    from test_checkpoint_resume import train_step

    train_step(trainer, step, trainer.hf_config["vocab_size"])


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if _tensor(v)}


def _tensor(v) -> bool:
    import torch

    return torch.is_tensor(v)


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "bitflip":
        mid = max(0, len(data) // 2 - 32)
        for i in range(mid, min(len(data), mid + 64)):
            data[i] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


def forge_manifest(ckpt: Path) -> None:
    from megatron_sat.checkpoint.manifest import hash_files, list_files, write_manifest

    (ckpt / "manifest.json").unlink()
    write_manifest(ckpt, [hash_files(ckpt, list_files(ckpt))])


def resume_case(
    fault: str, trainer, base: Path, work: Path, step1: dict, tamper: Callable[[Path], str]
) -> dict:
    """Copy ``base``, tamper with its step 2 (``tamper`` returns the name the message must
    hold), resume, judge."""
    import torch

    from megatron_sat.checkpoint.run_state import load_run_checkpoint

    case = Case(fault)
    run = work / fault.replace("/", "_").replace(" ", "_")
    shutil.copytree(base, run)
    step2 = run / "checkpoints" / "step_00000002"
    culprit = tamper(step2)
    marker = work / "code_ran"
    with captured() as out:
        try:
            state = load_run_checkpoint(run, model=trainer.model, optimizer=trainer.optimizer)
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            named = culprit in text
            lost = not (run / "checkpoints" / "step_00000001").is_dir()
            return case.done("named" if named else "unnamed", text, lost, ran_code=marker.exists())
    text = out.getvalue()
    now = weights(trainer)
    same_as_1 = all(torch.equal(step1[k], now[k]) for k in step1)
    kept = (run / "checkpoints" / "set_aside").exists()
    if state.step == 1 and culprit in text and same_as_1:
        return case.done("named", text, data_lost=not kept, ran_code=marker.exists())
    return case.done("silent", f"resumed step {state.step}: {text}", ran_code=marker.exists())


def checkpoint_cases(trainer, root: Path) -> list[dict]:
    from megatron_sat.checkpoint.run_state import save_run_checkpoint

    base = root / "base_run"
    nudge(trainer, 1)
    save_run_checkpoint(base, model=trainer.model, optimizer=trainer.optimizer, step=1)
    step1 = weights(trainer)
    nudge(trainer, 2)
    save_run_checkpoint(base, model=trainer.model, optimizer=trainer.optimizer, step=2)
    work = root / "ckpt_cases"
    work.mkdir()
    rows = []
    for kind in KINDS:
        for how in ("bitflip", "truncate"):

            def tamper(ckpt: Path, kind=kind, how=how) -> str:
                corrupt(ckpt / kind, how)
                return kind

            rows.append(resume_case(f"{how} {kind}", trainer, base, work, step1, tamper))
    marker = work / "code_ran"

    def crafted_state(ckpt: Path) -> str:
        import torch

        torch.save(_RunsCode(marker), ckpt / "state.pt")
        forge_manifest(ckpt)
        return "state.pt"

    def crafted_metadata(ckpt: Path) -> str:
        (ckpt / "dist" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
        forge_manifest(ckpt)
        return ".metadata"

    for name, tamper in (
        ("crafted state.pt", crafted_state),
        ("crafted .metadata", crafted_metadata),
    ):
        row = resume_case(name, trainer, base, work, step1, tamper)
        if marker.exists():  # code ran: whatever was said, it was accepted
            row["outcome"] = "silent"
            marker.unlink()
        rows.append(row)
    return rows


def full_disk_case(trainer, root: Path) -> dict:
    """A second checkpoint on a file system that fits one; step 1 must still resume."""
    import errno

    import torch

    from megatron_sat.checkpoint.run_state import load_run_checkpoint, save_run_checkpoint

    case = Case("full disk")
    mount = root / "tmpfs"
    mount.mkdir()
    one = root / "base_run" / "checkpoints" / "step_00000001"
    size = sum(p.stat().st_size for p in one.rglob("*") if p.is_file())
    size_kb = int(size * 1.5 / 1024) + 64  # one checkpoint and a half
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)],
            capture_output=True,
        ).returncode
        == 0
    )
    run = mount / "run"
    simulated = not mounted
    original_save = torch.save
    try:
        save_run_checkpoint(run, model=trainer.model, optimizer=trainer.optimizer, step=1)
        saved_1 = weights(trainer)
        if simulated:

            def full(obj, f, *args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device", str(f))

            torch.save = full
        try:
            save_run_checkpoint(run, model=trainer.model, optimizer=trainer.optimizer, step=2)
            return case.done("silent", "the second checkpoint was written", simulated=simulated)
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
        finally:
            torch.save = original_save
        nudge(trainer)
        with captured():
            state = load_run_checkpoint(run, model=trainer.model, optimizer=trainer.optimizer)
        now = weights(trainer)
        intact = state.step == 1 and all(torch.equal(saved_1[k], now[k]) for k in saved_1)
        named = "disk full" in text and "step_00000002.tmp" in text
        return case.done(
            "named" if named else "unnamed", text, data_lost=not intact, simulated=simulated
        )
    finally:
        torch.save = original_save
        if mounted:
            subprocess.run(["umount", str(mount)], check=False)


# -- rollout protocol, model config, dataset ------------------------------------------------


def protocol_cases() -> list[dict]:
    from fake_sglang import FakeSGLang

    from megatron_sat.rollout.client import SGLangClient
    from megatron_sat.rollout.protocol import guard_clients, refusal_metrics
    from megatron_sat.rollout.sampling import SamplingParams

    rows = []
    for fault in (
        "positive_logprob",
        "nan_logprob",
        "future_version",
        "truncated_json",
        "oversized",
        "oversized_chunked",
        "hang",
    ):
        case = Case(f"rollout {fault}")
        with FakeSGLang(fault) as server:
            client = SGLangClient(server.url, timeout_s=1.0, max_retries=1, retry_backoff_s=0.01)
            guard_clients([client], version=1, max_reply_bytes=0)
            try:
                out = client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
                rows.append(case.done("silent", f"accepted: {out[0].output_token_logprobs}"))
                continue
            except Exception as e:
                text = f"{type(e).__name__}: {e}"
        named = server.url in text and "/generate" in text
        rows.append(
            case.done("named" if named else "unnamed", text, counted=refusal_metrics([client]))
        )
    return rows


def bad_top_k_case(init: Path, data: Path, root: Path) -> dict:
    from megatron_sat.config import load_config
    from megatron_sat.training.rl import validate_run

    case = Case("bad top-k")
    bad = root / "bad_top_k"
    shutil.copytree(init, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (bad / "config.json").write_text(json.dumps(config))
    cfg = load_config(
        None,
        [
            f"init_checkpoint={bad}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}",
        ],
    )
    try:
        validate_run(cfg, world=1)
    except ValueError as e:
        text = str(e)
        return case.done("named" if "num_experts_per_tok" in text else "unnamed", text)
    return case.done("silent", "validate_run accepted num_experts_per_tok=9 with 8 experts")


def non_utf8_case(root: Path) -> dict:
    from megatron_sat.rollout.datasets import load_prompt_dataset

    case = Case("non-UTF-8 dataset")
    path = root / "latin1.jsonl"
    good = b'{"prompt": "1+1=", "label": "2"}\n'
    path.write_bytes(good * 2 + b'{"prompt": "caf\xe9", "label": "2"}\n' + good)
    try:
        load_prompt_dataset(path)
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        return case.done("named" if f"{path}, line 3" in text else "unnamed", text)
    return case.done("silent", "the dataset loaded")


# -- SIGTERM mid-step -----------------------------------------------------------------------


def sigterm_case(init: Path, data: Path, root: Path) -> dict:
    case = Case("SIGTERM mid-step")
    run = root / "sigterm_run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_sat.cli",
            "train",
            f"init_checkpoint={init}",
            f"run_dir={run}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}",
            "data.num_eval_prompts=4",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "rollout.eval_samples_per_prompt=2",
            "train.num_steps=6",
            "train.save_every=100",
            "train.eval_every=100",
            "train.micro_batch_size=16",
        ],  # fmt: skip
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 900
    while proc.poll() is None and time.time() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 3:  # steps 0 (eval), 1, 2
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=900)
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    saved = saved_steps(run / "checkpoints")
    lost = not saved or max(logged) > saved[-1]
    named = proc.returncode == 0 and "train.resume=true" in err and "Traceback" not in err
    return case.done(
        "named" if named else "unnamed",
        f"exit {proc.returncode}; " + (err.strip().splitlines() or [""])[-1],
        data_lost=lost,
        logged_steps=max(logged),
        saved_step=saved[-1] if saved else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", help="work in this new directory and keep it")
    parser.add_argument("--skip-sigterm", action="store_true", help="no subprocess run")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="fault_matrix_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        init, data = make_model(root), make_data(root)
        rows = protocol_cases() + [bad_top_k_case(init, data, root), non_utf8_case(root)]
        trainer, _ = build_trainer(init)
        rows += checkpoint_cases(trainer, root)
        rows.append(full_disk_case(trainer, root))
        if not args.skip_sigterm:
            rows.append(sigterm_case(init, data, root))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "silent_acceptances": sum(r["outcome"] == "silent" for r in rows),
        "data_lost": sum(bool(r["data_lost"]) for r in rows),
        "named_errors": sum(r["outcome"] == "named" for r in rows),
        "faults": len(rows),
        "seconds": round(time.time() - t0, 1),
        "details": rows,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
