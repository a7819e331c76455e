"""What TCP gets through the shaped veth in the patterns the strategies use.

    python benchmarks/link_probe.py --rate 100 --mbytes 71.5

A replica all-reduce between two hosts sends in both directions at once, one stream per rank pair; DDP's ring one
per direction. Per pattern (k streams host 0 -> 1, and the same back when both directions), one JSON line: the
seconds until every stream's bytes were read on the other side (one figure per sending host,
``twohosts.transfer``), and the efficiency: bytes / rate / seconds (1.0: the link never idled). The hosts are
benchmarks/twohosts.py's namespaces; traffic goes only to their addresses. Needs root, like benchmarks/cluster.py.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from twohosts import TwoHosts, transfer  # noqa: E402

PATTERNS = ((1, False), (1, True), (2, False), (2, True))  # (streams per direction, both directions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s each way (tc tbf)")
    ap.add_argument("--queue-ms", type=float, default=100.0, help="tbf's queue (latency) in ms")
    ap.add_argument("--mbytes", type=float, default=71.5, help="MB per direction (a step's link bytes)")
    args = ap.parse_args()
    nbytes, floor = int(args.mbytes * 1e6), args.mbytes * 8 / args.rate
    with TwoHosts("lp") as hosts:
        hosts.shape(args.rate, args.queue_ms)
        for streams, both in PATTERNS:
            secs = transfer(hosts, nbytes, streams, both)
            print(json.dumps({"streams": streams, "both_directions": both, "rate_mbit": args.rate, "queue_ms": args.queue_ms,
                              "bytes": nbytes,
                              "secs": secs, "floor_s": floor, "efficiency": [floor / x for x in secs]}), flush=True)


if __name__ == "__main__":
    main()
