"""TCPStores that listen on one address: the trainer's rendezvous stores bind only where the
launch plan needs them.

torch's ``TCPStore`` server binds every interface (``[::]:PORT``, measured with torch 2.13:
``host_name`` only tells clients where to connect), with no authentication: on a single node
any machine that reaches it could write into the rendezvous. Its libuv server also accepts a
socket that is already listening (``master_listen_fd``, torch >= 2.3); ``bound_tcp_store``
binds that socket to the given address first, so the store listens there and nowhere else.

Which address: the one the launch plan chose for ``MASTER_ADDR`` (``launch.render``): loopback
(127.0.0.1) on a single node; the first node's host name, resolved to its cluster interface, on
several. The stores of a run:

- the default process group's (``platform.distributed.init_distributed``): a single process
  hosts a loopback one; ranks started with ``RANK`` and ``MASTER_ADDR`` (srun, mpirun) have rank
  0 host it at ``MASTER_ADDR``; under torchrun the agent hosts it (static rendezvous), bound by
  ``patch_static_rendezvous``, which ``python -m megatron_sat.platform.torchrun`` applies before
  running torchrun (the rendered scripts use it);
- the weight-update group's (``weight_sync.group.host_store``) at ``master_address``, the
  address the servers reach the trainer on (``MASTER_ADDR``, else 127.0.0.1).

What this does not cover: gloo's pair sockets listen on the address gloo derives from the host
name (``GLOO_SOCKET_IFNAME`` picks the interface), and NCCL's bootstrap on
``NCCL_SOCKET_IFNAME``'s; torchrun's c10d rendezvous backend (``--rdzv-backend=c10d``) is not
patched (the rendered scripts use the static one).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` (a name is resolved; its first address is used) and
    ``port`` (0: the OS chooses), listening.

    Raises:
        OSError: naming the address when it cannot be resolved or bound.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise OSError(f"cannot resolve the store address {host!r}: {e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({address[0]}): {e}") from e
    return sock


def bound_tcp_store(
    host: str,
    port: int,
    world_size: int | None,
    timeout: timedelta,
    *,
    wait_for_workers: bool = False,
    multi_tenant: bool = False,
) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host:port`` only (``port`` 0: the OS chooses; read
    it back from ``.port``). The store owns the socket.

    Raises:
        OSError: from ``listening_socket``.
        RuntimeError: from torch (e.g. workers that do not come within ``timeout``).
    """
    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            host,
            bound_port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            master_listen_fd=sock.fileno(),
            use_libuv=True,  # master_listen_fd is the libuv server's
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # libuv closes the descriptor with the store
    return store


def patch_static_rendezvous() -> None:
    """Make torchrun's static rendezvous host its store with ``bound_tcp_store`` (at
    ``--master-addr``), instead of on every interface. Applied by an explicit call, in the
    torchrun agent process only (``platform.torchrun``).

    Why a patch: ``torch.distributed.elastic.rendezvous.static_tcp_rendezvous`` creates its
    ``TCPStore`` with no bind address or listening socket to pass in (torch 2.3 - 2.13); it
    calls ``TCPStore(addr, port, world_size, is_master, timeout, multi_tenant=True)``, the
    signature ``test_stores.py`` pins.
    """
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    original = dist.TCPStore

    def store(host, port, world_size=None, is_master=False, timeout=None, **kwargs: Any):
        if not is_master:
            return original(host, port, world_size, is_master, timeout, **kwargs)
        timeout = timeout if timeout is not None else timedelta(minutes=5)
        return bound_tcp_store(
            host,
            port,
            world_size,
            timeout,
            wait_for_workers=kwargs.get("wait_for_workers", True),  # TCPStore's default
            multi_tenant=kwargs.get("multi_tenant", False),
        )

    static.TCPStore = store
