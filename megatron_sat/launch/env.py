"""Rank discovery: torch.distributed's ``env://`` variables from whichever launcher ran us.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
mpirun does not: Open MPI sets ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``
and MPICH / Intel MPI (Hydra) ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``. The rendered
mpirun script exports ``MASTER_ADDR``/``MASTER_PORT`` (``-x``); the mapping needs no mpi4py.
"""

from __future__ import annotations

from collections.abc import MutableMapping

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

# source name -> (rank, size, local rank, local size) variables; local size may be absent.
MPI_KEYS = {
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "hydra": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def resolve_rank_env(environ: MutableMapping[str, str]) -> str:
    """Fill ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``) in ``environ``
    from an MPI launcher's variables when torchrun's are absent; called once at process start
    by the ``train`` and ``eval`` commands, before torch.distributed is initialised.

    Args:
        environ: the process environment (``os.environ``), updated in place.

    Returns:
        "torchrun" (its variables were already there), "openmpi", "hydra", or "single" (no
        launcher: one process; ``init_distributed`` makes a world of 1).

    Raises:
        ValueError: when only some of torchrun's variables are set, when they are set next to
            an MPI launcher's without torchrun having set them (stale), when an MPI launcher's
            variables are incomplete or not integers, or when an MPI world lacks
            ``MASTER_ADDR``/``MASTER_PORT`` (naming the missing variable).
    """
    present = [k for k in TORCHRUN_KEYS if k in environ]
    mpi = [keys[0] for keys in MPI_KEYS.values() if keys[0] in environ]
    if present:
        missing = [k for k in TORCHRUN_KEYS if k not in environ]
        if missing:
            raise ValueError(f"environment has {present} but not {missing}: set all or none")
        if mpi and "TORCHELASTIC_RUN_ID" not in environ:
            # torchrun started by mpirun sets TORCHELASTIC_RUN_ID; without it, RANK & co. came
            # from the caller's environment and every MPI rank would believe it is that rank.
            raise ValueError(
                f"{present} are set, not by torchrun, and so is {mpi[0]}: stale variables "
                "inherited by the MPI ranks; unset RANK, WORLD_SIZE and LOCAL_RANK before mpirun"
            )
        return "torchrun"
    for source, (rank_key, size_key, local_key, local_size_key) in MPI_KEYS.items():
        if rank_key not in environ:
            continue
        values = {}
        for key in (rank_key, size_key, local_key):
            if key not in environ:
                raise ValueError(f"{source}: {rank_key} is set but {key} is not")
            try:
                values[key] = int(environ[key])
            except ValueError:
                raise ValueError(f"{source}: {key}={environ[key]!r} is not an integer") from None
        rank, size, local = values[rank_key], values[size_key], values[local_key]
        if not 0 <= rank < size or not 0 <= local <= rank:
            raise ValueError(f"{source}: rank {rank}, size {size}, local rank {local} disagree")
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if not environ.get(key):
                raise ValueError(
                    f"{source} launched {size} processes but {key} is not set: export it to "
                    "every rank (mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=<port>)"
                )
        environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local))
        if local_size_key in environ:
            environ["LOCAL_WORLD_SIZE"] = environ[local_size_key]
        return source
    return "single"
