"""The trainer listens only where the launch plan needs it (``platform.stores``): its TCPStores
bind one address, torchrun's agent store too (``platform.torchrun``), and a single-node run has
no listening socket on a non-loopback address (read from /proc/net/tcp{,6}, like ``ss -ltn``)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import make_tiny_checkpoint

from megatron_sat.platform.stores import bound_tcp_store, listening_socket
from megatron_sat.rollout.arith import make_arith_splits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net")


def _decode(hex_address: str) -> tuple[str, int]:
    """/proc/net/tcp's ``0100007F:1F90`` -> ("127.0.0.1", 8080); tcp6's 32 hex digits too."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1]), int(port, 16)
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # little-endian 32-bit words
    return ":".join(b.hex() for b in words), int(port, 16)


def _loopback(host: str) -> bool:
    if "." in host:
        return host.startswith("127.")
    plain = host.replace(":", "")
    # ::1, or an IPv4-mapped loopback ::ffff:127.x.y.z
    return plain == "0" * 31 + "1" or (plain[:24] == "0" * 20 + "ffff" and plain[24:26] == "7f")


def listening(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets of process ``pid`` in state LISTEN, as (address, port)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                out.append(_decode(fields[1]))
    return out


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (any session)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def exposed(pid: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket of ``pid``'s tree off loopback."""
    found = []
    for p in _tree(pid):
        try:
            found += [(p, host, port) for host, port in listening(p) if not _loopback(host)]
        except OSError:  # ended meanwhile
            continue
    return found


def test_decode_reads_proc_net_addresses():
    assert _decode("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _decode("00000000:0016") == ("0.0.0.0", 22)
    assert _decode("00000000000000000000000000000000:0050")[1] == 80
    assert _loopback("127.0.0.1") and not _loopback("0.0.0.0")
    assert _loopback(_decode("00000000000000000000000001000000:0001")[0])  # ::1
    assert not _loopback(_decode("00000000000000000000000000000000:0001")[0])  # ::


def test_torch_store_binds_everywhere_ours_binds_loopback():
    """The reason for the module: torch's server listens on [::]; ours on 127.0.0.1 only, and
    serves clients."""
    theirs = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    ours = bound_tcp_store("127.0.0.1", 0, 2, timedelta(seconds=30))
    mine = dict((port, host) for host, port in listening(os.getpid()))
    assert not _loopback(mine[theirs.port])
    assert mine[ours.port] == "127.0.0.1"
    client = dist.TCPStore(
        "127.0.0.1", ours.port, 2, is_master=False, timeout=timedelta(seconds=30)
    )
    client.set("k", "v")
    assert ours.get("k") == b"v"


def test_an_unbindable_address_is_named():
    with pytest.raises(OSError, match="cannot listen on 192.0.2.1:0"):
        listening_socket("192.0.2.1", 0)  # TEST-NET-1: not this machine's


def test_static_rendezvous_still_calls_tcpstore_as_patched():
    """``patch_static_rendezvous`` replaces the name ``TCPStore`` of torch's static rendezvous
    and relies on its call; this fails when torch changes either."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    source = inspect.getsource(static.StaticTCPRendezvous.next_rendezvous)
    assert "self._store = TCPStore(" in source
    assert "is_master,\n                self.timeout,\n                multi_tenant=True" in source


WORKER = textwrap.dedent(
    """
    import os, time, torch, torch.distributed as dist
    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.training.stop import StopRequest
    init_distributed(ParallelConfig())
    t = torch.ones(1)
    dist.all_reduce(t)
    stop = StopRequest()
    with stop.installed():
        os.write(1, f"SUM {t.item()}\\n".encode())  # one write: the ranks share the pipe
        deadline = time.time() + 120
        while not stop.requested and time.time() < deadline:
            time.sleep(0.05)
    os.write(1, f"STOP {stop.signal_name}\\n".encode())
    dist.barrier()
    """
)


def test_torchrun_agent_listens_on_loopback_and_passes_sigusr1_on(tmp_path):
    """Under ``python -m megatron_sat.platform.torchrun`` (2 ranks) no process of the job
    listens off loopback (the agent's store is at 127.0.0.1:MASTER_PORT), and SIGUSR1 to the
    agent reaches both ranks' stop handlers; the job then exits 0."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    with socket_port() as port:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_sat.platform.torchrun",
                "--nnodes=1",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(script),
            ],  # fmt: skip
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    lines = []
    while len(lines) < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        if line.startswith("SUM"):
            lines.append(line)
    seen = exposed(proc.pid)
    sockets = [s for p in _tree(proc.pid) for s in listening_or_none(p)]
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert all(line.split()[1] == "2.0" for line in lines)
    assert ("127.0.0.1", port) in sockets  # the agent's store is there, bound to loopback
    assert seen == []
    assert out.count("STOP SIGUSR1") == 2


class socket_port:
    """A free loopback port (closed again on entry: torchrun binds it itself)."""

    def __enter__(self) -> int:
        with listening_socket("127.0.0.1", 0) as sock:
            return sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass


@pytest.mark.slow
def test_single_node_run_listens_on_loopback_only(tmp_path):
    """A 3-step ``megatron-sat train`` with an embedded server: every listening socket of the
    trainer and its children (server, reward workers, checkpoint writers), sampled through
    the run, is on a loopback address."""
    checkpoint = make_tiny_checkpoint(tmp_path / "init", seed=2)
    data = tmp_path / "data"
    data.mkdir()
    train, test = make_arith_splits(16, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_sat.cli",
            "train",
            f"init_checkpoint={checkpoint}",
            f"run_dir={tmp_path / 'run'}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'test.jsonl'}",
            "data.num_eval_prompts=4",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "rollout.eval_samples_per_prompt=2",
            "train.num_steps=3",
            "train.save_every=2",
            "train.micro_batch_size=16",
        ],  # fmt: skip
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen, samples, ports = set(), 0, set()
    while proc.poll() is None:
        seen.update(exposed(proc.pid))
        ports.update(port for p in _tree(proc.pid) for _, port in listening_or_none(p))
        samples += 1
        time.sleep(0.2)
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]
    assert samples > 10 and len(ports) >= 3  # it did see the stores and the server listen
    assert seen == set()


def listening_or_none(pid: int) -> list[tuple[str, int]]:
    try:
        return listening(pid)
    except OSError:
        return []
