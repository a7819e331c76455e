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
them.
"""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

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


def _claim(config: DictConfig, kind: str) -> str:
    key = f"hydra.{kind}.dir"
    user_named = any(o.split("=", 1)[0].lstrip("+~") == key for o in config.hydra.overrides.hydra)
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
        if "LOCAL_RANK" not in os.environ:
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
