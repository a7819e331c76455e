"""What TCP gets through the shaped veth in the patterns the strategies use (issue 34).

    python benchmarks/link_probe.py --rate 100 --mbytes 71.5

A replica all-reduce between two hosts sends in both directions at once, one stream per rank pair; DDP's ring one
per direction. Per pattern (k streams host 0 -> 1, and the same back when ``both``), the time until every stream's
bytes were read on the other side, and the efficiency: bytes / rate / time per direction (1.0: the link never
idled), as one JSON line. Host 0 and host 1 are benchmarks/twohosts.py's namespaces; traffic goes only to their addresses. Needs
root, like benchmarks/cluster.py.
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
from tests.helpers.netns import HOSTS  # noqa: E402

PATTERNS = ((1, False), (1, True), (2, False), (2, True))  # (streams per direction, both directions)


def _serve(me: int, port: int, k: int) -> None:
    """Accepts k connections; reads each until its sender closes, then answers one byte."""
    def drain(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")

    with socket.create_server((HOSTS[me], port), backlog=k) as srv:
        threads = [threading.Thread(target=drain, args=(srv.accept()[0],)) for _ in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _send(peer: int, port: int, nbytes: int, out: list, i: int) -> None:
    chunk = b"\0" * (1 << 20)
    for _ in range(200):  # bounded: the peer's server may still be starting
        try:
            conn = socket.create_connection((HOSTS[peer], port), timeout=120)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise RuntimeError(f"host {peer} never accepted on port {port}")
    with conn:
        t0, left = time.perf_counter(), nbytes
        while left > 0:
            conn.sendall(chunk[:min(left, len(chunk))])
            left -= len(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        out[i] = (t0, time.perf_counter())


def node(me: int, k: int, nbytes: int, sends: bool, serves: bool, port: int) -> None:
    """One host: serves the other's streams (if it sends) and sends its own k streams (if ``sends``)."""
    server = threading.Thread(target=_serve, args=(me, port, k))
    if serves:
        server.start()
    time.sleep(0.5)
    if sends:
        out: list = [None] * k
        threads = [threading.Thread(target=_send, args=(1 - me, port, nbytes // k, out, i)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(max(b for _, b in out) - min(a for a, _ in out), flush=True)
    if serves:
        server.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s each way (tc tbf)")
    ap.add_argument("--mbytes", type=float, default=71.5, help="MB per direction (a step's link bytes)")
    args = ap.parse_args()
    from twohosts import TwoHosts

    nbytes = int(args.mbytes * 1e6)
    with TwoHosts("lp") as hosts:
        hosts.shape(args.rate)
        for n, (k, both) in enumerate(PATTERNS):
            procs = [subprocess.Popen(["ip", "netns", "exec", hosts.names[m], sys.executable, __file__, "node",
                                       str(m), str(k), str(nbytes), str(int(m == 0 or both)), str(int(m == 1 or both)),
                                       str(29600 + n)], stdout=subprocess.PIPE, text=True) for m in (0, 1)]
            secs = [float(o) for o in (p.communicate(timeout=600)[0].strip() for p in procs) if o]
            floor = nbytes * 8 / (args.rate * 1e6)
            print(json.dumps({"streams": k, "both_directions": both, "rate_mbit": args.rate, "bytes": nbytes,
                              "secs": secs, "floor_s": floor, "efficiency": [floor / x for x in secs]}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        a = sys.argv[2:]
        node(int(a[0]), int(a[1]), int(a[2]), a[3] == "1", a[4] == "1", int(a[5]))
    else:
        main()
