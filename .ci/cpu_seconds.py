"""CPU-seconds of a command and everything it starts, however the machine is loaded: the command runs under this
process as a child subreaper, so every descendant (xdist workers, forkserver ranks, torchrun's agents, a rank that
outlives its parent) is reaped here and counted in RUSAGE_CHILDREN.

    python .ci/cpu_seconds.py python -m pytest -q -n 0 tests/fault_tolerance

Prints ``cpu_s=<user+sys> wall_s=<wall> rc=<exit code>`` as its last line and exits with the command's status.
"""

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def run_reaping(argv, env=None) -> int:
    """Runs ``argv`` as a child subreaper and waits for it and every orphan it leaves; returns its exit status."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rc = subprocess.call(argv, env=env)
    while True:  # orphans reparented to us: wait for each, so their time is counted
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    return rc


def main() -> int:
    if sys.argv[1:2] in ([], ["-h"], ["--help"]):
        print(__doc__)
        return 0 if sys.argv[1:] else 2
    began = time.monotonic()
    rc = run_reaping(sys.argv[1:])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"cpu_s={usage.ru_utime + usage.ru_stime:.1f} wall_s={time.monotonic() - began:.1f} rc={rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
