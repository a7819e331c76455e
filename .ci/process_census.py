"""Where a command's CPU goes, process by process: every process that ends while it runs is recorded by the
kernel's process accounting (``acct(2)``: root only), so nothing is missed, whether it exits, calls ``os._exit``
or is killed. Run as the test suite's command, it also names the test each process belonged to. Accounting
samples a process's CPU at the kernel's ticks, so one short process's figure can be far off on a loaded machine (0.2
recorded for a 0.9 s spin among five busy processes on two cores); a total of many is close (2,153 against the
exact 2,197 for the whole suite), and the exact total is printed beside it.

    python .ci/process_census.py python -m pytest -q -p no:cacheprovider

Prints the CPU-seconds by kind of process (a rank forked from a test launcher's fork server, a fresh Python
interpreter, a pytest-xdist worker, a compiler, ...), then by test file and by test, and exits with the command's
status. A process whose parent ended before it (an orphan) is counted but put on no test. The raw records stay in
``--keep DIR`` when given. The same module is the pytest plugin that logs each test's worker, start and end and the
worker's fork server (``PYTEST_PLUGINS=process_census``, set here).
"""

from __future__ import annotations

import collections
import ctypes
import os
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path

from cpu_seconds import run_reaping  # beside this file

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime, then 8 comp_t
# (utime, stime, mem, io, rw, minflt, majflt, swaps) and the command's name; times in AHZ = 100 ticks a second.
_RECORD = struct.Struct("<BBHIIIIIIf8H16s")
_FORKED = 0x01  # AFORK: forked and never exec'd
_TOOLS = {"cc1plus", "ld", "as", "g++", "gcc", "collect2"}  # inductor's C++ builds
_KIND_ORDER = ["forked rank", "fresh python", "fork server", "xdist worker", "pytest", "compiler", "other"]


def _ticks(comp: int) -> float:
    return ((comp & 0x1FFF) << (3 * ((comp >> 13) & 7))) / 100


def read_records(path: Path) -> list:
    data = path.read_bytes()
    out = []
    for off in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        f = _RECORD.unpack_from(data, off)
        out.append({"flag": f[0], "pid": f[6], "ppid": f[7], "began": f[8], "lasted": f[9] / 100,
                    "cpu": _ticks(f[10]) + _ticks(f[11]), "comm": f[18].split(b"\0")[0].decode(errors="replace")})
    return out


def descendants(records: list, root: int) -> list:
    """The records of ``root``'s descendants: accounting is one per machine and records every process that ends
    while it is on (and ``root`` itself as it turns it off). Each of them has ended by then (``run_reaping``)."""
    by_pid = {r["pid"]: r for r in records}
    mine = {}

    def is_mine(r) -> bool:
        seen = []
        while r["pid"] not in mine and r["ppid"] != root and r["ppid"] in by_pid and len(seen) < 64:
            seen.append(r["pid"])
            r = by_pid[r["ppid"]]
        found = mine.get(r["pid"], r["ppid"] == root)
        for pid in seen:
            mine[pid] = found
        mine[r["pid"]] = found
        return found

    return [r for r in records if r["pid"] != root and is_mine(r)]


def read_tests(folder: Path) -> tuple:
    """{worker pid: [(start, end, nodeid)]} and {fork server pid: worker pid} from the plugin's logs."""
    tests, servers = collections.defaultdict(list), {}
    for path in folder.glob("tests.*.log"):
        for line in path.read_text().splitlines():
            worker, start, end, nodeid, server = line.split("\t")
            tests[int(worker)].append((float(start), float(end), nodeid))
            if server != "None":
                servers[int(server)] = int(worker)
    for runs in tests.values():
        runs.sort()
    return tests, servers


def report(records: list, tests: dict, servers: dict) -> str:
    by_pid = {r["pid"]: r for r in records}
    controllers = {by_pid[w]["ppid"] for w in tests if w in by_pid}  # the process that started the workers

    def worker_of(r):
        for _ in range(20):  # a fork server outlives its worker's record: known from the plugin's log
            if r["pid"] in tests:
                return r["pid"]
            if r["ppid"] in servers:
                return servers[r["ppid"]]
            if r["ppid"] in tests:
                return r["ppid"]
            r = by_pid.get(r["ppid"])
            if r is None:
                return None
        return None

    def kind_of(r):
        if r["pid"] in tests:
            return "xdist worker"
        if r["pid"] in servers:
            return "fork server"
        if r["pid"] in controllers:
            return "pytest"
        if r["comm"] in _TOOLS:
            return "compiler"
        if r["flag"] & _FORKED:  # a process that never exec'd carries its parent's program: Python here
            return "forked rank" if r["ppid"] in servers else "other"
        return "fresh python" if r["comm"].startswith(("python", "pt_", "gloo", "torch", "lightning")) else "other"

    def test_of(r, worker):
        if r["pid"] in tests or r["pid"] in servers or r["pid"] in controllers:
            return "(pytest and its fork servers)"
        # The test whose window the process's life overlaps most; btime is cut to the second, so a process that
        # overlaps none is put on the nearest test within a second.
        began, ended = r["began"], r["began"] + r["lasted"]
        found, most = "(not attributed)", -1.0
        for start, end, nodeid in tests.get(worker, ()):
            overlap = min(end, ended) - max(start, began)
            if overlap > most and overlap > -1:
                found, most = nodeid, overlap
        return found

    kinds, counts = collections.Counter(), collections.Counter()
    by_file, by_test = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for r in records:
        kind, test = kind_of(r), test_of(r, worker_of(r))
        kinds[kind] += r["cpu"]
        counts[kind] += 1
        by_file[test.split("::")[0]][kind] += r["cpu"]
        by_test[test][kind] += r["cpu"]
    total = sum(kinds.values())
    lines = [f"{len(records)} processes, {total:.1f} CPU-s", "", "kind            processes   CPU-s  share"]
    for kind in _KIND_ORDER:
        lines.append(f"{kind:<16}{counts[kind]:>9}{kinds[kind]:>8.1f}{kinds[kind] / max(total, 1e-9):>7.0%}")
    for title, table, n in (("file", by_file, 40), ("test", by_test, 30)):
        lines += ["", f"CPU-s by {title}: total, then " + ", ".join(_KIND_ORDER[:2])]
        for name, c in sorted(table.items(), key=lambda kv: -sum(kv[1].values()))[:n]:
            lines.append(f"{sum(c.values()):8.1f} {c['forked rank']:7.1f} {c['fresh python']:7.1f}  {name}")
    return "\n".join(lines)


def main() -> int:
    if os.environ.get("CENSUS_DIR"):
        sys.exit("process_census: a census is running already (process accounting is one file per machine)")
    argv = sys.argv[1:]
    keep = None
    if argv[:1] == ["--keep"] and len(argv) > 1:
        keep, argv = Path(argv[1]), argv[2:]
    if argv[:1] in ([], ["-h"], ["--help"], ["--keep"]):  # nothing to run: accounting is not turned on
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    folder = keep or Path(tempfile.mkdtemp(prefix="census-"))
    folder.mkdir(parents=True, exist_ok=True)
    accounting = folder / "acct.bin"
    accounting.write_bytes(b"")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(accounting).encode()) != 0:
        sys.exit(f"process_census: acct({accounting}) failed: {os.strerror(ctypes.get_errno())} (it needs root)")
    env = dict(os.environ, CENSUS_DIR=str(folder),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
               PYTEST_PLUGINS=",".join(filter(None, ["process_census", os.environ.get("PYTEST_PLUGINS")])))
    began = time.monotonic()
    try:  # orphans (a fork server outliving pytest) are waited for, so their records are written before it stops
        rc = run_reaping(argv, env)
    finally:
        libc.acct(None)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\nprocess census of {' '.join(argv)} ({time.monotonic() - began:.1f} s; exact CPU of all of it, "
          f"from the kernel's clock: {usage.ru_utime + usage.ru_stime:.1f} s):")
    print(report(descendants(read_records(accounting), os.getpid()), *read_tests(folder)), flush=True)
    return rc


# -- the pytest plugin (loaded in each worker through PYTEST_PLUGINS) --------------------------------------------
_STARTS: dict = {}
_RUNS_TESTS = [False]


def pytest_configure(config):
    """Only the processes that run tests log them (an xdist controller sees every worker's reports too)."""
    _RUNS_TESTS[0] = hasattr(config, "workerinput") or getattr(config.option, "dist", "no") == "no"


def pytest_runtest_logstart(nodeid, location):
    _STARTS[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    import multiprocessing.forkserver

    folder = os.environ.get("CENSUS_DIR")
    if folder and _RUNS_TESTS[0]:
        server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        with open(Path(folder) / f"tests.{os.getpid()}.log", "a") as f:
            f.write(f"{os.getpid()}\t{_STARTS.pop(nodeid, time.time()):.2f}\t{time.time():.2f}\t{nodeid}\t{server}\n")


if __name__ == "__main__":
    sys.exit(main())
