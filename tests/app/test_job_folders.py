"""The run folder's name from the job's id ([Note: one folder per job] in lightning_mics/app/hosts.py), read from the
environment each launcher gives its ranks (the variables torchrun and srun set, as documented by them): the same on
every rank of a job, new for each job and each restart of it; a job across hosts without an id is refused with the
fix. The launch itself, on two hosts, is tests/app/test_many_hosts.py."""

from __future__ import annotations

import os
import socket

import pytest

from lightning_mics.app.hosts import detect, job_name
from lightning_mics.app.schema import UsageError


def _torchrun(rank: int, run_id: str = "job7", world: int = 4, local: int = 2, **extra: str):
    return {"TORCHELASTIC_RUN_ID": run_id, "RANK": str(rank), "LOCAL_RANK": str(rank % local),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local), **extra}


def _srun(rank: int, **extra: str):
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
            "SLURM_JOB_NAME": "mics", "SLURM_STEP_ID": "0", **extra}


def test_every_rank_of_a_torchrun_job_names_one_folder() -> None:
    assert {job_name(env=_torchrun(r)) for r in range(4)} == {"torchrun-job7"}
    launch = detect(_torchrun(3))
    assert (launch.launcher, launch.rank, launch.world_size, launch.ranks_per_host, launch.hosts) == \
        ("torchrun", 3, 4, 2, 2)
    assert job_name(env=_torchrun(0, TORCHELASTIC_RESTART_COUNT="2")) == "torchrun-job7-restart2"
    assert job_name(env=_torchrun(0, SLURM_RESTART_COUNT="1", SLURM_JOB_ID="9")) == "torchrun-job7-restart1"
    assert job_name("mine", env=_torchrun(1)) == "mine"  # run_id= wins over the launcher's id


def test_torchrun_without_an_id() -> None:
    one_host = _torchrun(0, run_id="none", world=2, local=2)
    assert job_name(env=one_host) == f"torchrun-{socket.gethostname()}-{os.getppid()}"  # the agent: our parent
    assert job_name(env=_torchrun(2, run_id="none", SLURM_JOB_ID="77")) == "slurm-77"  # torchrun under srun
    with pytest.raises(UsageError, match=r"torchrun started 4 ranks on 2 hosts without a job id \(torchrun without "
                                         r"--rdzv-id\).*Give torchrun --rdzv-id=<the job's id, the same on every "
                                         r"host>, or give the job run_id=<name>"):
        job_name(env=_torchrun(0, run_id="none"))
    assert job_name("fixed", env=_torchrun(0, run_id="none")) == "fixed"


def test_srun_one_task_per_rank() -> None:
    assert {job_name(env=_srun(r)) for r in range(4)} == {"slurm-4242"}
    launch = detect(_srun(1))
    assert (launch.launcher, launch.rank, launch.world_size, launch.ranks_per_host, launch.hosts) == \
        ("srun", 1, 4, 2, 2)
    assert job_name(env=_srun(0, SLURM_STEP_ID="3")) == "slurm-4242.3"  # the batch script's fourth srun
    assert job_name(env=_srun(0, SLURM_RESTART_COUNT="1")) == "slurm-4242-restart1"  # requeued
    # not a launch: one task (the batch script itself), or an interactive allocation, as Lightning reads them
    assert detect(_srun(0, SLURM_NTASKS="1")) is None and job_name(env=_srun(0, SLURM_NTASKS="1")) is None
    assert detect(_srun(0, SLURM_JOB_NAME="bash")) is None


def test_no_launcher_keeps_the_clock_and_run_id_is_a_folder_name() -> None:
    assert detect({}) is None and job_name(env={}) is None
    assert job_name("gpt-2024.06_a+b", env={}) == "gpt-2024.06_a+b"
    for bad in ("a/b", "..", "-x", "", "a b"):
        with pytest.raises(UsageError, match="allowed is a folder name of letters, digits and"):
            job_name(bad, env={})
