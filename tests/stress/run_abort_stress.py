"""Driver: runs tests/stress/abort_repro.py N times in a row, as a user would (`python abort_repro.py`).

For each run it records rank 0's exit status (what the user's shell sees), the exit status of the rank that
Lightning's launcher started (this driver makes itself a child subreaper, so the orphaned or zombie rank-1
process is re-parented to it and can be reaped), whether "terminate called" appears in the output, and the
last lines of output. Every run is bounded by --timeout; on timeout the whole process group is killed.

    python tests/stress/run_abort_stress.py --strategy mics --runs 50 --logdir /tmp/stress-mics
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "abort_repro.py"
PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def _reap_orphans(deadline: float) -> list:
    """Exit statuses of re-parented descendants (the launched ranks), waiting until none is left."""
    codes = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return codes
        if pid == 0:
            if time.monotonic() > deadline:
                return codes + ["timeout"]
            time.sleep(0.05)
            continue
        codes.append(os.waitstatus_to_exitcode(status))


def run_once(strategy: str, timeout: float, extra_env: dict, script: Path, cwd=None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra_env)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), strategy], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)  # returns once every rank has closed the pipe
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    others = _reap_orphans(time.monotonic() + 10)
    text = out.decode(errors="replace")
    return {
        "rc": proc.returncode, "other_rcs": others, "timed_out": timed_out,
        "terminate": "terminate called" in text, "seconds": round(time.monotonic() - t0, 1),
        "tail": text.strip().splitlines()[-4:], "output": text,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="mics", choices=["mics", "ddp"])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--logdir", type=Path, default=None, help="keeps each failing run's full output here")
    ap.add_argument("--script", type=Path, default=SCRIPT)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the runs (repeatable)")
    ap.add_argument("--core", action="store_true",
                    help="ulimit -c unlimited for the runs; each run's cwd is LOGDIR/runNNN (kept on failure), so a "
                         "core file lands there (with core_pattern 'core')")
    ap.add_argument("--hashseed-per-run", action="store_true",
                    help="PYTHONHASHSEED=<run index> (+ --hashseed-base), to make a failing run repeatable")
    ap.add_argument("--hashseed-base", type=int, default=0)
    args = ap.parse_args(argv)
    if args.core:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert args.logdir, "--core needs --logdir"
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    subreaper = _become_subreaper()
    if args.logdir:
        args.logdir.mkdir(parents=True, exist_ok=True)
    failures = 0
    for i in range(args.runs):
        cwd = None
        if args.core:
            cwd = args.logdir / f"run{i:03d}"
            cwd.mkdir(parents=True, exist_ok=True)
        env = dict(extra_env)
        if args.hashseed_per_run:
            env["PYTHONHASHSEED"] = str(args.hashseed_base + i)
        r = run_once(args.strategy, args.timeout, env, args.script, cwd)
        bad = r["rc"] != 0 or r["timed_out"] or r["terminate"] or any(c != 0 for c in r["other_rcs"])
        failures += bad
        print(json.dumps({"run": i, "strategy": args.strategy, "hashseed": env.get("PYTHONHASHSEED"), "rc": r["rc"], "launched_rank_rcs": r["other_rcs"],
                          "terminate_called": r["terminate"], "timed_out": r["timed_out"], "s": r["seconds"],
                          **({"tail": r["tail"]} if bad else {})}), flush=True)
        if args.logdir and bad:
            (args.logdir / f"run{i:03d}.log").write_text(r["output"])
        if cwd is not None and not bad:
            shutil.rmtree(cwd, ignore_errors=True)
    print(f"SUMMARY strategy={args.strategy} runs={args.runs} failures={failures} "
          f"ok={args.runs - failures}/{args.runs} subreaper={subreaper}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
