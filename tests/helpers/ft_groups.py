"""A fault-tolerant job as a user runs it: a torchft lighthouse and replica groups, each a ``torchrun`` job of its
own, optionally each in a network namespace of its own (a host: tests/helpers/netns.py). A group can be killed as a
lost host is (SIGKILL to its torchrun agent and every worker: one process group) and started again.

``start(..., forked=True)`` runs a group's ranks as processes forked from the test launcher's preloaded server
(tests/helpers/launch.py) with the environment torchrun gives its workers, in place of a ``torchrun`` job: for a
test that checks what the groups compute, not how a group starts (each torchrun job is three fresh interpreters,
some 15 s of imports; a forked group cannot be moved into a network namespace, and ``tagged`` does not see it:
it is killed by its handles).

Every process carries a tag in its environment (``FT_JOB_TAG``, inherited by the workers torchrun starts in
sessions of their own): a group is killed by SIGKILL to every process of its launch at once, everything the job
started is killed when it ends, whatever happened, and ``alive()`` lists what is left, so a test can say that no
process stayed behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "fault_tolerance" / "ft_trainer.py"


class _ForkedGroup:
    """A group's forked ranks behind ``subprocess.Popen``'s ``poll``, ``wait`` and ``kill``: the group's status is
    the first failing rank's, or 0 when every rank ended with 0."""

    def __init__(self, ranks: List) -> None:
        self.ranks = ranks

    def poll(self) -> Optional[int]:
        codes = [r.poll() for r in self.ranks]
        bad = [c for c in codes if c not in (None, 0)]
        return bad[0] if bad else (0 if all(c == 0 for c in codes) else None)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("forked group", timeout)
            time.sleep(0.1)
        code = self.poll()
        if code != 0:  # a rank failed: its peers would wait on it
            self.kill()
        for r in self.ranks:
            r.wait()
        return code

    def kill(self) -> None:
        for r in self.ranks:
            if r.poll() is None:
                r.kill()


def _env(extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", RUST_LOG="warn")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
              "GLOO_SOCKET_IFNAME", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        env.pop(k, None)
    env.update(extra)
    return env


class FTJob:
    """``with FTJob(out, hosts=[ns_a, ns_b] or [None, None], addrs=[...]) as job:`` then ``job.lighthouse()``,
    ``job.start(g, args)``, ``job.kill(g)``, ``job.wait(g)``; everything left is killed on exit."""

    def __init__(self, out: Path, hosts: Sequence[Optional[str]], addrs: Sequence[str], lighthouse_port: int,
                 base_port: int, nproc: int = 2) -> None:
        self.out, self.hosts, self.addrs = Path(out), list(hosts), list(addrs)
        self.lighthouse_port, self.base_port, self.nproc = lighthouse_port, base_port, nproc
        self.procs: Dict[str, subprocess.Popen] = {}
        self.launches: Dict[int, int] = {}  # group -> how many times started
        self.killed_at: Dict[int, float] = {}
        self.started_at: Dict[int, List[float]] = {}
        self.tag = f"ftjob-{os.getpid()}-{time.monotonic_ns()}"

    def __enter__(self) -> "FTJob":
        return self

    def __exit__(self, *exc: object) -> None:
        for name in list(self.procs):
            self._kill(name)
        for pid in tagged(self.tag + "/"):  # anything a launch left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _popen(self, name: str, host: Optional[str], cmd: List[str], env: Dict[str, str]) -> subprocess.Popen:
        env = dict(env, FT_JOB_TAG=f"{self.tag}/{name}")
        if host is not None:
            cmd = ["ip", "netns", "exec", host, *cmd]
        log = open(self.out / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=env, cwd=self.out, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def lighthouse(self, min_replicas: int = 1, heartbeat_ms: int = 2000, host: int = 0) -> str:
        """Starts the lighthouse on host ``host``; returns its address."""
        self._popen("lighthouse", self.hosts[host],
                    ["torchft_lighthouse", "--min_replicas", str(min_replicas), "--bind",
                     f"[::]:{self.lighthouse_port}", "--quorum_tick_ms", "50", "--join_timeout_ms", "60000",
                     "--heartbeat_timeout_ms", str(heartbeat_ms)], _env({}))
        return f"http://{self.addrs[host]}:{self.lighthouse_port}"

    def start(self, group: int, args: Sequence[str], groups: int = 2, script: Path = SCRIPT,
              module: Optional[str] = None, forked: bool = False) -> subprocess.Popen:
        """Group ``group`` as a torchrun job of ``nproc`` ranks on its host (its launch number in the log name);
        ``forked``: its ranks forked from the test launcher's server instead (no host of its own)."""
        n = self.launches.get(group, 0)
        self.launches[group] = n + 1
        host, addr = self.hosts[group], self.addrs[group]
        env = {"TORCHFT_LIGHTHOUSE": f"http://{self.addrs[0]}:{self.lighthouse_port}",
               "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(groups)}
        if host is not None:
            env["GLOO_SOCKET_IFNAME"] = host
        if forked:
            assert host is None, "a forked group runs on this host"
            return self._start_forked(f"group{group}_{n}", group, script, args, addr,
                                      self.base_port + 10 * group + n, env, module)
        target = ["-m", module] if module else [str(script)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(self.nproc),
               "--master-addr", addr, "--master-port", str(self.base_port + 10 * group + n), *target, *args]
        self.started_at.setdefault(group, []).append(time.time())
        return self._popen(f"group{group}_{n}", host, cmd, _env(env))

    def _start_forked(self, name: str, group: int, script: Path, args: Sequence[str], addr: str, port: int,
                      extra: Dict[str, str], module: Optional[str] = None) -> _ForkedGroup:
        """The ranks of a torchrun job of ``nproc`` workers on one node, forked (rank r logs to ``name``.log for
        rank 0, ``name``_r<r>.log for the others); the first rank hosts the store, as Lightning's ranks do.
        ``module``: that module run as ``python -m`` runs it, in place of ``script``."""
        from tests.helpers.launch import start as start_rank
        from tests.helpers.launch import start_module

        ranks = []
        for rank in range(self.nproc):
            env = _env(dict(extra, FT_JOB_TAG=f"{self.tag}/{name}", RANK=str(rank), LOCAL_RANK=str(rank),
                            GROUP_RANK="0", ROLE_RANK=str(rank), LOCAL_WORLD_SIZE=str(self.nproc),
                            WORLD_SIZE=str(self.nproc), MASTER_ADDR=addr, MASTER_PORT=str(port)))
            log = self.out / (f"{name}.log" if rank == 0 else f"{name}_r{rank}.log")
            if module:
                ranks.append(start_module(module, list(args), env, self.out, log, log))
            else:
                ranks.append(start_rank(script, list(args), env, self.out, log))
        self.started_at.setdefault(group, []).append(time.time())
        proc = _ForkedGroup(ranks)
        self.procs[name] = proc
        return proc

    def check(self) -> bool:
        """Raises, with its log's end, when a launch still counted as running has ended with an error: a wait for
        it to step would wait in vain. True otherwise (so it can stand in a ``wait_for`` predicate)."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0):
                raise RuntimeError(f"{name} exited with {code}:\n{self.log(name)[-4000:]}")
        return True

    def current(self, group: int) -> str:
        return f"group{group}_{self.launches[group] - 1}"

    def _kill(self, name: str) -> None:
        """SIGKILL to every process of launch ``name`` at once (the agent and its workers), then reaps the agent."""
        proc = self.procs.pop(name, None)
        if isinstance(proc, _ForkedGroup):
            proc.kill()
        for pid in tagged(f"{self.tag}/{name}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None:
            proc.wait(timeout=30)

    def kill(self, group: int) -> float:
        """SIGKILL to the group's torchrun agent and every worker at once, as when its host is lost."""
        self.killed_at[group] = time.time()
        self._kill(self.current(group))
        return self.killed_at[group]

    def wait(self, group: int, timeout: float) -> int:
        """The exit status of the group's current launch ('timeout' kills it)."""
        proc = self.procs[self.current(group)]
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(self.current(group))
            return -999
        self.procs.pop(self.current(group), None)
        return code

    def stop_lighthouse(self) -> None:
        self._kill("lighthouse")

    def log(self, name: str) -> str:
        """The launch's output (a forked group's: its ranks' logs one after another)."""
        text = (self.out / f"{name}.log").read_text(errors="replace")
        for other in sorted(self.out.glob(f"{name}_r*.log")):
            text += f"\n--- {other.name} ---\n" + other.read_text(errors="replace")
        return text

    def alive(self) -> List[int]:
        """Pids of this job's processes still running (torchrun's workers too)."""
        return tagged(self.tag + "/")


def tagged(prefix: str) -> List[int]:
    """Pids of live processes whose ``FT_JOB_TAG`` starts with ``prefix`` (zombies left out)."""
    out = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = (pid_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"FT_JOB_TAG=" + prefix.encode()) for e in env):
            out.append(int(pid_dir.name))
    return out


def records(path: Path) -> List[dict]:
    """The lines a rank 0 wrote so far (tests/fault_tolerance/ft_trainer.py ``--record``)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def wait_for(predicate, timeout: float, poll: float = 0.1, what: str = "a condition") -> float:
    """Polls ``predicate`` until it is true; returns the time it became true. Raises TimeoutError after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return time.time()
        time.sleep(poll)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
