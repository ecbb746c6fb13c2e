"""A full disk named as a full disk.

megatron-core's checkpoint writer reports a worker's ``OSError`` as ``RuntimeError: Worker
failure: An error is caught while starting worker 0, error: <class 'OSError'>`` inside torch's
``CheckpointException`` (megatron-core 0.19, reproduced on a 1.4 MB tmpfs): the errno and the
file are lost. ``named_disk_errors`` turns any failure of a block that writes into ``folder``
into :class:`DiskFullError` when the disk is the cause: an ``OSError`` with ``ENOSPC`` or
``EDQUOT`` anywhere in the exception's chain or text, or less than ``FULL_BELOW_BYTES`` left on
``folder``'s file system after the failure.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

FULL_BELOW_BYTES = 1 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """Writing ``filename`` failed because its file system is full (or over quota)."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _full(error: BaseException, folder: Path) -> bool:
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    return existing is not None and shutil.disk_usage(existing).free < FULL_BELOW_BYTES


def _newest_file(folder: Path) -> Path:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else folder


@contextlib.contextmanager
def named_disk_errors(folder: str | Path, what: str) -> Iterator[None]:
    """Run the block; a failure caused by a full disk is raised as :class:`DiskFullError`
    naming ``what`` (e.g. "run checkpoint of step 12"), the file written last under
    ``folder`` and the space left.

    Raises:
        DiskFullError: from the original error, when the disk is full.
    """
    folder = Path(folder)
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if not _full(e, folder):
            raise
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        raise DiskFullError(
            errno.ENOSPC,
            f"disk full while writing the {what} ({free} bytes left on the file system of "
            f"{existing}); nothing committed, the previous checkpoints are intact",
            str(_newest_file(folder)),
        ) from e
