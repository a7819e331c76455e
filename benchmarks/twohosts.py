"""Two hosts on one machine for benchmarks: namespaces over a shaped veth, its byte counters read from outside.

Two network namespaces joined by a veth pair (tests/helpers/netns.py, loopback-range addresses: [Note:
loopback-range hosts] there) act as two hosts. Each namespace holds one idle ``sleep`` process from start to end,
so that the counters of its veth end can be read from the root namespace at any time through
``/proc/<pid>/net/dev`` (the same device statistics as ``/sys/class/net/<if>/statistics`` inside the namespace:
both are ``dev_get_stats``). A veth end's ``tx_bytes`` is what that host sent to the other: every byte between
the hosts, headers included, and nothing else (intra-host traffic stays on the namespace's loopback).

[Note: step marks]
Bytes are attributed to optimizer steps exactly, not by sampling: at each step end every rank enters a barrier,
rank 0 then asks this process (``StepMarks``, a Unix socket: a path in the shared filesystem, reachable from any
network namespace) to read both counters, waits for the answer, and a second barrier releases all ranks. Between
the barriers no rank is inside a collective of either step, so the link is quiet while the counters are read;
the ranks leave the handshake out of their step times.

The link is shaped on both ends' egress with ``tc tbf`` (rate only; the kernel of benchmarks/RESULTS.md has no
netem qdisc), so each direction carries at most the rate. :func:`probe` measures what one TCP stream really gets
through the shaped link. The namespaces (and with them the veth and its qdiscs) are deleted on exit whatever
happens.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.helpers.netns import HOSTS, join  # noqa: E402

def parse_net_dev(text: str, iface: str) -> Tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``iface`` from the text of ``/proc/net/dev``."""
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == iface:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise KeyError(f"interface {iface!r} not in /proc/net/dev")


def per_step(marks: Dict[int, Tuple[int, int]], first: int, last: int) -> List[Tuple[int, int]]:
    """Bytes each direction carried in steps ``first..last`` (host 0 -> 1, host 1 -> 0), from the counters read at
    the end of each step and of the step before ``first``."""
    return [(marks[k][0] - marks[k - 1][0], marks[k][1] - marks[k - 1][1]) for k in range(first, last + 1)]


def tbf_args(rate_mbit: float) -> List[str]:
    """The tbf qdisc for ``rate_mbit``: a bucket of 4 ms at the rate (at least 64 KiB, so that one GSO packet of
    the veth fits) and a queue of 100 ms."""
    burst = max(65536, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class TwoHosts:
    """``with TwoHosts(tag) as hosts:`` two namespaces ``<tag>a`` and ``<tag>b`` joined by a veth, deleted on exit."""

    def __init__(self, tag: str) -> None:
        self.names = [f"{tag}a", f"{tag}b"]  # the veth ends carry the same names (<= 15 characters)
        self._made: List[str] = []
        self._holders: List[subprocess.Popen] = []

    def __enter__(self) -> "TwoHosts":
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
                self._made.append(ns)
            join(self.names)
            for ns in self.names:
                self._holders.append(subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "infinity"]))
            self.counters()  # the holders' /proc/<pid>/net/dev shows the namespaces' devices (retries while exec runs)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self._holders:
            p.kill()
            p.wait()
        for ns in self._made:
            _ip("netns", "del", ns, check=False)  # takes its end of the veth (and the qdisc) with it
        self._holders, self._made = [], []

    def counters(self) -> Tuple[int, int]:
        """tx bytes of each host's veth end, read from outside the namespaces."""
        out = []
        for ns, holder in zip(self.names, self._holders):
            for _ in range(200):
                try:
                    out.append(parse_net_dev(Path(f"/proc/{holder.pid}/net/dev").read_text(), ns)[1])
                    break
                except KeyError:  # `ip netns exec` has not entered the namespace yet
                    time.sleep(0.01)
            else:
                raise RuntimeError(f"namespace {ns}: its veth end never showed in /proc/{holder.pid}/net/dev")
        return out[0], out[1]

    def shape(self, rate_mbit: float) -> None:
        """Both ends' egress limited to ``rate_mbit`` with tbf; 0: no qdisc (the veth as it is)."""
        for ns in self.names:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ns, "root"], capture_output=True)
            if rate_mbit:
                r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns, "root",
                                    *tbf_args(rate_mbit)], capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"tc tbf on {ns}: {r.stderr.strip()}")

    def torchrun(self, script: Sequence[str], port: int, log_dir: Path, env: Optional[Dict[str, str]] = None,
                 ) -> List[subprocess.Popen]:
        """``torchrun --nnodes 2 --nproc-per-node 2`` in each namespace (static rendezvous on host 0's address);
        gloo binds to the veth, so every byte between the ranks of different hosts crosses it."""
        procs = []
        for node, ns in enumerate(self.names):
            e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                     GLOO_SOCKET_IFNAME=ns, **(env or {}))
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
                e.pop(k, None)
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", HOSTS[0],
                   "--master-port", str(port), *script]
            log = open(log_dir / f"host{node}.log", "w")
            procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        return procs


class StepMarks:
    """Reads a counter pair whenever rank 0 asks ([Note: step marks]): ``with StepMarks(hosts, path) as marks``,
    then ``marks.marks`` (step -> ``counters()``). Protocol: one line ``<step>\\n`` per request, answered ``ok\\n``
    once read. ``source`` is anything with a ``counters()`` method."""

    def __init__(self, source: Any, path: Path) -> None:
        self.source, self.path = source, Path(path)
        self.marks: Dict[int, Tuple[int, int]] = {}
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.path))
        self._server.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        try:
            conn, _ = self._server.accept()
        except OSError:  # closed before anyone connected (the run failed early)
            return
        with conn, conn.makefile("rw") as f:
            for line in f:
                self.marks[int(line)] = self.source.counters()
                f.write("ok\n")
                f.flush()

    def __enter__(self) -> "StepMarks":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.marks:  # nobody connected (the run failed early): wake ``accept`` with an empty connection
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                try:
                    wake.connect(str(self.path))
                except OSError:
                    pass
        self._thread.join(timeout=10)
        self._server.close()
        self.path.unlink(missing_ok=True)


def ask_mark(path: str, step: int, conn: Optional[socket.socket] = None) -> socket.socket:
    """Rank 0's side of :class:`StepMarks`: asks for the counters at the end of ``step``; returns the connection
    to use next time."""
    if conn is None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(60)
        conn.connect(path)
    conn.sendall(f"{step}\n".encode())
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = conn.recv(16)
        if not chunk:
            raise ConnectionError(f"step marks at {path}: closed before answering step {step}")
        answer += chunk
    return conn


# -- what one TCP stream gets through the shaped link ----------------------------------------------------------
def _serve(port: int) -> None:
    """Host 1: accepts one connection, reads until it closes its sending side, answers with one byte."""
    with socket.create_server((HOSTS[1], port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


def _send(port: int, nbytes: int) -> None:
    """Host 0: sends ``nbytes`` to host 1 and prints the seconds until host 1 has read them all."""
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((HOSTS[1], port), timeout=120) as conn:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            conn.sendall(chunk[:min(left, len(chunk))])
            left -= len(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        print(time.perf_counter() - t0, flush=True)


def probe(hosts: TwoHosts, nbytes: int, port: int = 29490) -> float:
    """Mbit/s of one TCP stream from host 0 to host 1 over the link as it is shaped now."""
    me = [sys.executable, str(Path(__file__).resolve())]
    server = subprocess.Popen(["ip", "netns", "exec", hosts.names[1], *me, "serve", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        out = subprocess.run(["ip", "netns", "exec", hosts.names[0], *me, "send", str(port), str(nbytes)],
                             capture_output=True, text=True, timeout=300, check=True).stdout
        return nbytes * 8 / float(out) / 1e6
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(int(sys.argv[2]))
    elif sys.argv[1] == "send":
        _send(int(sys.argv[2]), int(sys.argv[3]))
