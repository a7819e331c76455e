"""Two hosts on one machine for benchmarks: namespaces over a shaped veth, its byte counters read from outside.

Two network namespaces joined by a veth pair (tests/helpers/netns.py, loopback-range addresses:
[Note: loopback-range hosts] there) act as two hosts. Each namespace holds one idle ``sleep`` process from start to end,
so that the counters of its veth end can be read from the root namespace at any time through
``/proc/<pid>/net/dev`` (the same device statistics as ``/sys/class/net/<if>/statistics`` inside the namespace:
both are ``dev_get_stats``). A veth end's ``tx_bytes`` is what that host sent to the other: every byte between
the hosts, headers included, and nothing else (intra-host traffic stays on the namespace's loopback).

[Note: step marks]
Bytes are attributed to the timed window, not by sampling: at the end of the warm-up's last step and of the last
step every rank enters a barrier, rank 0 then asks this process (``StepMarks``, a Unix socket: a path in
the shared filesystem, reachable from any network namespace) to read both counters, waits for the answer, and a
second barrier releases all ranks. The window's bytes over its steps are the bytes per step (traffic in flight at
a mark, as ``mics_host_os``'s all-gathers after a step, splits about alike at both ends). The steps between
run as a user's loop runs, with no handshake: a schedule whose traffic crosses the step's end (``mics_host_os``
all-gathers the updated rows after the step, for the next forward) would otherwise send during a handshake that
no step time counts. (Until 2026-11-27 every step had one: ``mics_host_os``'s took 0.20-0.26 s, its
all-gathers on the link throughout, against 0.03-0.14 s for ``fsdp2_hsdp`` and ``mics_host``, median per run,
three runs at 100 Mbit/s.) The step after the warm-up's handshake runs untimed before the timed ones; its bytes
count in the window's mean.

The link is shaped on both ends' egress with ``tc tbf`` (rate only; the kernel of benchmarks/LOG.md has no
netem qdisc), so each direction carries at most the rate. :func:`transfer` measures what TCP really gets
through the shaped link (:func:`probe`: one stream, one way). The namespaces (and with them the veth and its
qdiscs) are deleted on exit whatever happens.
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


def per_step(marks: Dict[int, Tuple[int, int]], first: int, last: int, before: Optional[int] = None,
             ) -> List[Tuple[int, int]]:
    """Bytes each direction carried in steps ``first..last`` (host 0 -> 1, host 1 -> 0), from the counters read at
    the end of each step and of step ``before`` (default: the step before ``first``)."""
    prev = [first - 1 if before is None else before] + list(range(first, last))
    return [(marks[k][0] - marks[p][0], marks[k][1] - marks[p][1]) for p, k in zip(prev, range(first, last + 1))]


def tbf_args(rate_mbit: float, queue_ms: float = 100.0) -> List[str]:
    """The tbf qdisc for ``rate_mbit``: a bucket of 4 ms at the rate (at least 64 KiB, so that one GSO packet of
    the veth fits) and a queue of ``queue_ms`` (how long a packet may wait: tbf's ``latency``)."""
    if not queue_ms > 0:
        raise ValueError(f"queue_ms={queue_ms!r}: allowed is a time in milliseconds > 0")
    burst = max(65536, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{queue_ms:g}ms"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def check_sysctl(settings: Sequence[str]) -> None:
    """Only ``net.<key>=<value>``: a setting each namespace holds for itself, so the machine's stay as they are."""
    for setting in settings:
        if not setting.startswith("net.") or "=" not in setting:
            raise ValueError(f"sysctl {setting!r}: allowed is net.<key>=<value> (a namespace's own setting)")


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

    def sysctl(self, settings: Sequence[str]) -> None:
        """``key=value`` kernel settings in both namespaces (``net.*``: each namespace has its own, the machine's
        are untouched), e.g. ``net.ipv4.tcp_slow_start_after_idle=0``."""
        check_sysctl(settings)
        for setting in settings:
            for ns in self.names:
                r = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", setting], capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"sysctl {setting} in {ns}: {r.stderr.strip()}")

    def shape(self, rate_mbit: float, queue_ms: float = 100.0) -> None:
        """Both ends' egress limited to ``rate_mbit`` with tbf and a queue of ``queue_ms``; 0: no qdisc (the veth
        as it is)."""
        for ns in self.names:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", ns, "root"], capture_output=True)
            if rate_mbit:
                r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns, "root",
                                    *tbf_args(rate_mbit, queue_ms)], capture_output=True, text=True)
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


# -- what TCP gets through the shaped link ------------------------------------------------------------------------
def _host(me: int, streams: int, nbytes: int, sends: bool, serves: bool, port: int) -> None:
    """One host of :func:`transfer`: listens for the other host's ``streams`` connections (if ``serves``; each is
    read until its sender closes, then answered with one byte), says "ready", and on "go" from its parent sends
    ``nbytes`` over ``streams`` connections of its own (if ``sends``), printing the seconds from the first byte
    sent until the other host has read them all."""
    srv = socket.create_server((HOSTS[me], port), backlog=streams) if serves else None

    def drain() -> None:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")

    def send(n: int, i: int) -> None:
        chunk = b"\0" * (1 << 20)
        with socket.create_connection((HOSTS[1 - me], port), timeout=120) as conn:
            start = time.perf_counter()
            left = n
            while left > 0:
                conn.sendall(chunk[:min(left, len(chunk))])
                left -= len(chunk)
            conn.shutdown(socket.SHUT_WR)
            if conn.recv(1) == b"k":  # else the other host never read it all: no figure, and a failed run
                times[i] = start

    print("ready", flush=True)
    sys.stdin.readline()
    drains = [threading.Thread(target=drain) for _ in range(streams if serves else 0)]
    for t in drains:
        t.start()
    if sends:
        times: List[Optional[float]] = [None] * streams
        senders = [threading.Thread(target=send, args=(nbytes // streams + (i < nbytes % streams), i))
                   for i in range(streams)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        if None in times:
            sys.exit(f"host {me}: a stream to host {1 - me} did not complete")
        print(time.perf_counter() - min(t for t in times if t is not None), flush=True)
    for t in drains:
        t.join()
    if srv is not None:
        srv.close()


def transfer(hosts: TwoHosts, nbytes: int, streams: int = 1, both: bool = False, port: int = 29490) -> List[float]:
    """Seconds to move ``nbytes`` from host 0 to host 1 over ``streams`` TCP connections (and at the same time
    from host 1 to host 0 when ``both``), over the link as it is shaped now: one figure per sending host."""
    me = [sys.executable, str(Path(__file__).resolve()), "host"]
    procs = [subprocess.Popen(["ip", "netns", "exec", hosts.names[m], *me, str(m), str(streams), str(nbytes),
                               str(int(m == 0 or both)), str(int(m == 1 or both)), str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for m in (0, 1)]
    try:
        for p in procs:  # both listening before either sends
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:  # both told before either is waited for: each host drains what the other sends
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=300)[0].strip() for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"transfer over the link failed: exit codes {[p.returncode for p in procs]}")
        return [float(o) for o in outs if o]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def probe(hosts: TwoHosts, nbytes: int, port: int = 29490) -> float:
    """Mbit/s of one TCP stream from host 0 to host 1 over the link as it is shaped now."""
    return nbytes * 8 / transfer(hosts, nbytes, port=port)[0] / 1e6


if __name__ == "__main__" and sys.argv[1] == "host":
    a = sys.argv[2:]
    _host(int(a[0]), int(a[1]), int(a[2]), a[3] == "1", a[4] == "1", int(a[5]))
