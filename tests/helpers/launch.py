"""Starts N real processes of a script, torchrun-style, and collects their JSON results.

Each rank gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK, so
Lightning's environment sees processes created externally (as under torchrun) and launches nothing itself.
If any rank fails or the time runs out, all are killed and the failing rank's output is raised.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, world: int, args: List[str], out_dir: Path, timeout: float = 600,
              extra_env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    port = free_port()
    procs = []
    logs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                   PYTHONUNBUFFERED="1")
        env.update(extra_env or {})
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), "--out", str(out_dir), *args],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(out_dir)))
    deadline = time.monotonic() + timeout
    failed = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failed = bad[0]
            break
        if all(c == 0 for c in codes):
            break
        if time.monotonic() > deadline:
            failed = -1
            break
        time.sleep(0.1)
    if failed is not None:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        msgs = []
        for r, log in enumerate(logs):
            log.seek(0)
            msgs.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n" + log.read()[-6000:])
        raise AssertionError(("timeout" if failed == -1 else f"rank {failed} failed") + "\n" + "\n".join(msgs))
    results = []
    for rank in range(world):
        path = out_dir / f"result{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results
