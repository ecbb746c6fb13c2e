"""Distributed checkpoints load without running code from the run folder
(``checkpoint.safe_dcp``): a crafted ``dist/.metadata`` or checkpoint object is refused naming
it, with no code run (a marker file stays absent), also when its manifest was forged with it;
a real checkpoint loads as before."""

from __future__ import annotations

import inspect
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import train_step

from megatron_sat.checkpoint.dist_ckpt import load_dist_checkpoint, model_sharded_state_dict
from megatron_sat.checkpoint.manifest import hash_files, list_files, write_manifest
from megatron_sat.checkpoint.run_state import (
    CheckpointVerificationError,
    load_run_checkpoint,
    save_run_checkpoint,
)
from megatron_sat.checkpoint.safe_dcp import (
    UnsafeMetadataError,
    read_dcp_metadata,
    restricted_dcp_loading,
)
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.training.trainer import PolicyTrainer


class _RunsCode:
    """Unpickles as ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(megatron_world, tiny_checkpoint, tiny_hf_config, tmp_path_factory):
    cfg = TrainConfig(lr=1e-3, micro_batch_size=4, seed=3)
    trainer = PolicyTrainer(
        tiny_hf_config, cfg, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
    )
    train_step(trainer, 1, tiny_hf_config["vocab_size"])
    run = tmp_path_factory.mktemp("safe_dcp_run")
    ckpt = save_run_checkpoint(
        run, model=trainer.model, optimizer=trainer.optimizer, step=1, weight_version=1
    )
    return trainer, run, ckpt


def test_real_metadata_reads_the_same_as_pickle(saved):
    _, _, ckpt = saved
    path = ckpt / "dist" / ".metadata"
    ours = read_dcp_metadata(path)
    with open(path, "rb") as f:
        theirs = pickle.load(f)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_a_real_checkpoint_loads_under_the_restriction(saved):
    trainer, run, _ = saved
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    state = load_run_checkpoint(run, model=trainer.model, optimizer=trainer.optimizer)
    assert state.step == 1
    after = trainer.model.state_dict()
    assert before and all(torch.equal(before[k], after[k]) for k in before)


def _forge(ckpt: Path, tmp_path: Path) -> Path:
    """``ckpt``'s ``.metadata`` replaced by a pickle that touches a marker; returns it."""
    marker = tmp_path / "code_ran"
    (ckpt / "dist" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    return marker


def test_crafted_metadata_is_refused_without_running_code(saved, tmp_path):
    trainer, run, ckpt = saved
    copy = tmp_path / "dist"
    copy.mkdir()
    for f in (ckpt / "dist").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    marker = _forge(copy.parent, tmp_path)
    state = model_sharded_state_dict(trainer.model)
    with pytest.raises(UnsafeMetadataError) as info:
        load_dist_checkpoint({"model": state}, copy)
    assert str(info.value).startswith(f"{copy / '.metadata'}: refers to posix.system")
    assert not marker.exists()


def test_forged_metadata_and_manifest_are_refused_on_resume(saved, tmp_path):
    """The forger rewrote ``manifest.json`` too, so verification passes; the restricted
    unpickler still refuses the file."""
    trainer, run, ckpt = saved
    import shutil

    forged_run = tmp_path / "run"
    shutil.copytree(run, forged_run)
    forged = forged_run / "checkpoints" / ckpt.name
    marker = _forge(forged, tmp_path)
    (forged / "manifest.json").unlink()
    write_manifest(forged, [hash_files(forged, list_files(forged))])
    with pytest.raises(UnsafeMetadataError, match="refers to posix.system"):
        load_run_checkpoint(forged, model=trainer.model, optimizer=trainer.optimizer)
    assert not marker.exists()


def test_crafted_metadata_alone_fails_verification(saved, tmp_path):
    trainer, run, ckpt = saved
    import shutil

    copied = tmp_path / "run"
    shutil.copytree(run, copied)
    marker = _forge(copied / "checkpoints" / ckpt.name, tmp_path)
    with pytest.raises(CheckpointVerificationError, match=r"dist/\.metadata"):
        load_run_checkpoint(copied, model=trainer.model, optimizer=trainer.optimizer)
    assert not marker.exists()


def test_a_crafted_checkpoint_object_is_refused_without_running_code(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    marker = tmp_path / "code_ran"
    buffer = io.BytesIO()
    torch.save(_RunsCode(marker), buffer)
    buffer.seek(0)
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("obj"),
        dest_offsets=torch.Size([]),
        storage_index=MetadataIndex("obj"),
        storage_offsets=torch.Size([]),
        lengths=torch.Size([]),
    )
    with restricted_dcp_loading(), pytest.raises(UnsafeMetadataError, match="'obj'"):
        planner.load_bytes(item, buffer)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"a": torch.ones(2)}, plain)
    plain.seek(0)
    with restricted_dcp_loading():
        planner.load_bytes(item, plain)
    assert torch.equal(planner.state_dict["obj"]["a"], torch.ones(2))


def test_torch_still_unpickles_where_the_patch_replaces_it():
    """The patch exists because of these two lines of torch; it must go when they change."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    assert "pickle.load(metadata_file)" in inspect.getsource(FileSystemReader.read_metadata)
    assert "weights_only=False" in inspect.getsource(DefaultLoadPlanner.load_bytes)
    saved = (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes)
    with restricted_dcp_loading():
        assert FileSystemReader.read_metadata is not saved[0]
    assert (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes) == saved
