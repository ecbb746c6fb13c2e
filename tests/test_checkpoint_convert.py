"""The conversion CLI in one process (TP = EP = PP = 1): HF -> megatron-core dist checkpoint ->
HF is bitwise, with index, config.json and tokenizer files; no silent overwrite; a missing,
extra or mis-shaped tensor fails naming it. Sharded layouts: test_checkpoint_parallel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_sat.checkpoint import convert
from megatron_sat.checkpoint.hf_io import read_hf_tensors
from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, megatron_world):
    from megatron_sat.rollout.tokenizer import build_char_tokenizer

    path = make_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("dsv3"), seed=5)
    build_char_tokenizer().save_pretrained(path)
    return path


def run(*argv: str) -> int:
    return convert.main([*argv, "--no-progress"])


def test_hf_to_mcore_to_hf_is_bitwise(hf_dir, tmp_path):
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    assert run("hf-to-mcore", "--hf-dir", str(hf_dir), "--out-dir", str(mcore)) == 0
    assert (mcore / "metadata.json").exists() and (mcore / "hf_config.json").exists()
    assert (mcore / "tokenizer" / "tokenizer.json").exists()
    assert run("mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(out)) == 0
    original, written = read_hf_tensors(hf_dir), read_hf_tensors(out)
    assert sorted(written) == sorted(original)
    assert all(
        torch.equal(written[k], v) and written[k].dtype == v.dtype for k, v in original.items()
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in original.values())
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    assert (out / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()


def test_outputs_are_never_overwritten_without_the_flag(hf_dir, tmp_path):
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    run("hf-to-mcore", "--hf-dir", str(hf_dir), "--out-dir", str(mcore))
    stamp = (mcore / "metadata.json").stat().st_mtime_ns
    with pytest.raises(FileExistsError, match="--overwrite"):
        run("hf-to-mcore", "--hf-dir", str(hf_dir), "--out-dir", str(mcore))
    assert (mcore / "metadata.json").stat().st_mtime_ns == stamp
    run("hf-to-mcore", "--hf-dir", str(hf_dir), "--out-dir", str(mcore), "--overwrite")
    run("mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(out))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        run("mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(out))
    run("mcore-to-hf", "--mcore-dir", str(mcore), "--out-dir", str(out), "--overwrite")
    assert (out / "notes.txt").read_text() == "mine"  # only checkpoint files are replaced
    # --overwrite never deletes a directory that is not a megatron-core checkpoint.
    with pytest.raises(FileExistsError, match="not a megatron-core checkpoint"):
        run("hf-to-mcore", "--hf-dir", str(hf_dir), "--out-dir", str(out), "--overwrite")
    assert (out / "notes.txt").exists()


def _broken_copy(src: Path, dst: Path, change) -> Path:
    dst.mkdir()
    tensors = read_hf_tensors(src)
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize(
    ("what", "change", "message"),
    [
        (
            "missing",
            lambda t: t.pop("model.layers.1.mlp.experts.5.down_proj.weight"),
            r"missing \['model.layers.1.mlp.experts.5.down_proj.weight'\]",
        ),
        (
            "extra",
            lambda t: t.update({"model.layers.2.mlp.gate.weight": torch.zeros(8, 32)}),
            r"unused \['model.layers.2.mlp.gate.weight'\]",
        ),
        (
            "mis-shaped",
            lambda t: t.update({"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(56, 13)}),
            r"mis-shaped \['model.layers.0.self_attn.kv_b_proj.weight'\]",
        ),
    ],
)
def test_conversion_names_the_bad_tensor(hf_dir, tmp_path, what, change, message):
    broken = _broken_copy(hf_dir, tmp_path / what, change)
    with pytest.raises(ValueError, match=message):
        run("hf-to-mcore", "--hf-dir", str(broken), "--out-dir", str(tmp_path / "out"))


def test_tool_script_is_the_same_cli():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "mcore-to-hf", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "--overwrite" in result.stdout and "--max-shard-size" in result.stdout


def test_megatron_core_workarounds_still_target_upstream_code():
    """Fails when megatron-core moves what our two CPU workarounds patch (see their docs)."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from megatron_sat.checkpoint.dist_ckpt import apply_dist_checkpointing_fixes

    assert hasattr(filesystem_async, "HAVE_PSUTIL")
    assert "_process_memory()" in inspect.getsource(filesystem_async)
    apply_dist_checkpointing_fixes()
    assert isinstance(filesystem_async._process_memory(), int)
    # models.registry._tensor_cuda_is_identity_on_cpu exists for this call (tied, PP > 1).
    assert "weight.data.cuda()" in inspect.getsource(
        LanguageModule.setup_embeddings_and_output_layer
    )


def test_tensors_can_be_dropped_only_explicitly(hf_dir, tmp_path, capsys):
    """A DeepSeek-V3 multi-token-prediction layer (``model.layers.<num_hidden_layers>``) is not
    built: its tensors fail the conversion unless dropped by name."""
    mtp = {
        "model.layers.2.eh_proj.weight": torch.zeros(32, 64),
        "model.layers.2.enorm.weight": torch.ones(32),
    }
    broken = _broken_copy(hf_dir, tmp_path / "mtp", lambda t: t.update(mtp))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape(str(sorted(mtp)))):
        run("hf-to-mcore", "--hf-dir", str(broken), "--out-dir", str(out))
    run(
        "hf-to-mcore",
        "--hf-dir",
        str(broken),
        "--out-dir",
        str(out),
        "--drop-hf-tensors",
        r"model\.layers\.2\..*",
    )
    assert "dropping 2 HF tensors" in capsys.readouterr().out
    with pytest.raises(ValueError, match="matches no tensor"):
        run(
            "hf-to-mcore",
            "--hf-dir",
            str(hf_dir),
            "--out-dir",
            str(tmp_path / "o2"),
            "--drop-hf-tensors",
            "nothing",
        )
