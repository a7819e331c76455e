"""The main job as a user starts it (``python -m lightning_mics.app.train``), for the app's tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from tests.helpers.launch import start_module

REPO = Path(__file__).resolve().parents[2]

# A model small enough to train in seconds, but with matrices above the persistence threshold so that
# MiCS really shards them (n_embd=32: c_fc 32x128 = 4096 elements > 1000).
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.warmup_steps=2",
    "data.max_bytes=300000", "data.batch_size=8", "data.max_val_blocks=64",
    "trainer.max_steps=24", "trainer.val_check_interval=8", "trainer.log_every_n_steps=2", "trainer.devices=2",
    "callbacks.progress_bar.refresh_rate=0",
]
MICS_TINY = ["strategy.param_persistence_threshold=1000"]
_LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
COMMAND = [sys.executable, "-m", "lightning_mics.app.train"]


def app_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    # A rank that Lightning starts is a fresh interpreter in the test's folder: tests.* (a callback a test names
    # as a Hydra target) is found from the repository root.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_app(args: List[str], cwd: Path, timeout: float = 150,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """The job in a session of its own, its output captured. On timeout the whole session is killed, so a rank
    that outlives rank 0 (blocked on a peer that is gone) neither holds the output pipes open nor lingers into
    the next test; the TimeoutExpired carries what the job printed."""
    proc = subprocess.Popen([*COMMAND, *args], cwd=cwd, env=env or app_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from e
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_app_forked(args: List[str], cwd: Path, timeout: float = 120,
                   env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``run_app`` in a process forked from the test launcher's server, which has imported torch, Lightning,
    Hydra and the package (``tests/helpers/launch.py``): the same module run as ``__main__`` with the same
    arguments, environment and folder, without the interpreter's 7 s of imports; the ranks Lightning's launcher
    starts are forked from the same server, with the command, environment and folder it gives them. For mistakes
    answered before any rank starts, and for runs whose test checks what they compute (a resume against the
    uninterrupted run), not how the job starts."""
    out, err = cwd / "app.stdout", cwd / "app.stderr"
    proc = start_module(COMMAND[2], args, env or app_env(), cwd, out, err)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess([*COMMAND, *args], code, out.read_text(), err.read_text())


def start_app(args: List[str], cwd: Path, log: Path, **kwargs: Any) -> subprocess.Popen:
    """The job in the background, in a session of its own (as a shell runs a job: Ctrl-C reaches its whole
    process group); stdout and stderr go to ``log``."""
    out = open(log, "w")
    return subprocess.Popen([*COMMAND, *args], cwd=cwd, env=app_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, **kwargs)


def live_processes(pgid: int) -> List[str]:
    """Processes of process group ``pgid`` that have not exited (zombies waiting to be reaped do not count)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(stat.parent.name)
    return alive


def wait_for(path: Path, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.2)
