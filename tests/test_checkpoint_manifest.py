"""Verified checkpoints and run files that run no code: the manifest of a run checkpoint and
of an HF export, the resume that names a damaged file and falls back to the newest older
checkpoint that verifies, ``resume_from``, checkpoints written before manifests, the RNG and
run state stored as plain data (restored bit for bit), and a crafted pickle refused unrun."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sat.checkpoint import manifest
from megatron_sat.checkpoint.hf_io import verify_hf_checkpoint, write_hf_checkpoint
from megatron_sat.checkpoint.run_state import (
    CheckpointVerificationError,
    latest_run_checkpoint,
    load_run_checkpoint,
    rng_state,
    save_run_checkpoint,
    set_rng_state,
)
from megatron_sat.checkpoint.safe_files import UnsafeFileError, from_plain, load_plain, to_plain
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.training.trainer import PolicyTrainer

TRAIN = TrainConfig(lr=3e-3, micro_batch_size=4, seed=7)
STEP_1, STEP_2 = "step_00000001", "step_00000002"


def draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        np.random.standard_normal(3).tolist(),  # odd count: numpy's cached gaussian is used
        torch.rand(3).tolist(),
    )


def test_rng_states_round_trip_bit_for_bit_as_plain_data(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    np.random.standard_normal(1)  # leaves a cached gaussian in numpy's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = draws()
    draws()  # move every generator on
    set_rng_state(load_plain(tmp_path / "rng.pt"))  # weights_only, no allowlist
    assert draws() == expected


def test_state_with_numpy_values_round_trips_exactly(tmp_path):
    routes = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    state = {
        "batches": [{"groups": {0: [{"routed_experts": routes, "reward": np.float64(0.25)}]}}],
        "int16": np.array([-3, 7], dtype=np.int16),
        "pair": (1, "a", None, 2.5),
    }
    torch.save(to_plain(state), tmp_path / "state.pt")
    back = from_plain(load_plain(tmp_path / "state.pt"))
    got = back["batches"][0]["groups"][0][0]
    assert got["routed_experts"].dtype == np.uint8 and np.array_equal(got["routed_experts"], routes)
    assert type(got["reward"]) is np.float64 and got["reward"] == 0.25
    assert back["int16"].dtype == np.int16 and back["int16"].tolist() == [-3, 7]
    assert back["pair"] == (1, "a", None, 2.5)
    with pytest.raises(TypeError, match=r"state\['odd'\]: set is not plain data"):
        to_plain({"odd": {1, 2}})


class _Payload:
    """A pickle whose loading would create ``marker`` (what a crafted ``state.pt`` does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("legacy", [False, True])
def test_crafted_pickle_is_refused_without_running_it(tmp_path, legacy):
    marker = tmp_path / "ran"
    crafted = tmp_path / "state.pt"
    torch.save({"step": 3, "extra": _Payload(marker)}, crafted)
    with pytest.raises(UnsafeFileError, match=rf"{crafted}: refused.*posix.system"):
        load_plain(crafted, legacy=legacy)
    assert not marker.exists()
    crafted.write_bytes(crafted.read_bytes()[:100])  # truncated
    with pytest.raises(UnsafeFileError, match=rf"{crafted}: unreadable, truncated or corrupt"):
        load_plain(crafted)


def test_hf_export_has_a_manifest_that_verifies(tmp_path, tiny_hf_config):
    out = write_hf_checkpoint(
        [("a", torch.arange(6.0)), ("b", torch.ones(2, 2))], tiny_hf_config, tmp_path / "hf"
    )
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert sorted(files) == ["config.json", "model.safetensors", "model.safetensors.index.json"]
    size = (out / "model.safetensors").stat().st_size
    assert files["model.safetensors"]["size"] == size
    assert files["model.safetensors"]["sha256"] == manifest.file_digest(out / "model.safetensors")
    assert verify_hf_checkpoint(out) is True
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors: checksum mismatch"):
        verify_hf_checkpoint(out)
    (out / "manifest.json").unlink()
    assert verify_hf_checkpoint(out) is False  # nothing to verify against


# -- run checkpoints ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, megatron_world, tiny_checkpoint, tiny_hf_config):
    """A run directory with committed checkpoints of steps 1 and 2 (copied by each test)."""
    from test_checkpoint_resume import train_step

    run = tmp_path_factory.mktemp("saved_run")
    trainer = PolicyTrainer(
        tiny_hf_config, TRAIN, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
    )
    for step in (1, 2):
        train_step(trainer, step, tiny_hf_config["vocab_size"])
        save_run_checkpoint(
            run, model=trainer.model, optimizer=trainer.optimizer, step=step, weight_version=step
        )
    return run


@pytest.fixture
def run(saved_run, tmp_path) -> Path:
    return Path(shutil.copytree(saved_run, tmp_path / "run"))


@pytest.fixture
def fresh(tiny_checkpoint, tiny_hf_config) -> PolicyTrainer:
    return PolicyTrainer(
        tiny_hf_config, TRAIN, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
    )


def _load(run: Path, trainer: PolicyTrainer, **kwargs):
    return load_run_checkpoint(run, model=trainer.model, optimizer=trainer.optimizer, **kwargs)


def test_manifest_lists_every_file_with_size_and_checksum(run):
    ckpt = run / "checkpoints" / STEP_2
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted(files) == [f for f in on_disk if f != "manifest.json"]
    assert {"meta.json", "state.pt", "rng/rank_00000.pt", "dist/metadata.json"} <= set(files)
    assert any(f.endswith(".distcp") for f in files)
    for rel, entry in files.items():
        assert entry == {"size": (ckpt / rel).stat().st_size,
                         "sha256": manifest.file_digest(ckpt / rel)}  # fmt: skip
    assert json.loads((ckpt / "meta.json").read_text())["format"] == 2


def _largest_shard(ckpt: Path) -> Path:
    return max((ckpt / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip_middle(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip_shard", "truncate_meta", "truncate_state", "no_rng"])
def test_damaged_latest_falls_back_to_the_previous_checkpoint(run, fresh, capsys, damage):
    ckpt = run / "checkpoints" / STEP_2
    if damage == "flip_shard":
        shard = _largest_shard(ckpt)
        _flip_middle(shard)
        why = f"dist/{shard.name}: checksum mismatch (the contents changed since written)"
    elif damage in ("truncate_meta", "truncate_state"):
        name = "meta.json" if damage == "truncate_meta" else "state.pt"
        size = (ckpt / name).stat().st_size
        (ckpt / name).write_bytes((ckpt / name).read_bytes()[: size // 2])
        why = f"{name}: size {size // 2} bytes, the manifest says {size}"
    else:
        (ckpt / "rng" / "rank_00000.pt").unlink()
        why = "rng/rank_00000.pt: missing"
    state = _load(run, fresh)
    assert (state.step, state.weight_version) == (1, 1)
    out = capsys.readouterr().out
    line = f"{STEP_2} failed verification: {why}. Resuming from {STEP_1}, the newest that verifies"
    assert line in out
    # The damaged checkpoint is kept aside, latest names the one used: step 2 saves again.
    assert latest_run_checkpoint(run).name == STEP_1
    assert (run / "checkpoints" / "set_aside" / STEP_2 / "manifest.json").exists()
    assert (
        save_run_checkpoint(run, model=fresh.model, optimizer=fresh.optimizer, step=2)
        == run / "checkpoints" / STEP_2
    )


def test_no_checkpoint_verifies_lists_each(run, fresh):
    for name in (STEP_1, STEP_2):
        (run / "checkpoints" / name / "state.pt").write_bytes(b"x")
    with pytest.raises(CheckpointVerificationError) as error:
        _load(run, fresh)
    message = str(error.value)
    for name in (STEP_1, STEP_2):
        assert f"{name}: state.pt: size 1 bytes, the manifest says" in message
    assert latest_run_checkpoint(run).name == STEP_2  # nothing moved


def test_resume_from_picks_a_step_and_refuses_a_missing_or_damaged_one(run, fresh):
    with pytest.raises(FileNotFoundError, match=r"train.resume_from=5: .*committed steps: 2, 1"):
        _load(run, fresh, resume_from=5)
    (run / "checkpoints" / STEP_1 / "manifest.json").write_text('{"format": "megatron-sat')
    with pytest.raises(CheckpointVerificationError, match="manifest.json: unreadable"):
        _load(run, fresh, resume_from=1)
    shutil.rmtree(run / "checkpoints" / STEP_1)
    with pytest.raises(FileNotFoundError, match="train.resume_from=1"):
        _load(run, fresh, resume_from=1)
    assert _load(run, fresh, resume_from=2).step == 2


def test_resume_from_an_older_step_sets_the_newer_aside(saved_run, tmp_path, fresh, capsys):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    assert _load(run, fresh, resume_from=1).step == 1
    assert f"train.resume_from=1: resuming from {STEP_1} ({STEP_2} moved to" in (
        capsys.readouterr().out
    )
    assert latest_run_checkpoint(run).name == STEP_1
    assert (run / "checkpoints" / "set_aside" / STEP_2).is_dir()


def _make_legacy(ckpt: Path, state_extra: object = None) -> None:
    """Rewrite a checkpoint as megatron-sat wrote it before manifests: no manifest, no
    format, numpy's RNG state and the run state pickled as they are."""
    (ckpt / "manifest.json").unlink()
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["format"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    rng = load_plain(ckpt / "rng" / "rank_00000.pt")
    key = rng["numpy"]["key"].numpy().astype(np.uint32)
    rng["numpy"] = ("MT19937", key, rng["numpy"]["pos"], 0, 0.0)
    torch.save(rng, ckpt / "rng" / "rank_00000.pt")
    state = from_plain(load_plain(ckpt / "state.pt"))
    state["rollout_state"] = {"routes": np.ones((2, 2), dtype=np.uint8)}
    if state_extra is not None:
        state["extra"] = {"x": state_extra}
    torch.save(state, ckpt / "state.pt")


def test_checkpoint_without_manifest_loads_unverified(run, fresh, capsys):
    _make_legacy(run / "checkpoints" / STEP_2)
    state = _load(run, fresh)
    assert state.step == 2
    assert state.rollout_state["routes"].dtype == np.uint8
    out = capsys.readouterr().out
    assert f"run checkpoint {run / 'checkpoints' / STEP_2} has no manifest.json" in out
    assert "loading it unverified" in out


def test_crafted_state_in_a_run_folder_is_refused_unrun(run, fresh, tmp_path):
    marker = tmp_path / "ran"
    _make_legacy(run / "checkpoints" / STEP_2, state_extra=_Payload(marker))
    with pytest.raises(UnsafeFileError, match=rf"{STEP_2}/state.pt: refused"):
        _load(run, fresh)
    assert not marker.exists()
