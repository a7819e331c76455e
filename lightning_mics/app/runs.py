"""Hydra callbacks of the main job (``hydra.callbacks`` in ``conf/config.yaml``): every job gets a folder of its own,
and a sweep ends with a comparison of its jobs.

[Note: run folders]
Hydra names a run's folder from the clock (``outputs/<date>/<time>``) and creates it with ``exist_ok``, so two jobs
started in the same second would write into one folder. :class:`RunFolder` claims the folder before Hydra creates
it, with one ``os.mkdir`` (atomic: of two jobs racing for a name exactly one succeeds). A folder named by the
default pattern that is taken gets the first free suffix (``<time>-1``, ``<time>-2``, ...); a folder the user named
(``hydra.run.dir=...``, ``hydra.sweep.dir=...``) that already exists is refused. Ranks launched by Lightning
(``LOCAL_RANK`` set) are handed rank 0's folder on their command line and claim nothing. In a sweep the claimed
sweep folder is also appended to the sweep's Hydra overrides, because Hydra composes each job's config anew from
them. Ranks that torchrun or srun started name the folder from the job's id instead ([Note: one folder per job] in
``hosts.py``): global rank 0 claims it by creating its ``.job`` file (exclusively: a second job with the same id is
refused), the other ranks write into it without a claim (their log is ``train_rank<k>.log``, and only rank 0 writes
Hydra's ``.hydra``).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lightning_mics.app import hosts
from lightning_mics.app.schema import UsageError


def claim_folder(path: str, user_named: bool, key: str) -> str:
    """Creates ``path`` (or, unless the user named it, ``path-1``, ``path-2``, ...) and returns the one created;
    raises :class:`UsageError` when the user named a folder that exists."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    candidate, n = path, 0
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            if user_named:
                raise UsageError(f"{key}={path!r} already exists: every job writes into a new folder (its report, "
                                 f"checkpoints and logs would be mixed with another job's). Give a new path, or "
                                 f"remove this one.") from None
            n += 1
            candidate = f"{path}-{n}"


def claim_job_folder(path: str, launch: "hosts.Launch") -> None:
    """Rank 0 of a job that torchrun or srun started: creates ``path`` if needed and its ``.job`` file, which only
    one job can create; raises :class:`UsageError` when another job (with the same id) has."""
    os.makedirs(path, exist_ok=True)
    try:
        with open(os.path.join(path, ".job"), "x") as f:
            f.write(f"{launch.launcher}: {launch.world_size} ranks on {launch.hosts} hosts; job id from "
                    f"{launch.source}\n")
    except FileExistsError:
        raise UsageError(f"{os.path.abspath(path)} is the run folder of another job with this id (it holds that "
                         f"job's .job file): every job writes into a new folder. Give the job a new id (torchrun "
                         f"--rdzv-id=..., or run_id=...), or remove that folder.") from None


def run_dir(root: str, run_id: Optional[str]) -> str:
    """``hydra.run.dir``'s default: ``<root>/<the job's name>`` when a launcher or ``run_id`` names the job
    ([Note: one folder per job] in hosts.py), else ``<root>/<date>/<time>`` from the clock."""
    try:
        name = hosts.job_name(run_id)
    except UsageError:  # said before Hydra composes (train.main); here the folder just falls back
        name = None
    if name is not None:
        return f"{root}/{name}"
    return datetime.datetime.now().strftime(f"{root}/%Y-%m-%d/%H-%M-%S")


def _launched_rank() -> Optional[int]:
    launch = hosts.detect()
    return None if launch is None else launch.rank


def output_subdir(default: str) -> Optional[str]:
    """Hydra's ``.hydra`` folder: rank 0's only, where torchrun or srun started the ranks."""
    return None if _launched_rank() not in (None, 0) else default


def log_name(name: str) -> str:
    """The log file's name: ``train_rank<k>`` for rank k > 0 where torchrun or srun started the ranks."""
    rank = _launched_rank()
    return name if rank in (None, 0) else f"{name}_rank{rank}"


def register() -> None:
    OmegaConf.register_new_resolver("app_run_dir", run_dir, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("app_output_subdir", output_subdir, replace=True)
    OmegaConf.register_new_resolver("app_log_name", log_name, replace=True)


def _claim(config: DictConfig, kind: str) -> str:
    key = f"hydra.{kind}.dir"
    user_named = any(o.split("=", 1)[0].lstrip("+~") == key for o in config.hydra.overrides.hydra) or \
        config.get("run_id") is not None
    try:
        path = claim_folder(str(config.hydra[kind].dir), user_named, key)
    except UsageError as e:  # Hydra turns a callback's Exception into a warning; SystemExit ends the job here
        raise SystemExit(str(e)) from None
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra[kind].dir = path
    return path


class RunFolder(Callback):
    """See [Note: run folders]."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        launch = hosts.detect()
        if launch is not None:
            if launch.rank == 0:
                try:
                    claim_job_folder(str(config.hydra.run.dir), launch)
                except UsageError as e:
                    raise SystemExit(str(e)) from None
        elif "LOCAL_RANK" not in os.environ:
            _claim(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "LOCAL_RANK" in os.environ:
            return
        path = _claim(config, "sweep")
        quoted = "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={quoted}")


class SweepSummary(Callback):
    """At the end of a sweep (``-m``), a table and a plot comparing its jobs (``sweep.md``, ``sweep.png``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from lightning_mics.app.sweep import write_summary

        lines = write_summary(str(config.hydra.sweep.dir))
        if lines:
            print("\n".join(lines), flush=True)
