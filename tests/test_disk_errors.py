"""A full disk is named as a full disk (``checkpoint.disk_errors``): the cause, the file and
the space left, from an errno anywhere in the chain or from the file system itself (a real
small tmpfs where this machine lets us mount one)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from megatron_sat.checkpoint.disk_errors import DiskFullError, named_disk_errors


def test_an_enospc_in_the_chain_is_named(tmp_path):
    (tmp_path / "part.bin").write_bytes(b"x")
    with pytest.raises(DiskFullError) as info:
        with named_disk_errors(tmp_path, "run checkpoint of step 3"):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as e:
                raise RuntimeError("Worker failure: <class 'OSError'>") from e
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(tmp_path / "part.bin")
    assert "disk full while writing the run checkpoint of step 3" in str(info.value)


def test_other_errors_pass_unchanged(tmp_path):
    with pytest.raises(RuntimeError, match="^not the disk$"):
        with named_disk_errors(tmp_path, "x"):
            raise RuntimeError("not the disk")


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"tmpfs mount refused here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_tmpfs_is_named(small_tmpfs):
    with pytest.raises(DiskFullError) as info:
        with named_disk_errors(small_tmpfs, "test file"):
            with open(small_tmpfs / "big.bin", "wb") as f:
                for _ in range(64):
                    f.write(b"x" * 65536)
                    f.flush()
                    os.fsync(f.fileno())
    assert info.value.filename == str(small_tmpfs / "big.bin")
    assert "0 bytes left" in str(info.value)
