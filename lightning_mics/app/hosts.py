"""The job as a launcher of several hosts starts it (torchrun on each host, or srun): which launcher, the job's id,
the run folder's name that follows from it, and the Trainer's ``devices`` and ``num_nodes`` that the launcher
decided. ``job_name()`` also names the folder of a Trainer script run the same way (examples/multi_host/).

[Note: one folder per job]
A run folder named from each process's clock (Hydra's ``outputs/<date>/<time>``) splits a job whose hosts start in
different seconds: each host's ranks write their checkpoint shards and logs into a folder of their own, and no
folder holds a loadable checkpoint. So every rank of a job that torchrun or srun started names the folder from the
job's id, which every host reads alike without talking to the others: ``run_id=`` if given, else torchrun's
``--rdzv-id`` (``TORCHELASTIC_RUN_ID``), else ``SLURM_JOB_ID`` (with the step, after the first ``srun`` of a batch
script), and a restart of the job (torchrun's ``--max-restarts``, a requeued SLURM job) adds ``-restart<k>``
(``ckpt_path=`` then continues from the earlier attempt's checkpoint).
A static torchrun rendezvous without ``--rdzv-id`` has no id ("none"): on one host the torchrun agent's pid names
the job (its ranks are its children); across hosts the job is refused before any rank connects, with the fix.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Set

from lightning_mics.app.schema import UsageError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class Launch:
    """Ranks that torchrun or srun started (not Lightning's launcher)."""

    launcher: str  # "torchrun" or "srun"
    rank: int  # global rank
    world_size: int
    ranks_per_host: int
    job: Optional[str]  # the folder's name from the launcher's job id; None: the launcher gave none
    source: str  # where ``job`` comes from, for the messages

    @property
    def hosts(self) -> int:
        return max(1, self.world_size // max(1, self.ranks_per_host))


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    try:
        return int(env.get(key, default))
    except ValueError:
        return default


def _restart(name: str, restarts: int) -> str:
    return f"{name}-restart{restarts}" if restarts > 0 else name


def _slurm_job(env: Mapping[str, str]) -> Optional[str]:
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    step = env.get("SLURM_STEP_ID", "0")
    name = f"slurm-{job}" if step in ("0", "") or not step.isdigit() else f"slurm-{job}.{step}"
    return _restart(name, _int(env, "SLURM_RESTART_COUNT", 0))


def detect(env: Mapping[str, str] = os.environ) -> Optional[Launch]:
    """The launcher that started this rank, when it is torchrun or srun (one task per rank); None otherwise."""
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        world, local = _int(env, "WORLD_SIZE", 1), _int(env, "LOCAL_WORLD_SIZE", 1)
        run_id = env["TORCHELASTIC_RUN_ID"]
        if run_id != "none":  # a requeued SLURM job starts torchrun again: its restarts count too
            restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", 0) + _int(env, "SLURM_RESTART_COUNT", 0)
            job = _restart(f"torchrun-{run_id}", restarts)
            source = f"torchrun --rdzv-id={run_id}"
        elif _slurm_job(env):
            job, source = _slurm_job(env), "SLURM_JOB_ID (torchrun was given no --rdzv-id)"
        elif world == local:  # one host: the agent that started every rank of it
            job, source = f"torchrun-{socket.gethostname()}-{os.getppid()}", "the torchrun agent's pid"
        else:
            job, source = None, "torchrun without --rdzv-id"
        return Launch("torchrun", _int(env, "RANK", 0), world, local, job, source)
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", 1) > 1 and \
            env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):  # Lightning's SLURMEnvironment's test
        world = _int(env, "SLURM_NTASKS", 1)
        nodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
        local = _int(env, "SLURM_NTASKS_PER_NODE", max(1, world // max(1, nodes)))
        return Launch("srun", _int(env, "SLURM_PROCID", 0), world, local, _slurm_job(env), "SLURM_JOB_ID")
    return None


def check_run_id(run_id: Optional[str]) -> None:
    if run_id is not None and not _NAME.match(str(run_id)):
        raise UsageError(f"run_id={run_id!r}: allowed is a folder name of letters, digits and . _ + - (not "
                         f"starting with one of those four), the same on every host, such as run_id=gpt-2024-06-01.")


def job_name(run_id: Optional[str] = None, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The run folder's name for this job ([Note: one folder per job]): ``run_id``, else the launcher's job id;
    None when neither launcher nor ``run_id`` names the job (the caller keeps its clock-named folder). Raises
    :class:`UsageError` for a job across hosts that has no id."""
    check_run_id(run_id)
    launch = detect(env)
    if run_id is not None:
        return _restart(str(run_id), _int(env, "TORCHELASTIC_RESTART_COUNT", 0) + _int(env, "SLURM_RESTART_COUNT", 0))
    if launch is None:
        return None
    if launch.job is None:
        raise UsageError(f"{launch.launcher} started {launch.world_size} ranks on {launch.hosts} hosts without a job "
                         f"id ({launch.source}), so the hosts cannot name one run folder for the job. Give torchrun "
                         f"--rdzv-id=<the job's id, the same on every host>, or give the job run_id=<name>.")
    return launch.job


def trainer_layout(trainer_cfg: Any, launch: Launch, given: Set[str]) -> str:
    """Sets ``trainer.devices`` and ``trainer.num_nodes`` to the launcher's ranks per host and hosts, each unless
    given on the command line (a given one that disagrees is refused by Lightning before any rank connects);
    returns the line that says so."""
    taken = []
    for key, value in (("devices", launch.ranks_per_host), ("num_nodes", launch.hosts)):
        if f"trainer.{key}" not in given:
            trainer_cfg[key] = value
            taken.append(f"trainer.{key}={value}")
    set_by = f"; {' '.join(taken)} from the launcher" if taken else ""
    return (f"[launch] {launch.launcher} started {launch.world_size} rank{'s' * (launch.world_size != 1)} on "
            f"{launch.hosts} host{'s' * (launch.hosts != 1)} ({launch.ranks_per_host} per host){set_by}; the job's "
            f"id from {launch.source}")
