"""Starts N real processes of a script, torchrun-style, and collects their JSON results.

Each rank gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK, so
Lightning's environment sees processes created externally (as under torchrun) and launches nothing itself.
If any rank fails or the time runs out, all are killed and the failing rank's output is raised.

The ranks are forked from a server process that has imported torch, Lightning and the package once
(``multiprocessing``'s forkserver with a preload), instead of each starting a fresh interpreter: importing
Lightning costs about 5 s of CPU per rank, which on this 2-core machine was most of a short test's time.
Each rank is still its own process with its own environment, working folder, ``sys.argv`` and log, running
the script as ``__main__`` and exiting with its own status. ``fresh=True`` starts fresh interpreters instead,
for a script that must change something before the package is imported. ``start_module`` runs a module the same
way, as ``python -m`` would (the app refusing a mistake, ``tests/helpers/app.py``); the ranks that Lightning's
launcher starts from such a module are forked from the same server (``_fork_launched_ranks``).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import random
import runpy
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
_forkserver: Optional[Any] = None


_PORTS = 4000  # ports per pytest process (each xdist worker its own range)
_next_port: List[int] = []


def free_port() -> int:
    """A port nothing listens on, for a job's MASTER_PORT: taken in turn from a range below Linux's ephemeral ports
    (32768 and up), one range per xdist worker, so that neither the other worker's jobs nor any connection's
    ephemeral local port takes it between this check and the job's bind."""
    if not _next_port:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        base = 12000 + (int(worker) % 5 if worker.isdigit() else 0) * _PORTS
        _next_port.append(base + random.randrange(_PORTS))  # another session's same range starts elsewhere
    base = _next_port[0] - _next_port[0] % _PORTS
    for _ in range(_PORTS):
        port = _next_port[0]
        _next_port[0] = base + (port + 1 - base) % _PORTS
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # the whole range busy: any port the kernel offers
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """The forkserver context, started on first use with one thread per process (OpenMP reads it at load)."""
    global _forkserver
    if _forkserver is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.helpers.preload"])
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}
        os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _forkserver = ctx
    return _forkserver


def _redirect(fd_number: int, path: str, truncate: bool = True) -> None:
    """``fd_number`` to ``path``, appending: a rank forked for this one (``_fork_launched_ranks``) writes the same
    file, as a child would inherit the descriptor, and neither overwrites the other's lines."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0), 0o644)
    os.dup2(fd, fd_number)
    os.close(fd)


def _forking_popen(command, env=None, cwd=None, **kwargs):
    """``subprocess.Popen`` for Lightning's launcher in a forked rank: ``[python, -m, module, *argv]`` (or a
    script) with the launcher's environment and folder is forked from the preloaded server as ``start_module``
    forks, writing this rank's stdout and stderr; any other command is a real ``subprocess.Popen``."""
    command = [str(c) for c in command]
    if kwargs or command[0] != sys.executable or len(command) < 2:
        return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
    module = command[1] == "-m"
    script, argv = (command[2], command[3:]) if module else (command[1], command[2:])
    outputs = [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]
    p = multiprocessing.get_context("forkserver").Process(
        target=_rank_main, args=(script, argv, dict(env or os.environ), cwd or os.getcwd(), outputs[0], module,
                                 outputs[1], False))
    p.start()
    multiprocessing.process._children.discard(p)  # not joined at this rank's exit: a Popen is not either
    return _Forked(p)


def _fork_launched_ranks() -> None:
    """In a forked rank: the ranks Lightning's launcher starts (``Trainer(devices=2)`` run as a module) are forked
    from the same server instead of being fresh interpreters, saving each one's imports (about 7 CPU-s). The
    server is this process's parent, so multiprocessing is told not to start one of its own."""
    import lightning.fabric.strategies.launchers.subprocess_script as fabric_launcher
    import lightning.pytorch.strategies.launchers.subprocess_script as trainer_launcher
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver.ensure_running = lambda: None
    forking = types.SimpleNamespace(**{**vars(subprocess), "Popen": _forking_popen})
    fabric_launcher.subprocess = trainer_launcher.subprocess = forking


def _rank_main(script: str, argv: List[str], env: Dict[str, str], cwd: str, log_path: str,
               module: bool = False, err_path: Optional[str] = None, truncate: bool = True) -> None:
    """Runs in the forked rank: what ``python script argv...`` (``module``: ``python -m script argv...``) would
    do, with stdout to the log and stderr to ``err_path`` (None: the log too)."""
    _redirect(1, log_path, truncate)
    if err_path:
        _redirect(2, err_path, truncate and err_path != log_path)
    else:
        os.dup2(1, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        if module:  # sys.argv[0] becomes the module's file, sys.path[0] the working folder, as under ``-m``
            _fork_launched_ranks()
            sys.argv = ["-m", *argv]
            sys.path.insert(0, cwd)
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *argv]
            sys.path[:0] = [str(Path(script).parent), str(REPO)]
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit would (multiprocessing's children skip atexit)


class _Forked:
    def __init__(self, proc) -> None:
        self.proc = proc
        self.pid = proc.pid

    def send_signal(self, signum: int) -> None:
        if self.proc.exitcode is None:
            os.kill(self.pid, signum)

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.proc.name, timeout)
        return self.proc.exitcode

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.exitcode


def start(script: Path, argv: List[str], env: Dict[str, str], cwd: Path, log_path: Path, fresh: bool = False):
    """Starts ``python script argv...`` as one process (forked from the preloaded server, or with ``fresh`` a new
    interpreter), stdout and stderr to ``log_path``; returns a handle with ``poll``, ``kill``, ``wait`` and
    ``returncode`` like ``subprocess.Popen``'s."""
    if fresh:
        with open(log_path, "w") as log:
            return subprocess.Popen([sys.executable, str(script), *argv], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=str(cwd))
    p = _context().Process(target=_rank_main, args=(str(script), argv, env, str(cwd), str(log_path)))
    p.start()
    return _Forked(p)


def start_module(module: str, argv: List[str], env: Dict[str, str], cwd: Path, out_path: Path,
                 err_path: Path):
    """``python -m module argv...`` forked from the preloaded server (stdout and stderr to their own files):
    for a command whose start is not what a test checks (the app refusing a mistake before any rank starts)."""
    p = _context().Process(target=_rank_main, args=(module, argv, env, str(cwd), str(out_path), True,
                                                      str(err_path)))
    p.start()
    return _Forked(p)


def run_ranks(script: Path, world: int, args: List[str], out_dir: Path, timeout: float = 600,
              extra_env: Optional[Dict[str, str]] = None, fresh: bool = False) -> List[Dict[str, Any]]:
    port = free_port()
    procs = []
    logs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                   PYTHONUNBUFFERED="1")
        env.update(extra_env or {})
        logs.append(out_dir / f"rank{rank}.log")
        procs.append(start(script, ["--out", str(out_dir), *args], env, out_dir, logs[-1], fresh=fresh))
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
    for p in procs:
        if failed is not None and p.poll() is None:
            p.kill()
        p.wait()
    if failed is not None:
        msgs = [f"--- rank {r} (exit {procs[r].returncode}) ---\n" + log.read_text()[-6000:] for r, log in enumerate(logs)]
        raise AssertionError(("timeout" if failed == -1 else f"rank {failed} failed") + "\n" + "\n".join(msgs))
    results = []
    for rank in range(world):
        path = out_dir / f"result{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results
