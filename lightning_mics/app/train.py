"""The main job: train a small GPT on a byte corpus with the configured strategy (default: MiCS). Hydra app.

    lightning-mics-train                                   # = python -m lightning_mics.app.train; CPU, 2 ranks
    lightning-mics-train strategy.sharded_data_parallel_degree=2 trainer.devices=4 \\
        trainer.accumulate_grad_batches=4 model.n_layer=6
    lightning-mics-train strategy=ddp                      # same job on Lightning's DDP
    lightning-mics-train trainer=gpu model.n_layer=12 model.n_embd=768
    lightning-mics-train data.path=$HOME/my_texts          # any text file or folder
    lightning-mics-train ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt   # resume, into a new folder
    lightning-mics-train -m strategy.sharded_data_parallel_degree=1,2 trainer.devices=2   # sweep + comparison
    lightning-mics-train --cfg job                         # print the composed config and exit
    lightning-mics-train --help                            # every key with what it means (help.py)
    lightning-mics-train --config-dir my_conf model=my_model data=my_data   # your own config groups

Configs live in ``conf/`` at the repository root; the wheel installs that folder as the package
``lightning_mics.app.conf`` (see pyproject.toml) and the app reads it through Hydra's search path
``pkg://lightning_mics.app.conf``, in an installed wheel and in an editable install alike, from any working
folder. ``--config-dir DIR`` (or ``hydra.searchpath=[file://DIR]``) adds a folder of your own config groups
(``DIR/model/my_model.yaml`` selected as ``model=my_model``). Each run writes into a new folder of its own
(``outputs/<date>/<time>/``, or ``multirun/<date>/<time>/<job>/``; [Note: run folders] in ``runs.py``) under the
working folder: ``train.log``, ``csv/metrics.csv``, ``checkpoints/last.ckpt`` (every
``callbacks.checkpoint.every_n_train_steps`` optimizer steps and at the end), ``report.json``, ``report.md`` and
``loss.png``; a sweep adds ``sweep.md`` and ``sweep.png`` comparing its jobs.

Before any rank starts, the job checks what it was given and stops with one message naming the key: a misspelled key
with the key meant ([Note: did you mean] in ``keys.py``), types (Hydra's structured configs, [Note: config schemas]
in ``schema.py``), the corpus (``data.py``), ``ckpt_path``, the run folder. Rank 0 says what corpus it read and how
it split it (``[data]``), and at every end of training where the last checkpoint is and how to continue from it
(``[checkpoint]``). Ctrl-C stops every rank after the same optimizer step, saves ``last.ckpt`` and the report, and
exits with status 130 ([Note: Ctrl-C] in ``callbacks.py``); ``ckpt_path=`` continues from that checkpoint, with the
same batches an uninterrupted run would have seen ([Note: resuming the data] in ``data.py``) and this run's
learning-rate schedule ([Note: the schedule on resume] in ``models/lit_gpt.py``). An error that ends a job after it
started goes, with its traceback, into each rank's own log file (``train.log`` on rank 0) as well as to the console.

[Note: ranks under Hydra]
Lightning's ``_SubprocessScriptLauncher`` starts ranks 1..n-1 by re-running this command with
``hydra.run.dir=<rank 0's run.dir> hydra.output_subdir=null`` appended, so every rank composes the same config
and shares rank 0's output folder. That works for a single run only: under ``-m`` the children would re-run
the whole sweep, and ``hydra.run.dir`` is not the sweep job's folder. So in a multirun job, rank 0 first
rewrites ``sys.argv`` to this job's own overrides (no ``-m``) and points ``hydra.run.dir`` at the job's output
folder; after the job it releases the job's process groups and restores the environment variables the launcher set
(``LOCAL_RANK`` left behind would make the next job believe its processes were launched externally).

[Note: every rank releases its groups]
A process that exits with a gloo group alive can abort in the interpreter's finalization (status -6,
[Note: groups at exit] in ``topology.py``). The MiCS strategy guards its own ranks; the app guards every rank of
every strategy it runs, DDP included, because an abort there is fatal to the job: Lightning's launcher watches ranks
1..n-1 from rank 0 and, when one exits with a non-zero status, kills every rank, rank 0 too. A job that trained to
the end then fails, and under ``-m`` the next job's rank 1, already started, waits for a rank 0 that is gone. So
``_run`` registers the release at exit on every rank, and rank 0 of a multirun job releases the job's groups before
the next job.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write

from lightning_mics.app import help as app_help
from lightning_mics.app import schema
from lightning_mics.app.data import CorpusError
from lightning_mics.app.keys import check_keys
from lightning_mics.app.schema import UsageError
from lightning_mics.layout.topology import release_all_groups, release_groups_at_exit

# The configs as a Python package (conf/ mapped to lightning_mics.app.conf by pyproject.toml).
CONF_MODULE = "lightning_mics.app.conf"
CONF_PATH = f"pkg://{CONF_MODULE}"
schema.register()
app_help.register()  # the resolver of hydra.help.template ([Note: help from the configs] in help.py)

log = logging.getLogger("lightning_mics.app")

# Hydra's flags that select the config; they are kept when a multirun job's argv is rewritten for its ranks.
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def _config_flags(argv: List[str]) -> List[str]:
    kept, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in _CONFIG_FLAGS and i + 1 < len(argv):
            kept += argv[i : i + 2]
            i += 2
            continue
        if arg.split("=", 1)[0] in _CONFIG_FLAGS and "=" in arg:
            kept.append(arg)
        i += 1
    return kept


def _prepare_multirun_job() -> None:
    """See [Note: ranks under Hydra]: let Lightning relaunch this sweep job, not the sweep."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    sys.argv = [sys.argv[0], *_config_flags(sys.argv[1:]), *hc.overrides.task]
    with read_write(hc), open_dict(hc):
        hc.run.dir = hc.runtime.output_dir


def _check_argv(argv: List[str]) -> None:
    """``key=~/x``: bash expands ``~`` after ``=`` only in a shell variable assignment, so Hydra receives it, and
    its override grammar refuses it with a lexer error; say so, with the fix, before Hydra parses."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and value.startswith("~") and not key.startswith("-"):
            raise SystemExit(f"{arg}: the shell left '~' unexpanded (it expands it after '=' only in a shell "
                             f"variable assignment), and Hydra's override grammar refuses it. Write "
                             f"{key}=$HOME{value[1:]} instead, or quote the value for Hydra: \"{key}='{value}'\".")


def _instantiate(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, except that a corpus mistake is reported as itself, in one message."""
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, CorpusError):
            raise UsageError(str(e.__cause__)) from None
        raise


def _instantiate_dict(node: Any) -> List[Any]:
    return [_instantiate(v) for v in (node or {}).values() if v is not None]


def _checkpoint_to_resume(ckpt_path: Optional[str]) -> Optional[str]:
    if ckpt_path is None:
        return None
    path = os.path.abspath(os.path.expanduser(ckpt_path))
    if not os.path.exists(path):
        raise UsageError(f"ckpt_path={ckpt_path!r}: no such checkpoint ({path}). Give the path of a saved "
                         f"checkpoint, such as outputs/<date>/<time>/checkpoints/last.ckpt of an earlier run.")
    return path


def _route_lightning_logs() -> None:
    """Lightning, imported before Hydra configured logging, gave its loggers stderr handlers of their own and
    stopped them from propagating; hand their records to Hydra's handlers (the console and ``train.log``)."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


def train(cfg: DictConfig) -> Tuple[Dict[str, Any], bool]:
    """Runs the job on this rank; returns (the report, rank 0 only, and whether Ctrl-C stopped it)."""
    import lightning as L

    from lightning_mics.app.callbacks import StopOnInterrupt
    from lightning_mics.app.report import RunStats, write_report

    schema.check_config(cfg)
    ckpt_path = _checkpoint_to_resume(cfg.get("ckpt_path"))
    out_dir = HydraConfig.get().runtime.output_dir
    L.seed_everything(cfg.seed, workers=True)
    datamodule = _instantiate(cfg.data)
    model = _instantiate(cfg.model)
    strategy = _instantiate(cfg.strategy)
    stats, stop = RunStats(), StopOnInterrupt()
    logger = _instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [*_instantiate_dict(cfg.get("callbacks")), stats, stop]
    checkpoint = next((c for c in callbacks if isinstance(c, L.pytorch.callbacks.ModelCheckpoint)), None)
    # callbacks.checkpoint=null means no checkpoint at all, not Lightning's default ModelCheckpoint
    no_checkpoint = {} if checkpoint else {"enable_checkpointing": False}
    trainer = _instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks, **no_checkpoint)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)

    interrupted = stop.stopped_at is not None
    report: Dict[str, Any] = {}
    last = (checkpoint.last_model_path or None) if checkpoint else None
    if trainer.is_global_zero and cfg.report:
        metrics_csv = os.path.join(logger.log_dir, "metrics.csv") if logger else ""
        extra = {"output_dir": out_dir, "data": getattr(datamodule, "source", None),
                 "corpus": getattr(datamodule, "summary", None), "model": cfg.model.get("_target_"),
                 "model_params": sum(p.numel() for p in model.parameters()), "resumed_from": ckpt_path,
                 "stopped_by": "Ctrl-C (SIGINT)" if interrupted else None, "last_checkpoint": last}
        report = write_report(trainer, stats, out_dir, metrics_csv, extra=extra)
        _log_report(report, out_dir)
    if trainer.is_global_zero:
        _log_checkpoint(last, checkpoint is not None, trainer.global_step, trainer.max_steps)
    return report, interrupted


def _quoted(path: str) -> str:
    """``path`` as a Hydra override's value: quoted when Hydra's grammar would read a character of it."""
    if not any(c in path for c in " =,[]{}()'\"\\:$*?"):
        return path
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _log_checkpoint(last: Optional[str], enabled: bool, step: int, max_steps: int) -> None:
    """Where the run's last checkpoint is, at every end of training (max_steps, the data's end, Ctrl-C)."""
    if not last:
        why = "" if enabled else " (callbacks.checkpoint=null)"
        log.info(f"[checkpoint] none saved{why}, after optimizer step {step}")
        return
    more = f" trainer.max_steps=<more than {step}>" if 0 < max_steps <= step else ""
    log.info(f"[checkpoint] optimizer step {step} saved in {last}; continue with ckpt_path={_quoted(last)}{more}")


def _log_report(report: Dict[str, Any], out_dir: str) -> None:
    from lightning_mics.app.report import summary_lines

    lines = [f"[report] {line}" for line in summary_lines(report)]
    lines.append(f"[report] written to {out_dir}/{', '.join(report['files'])}")
    log.info("\n".join(lines))


def _log_failure(error: BaseException) -> None:
    """The error that ends the job, into this rank's log file (``train.log`` on rank 0) only: Hydra prints it on
    the console itself. A mistake found before training (:class:`UsageError`) as its one message; anything else
    with its traceback."""
    if isinstance(error, SystemExit):  # Lightning's after a second Ctrl-C (its own message is logged already)
        if error.code in (0, None):
            return
        text, exc_info = f"the job stopped with exit status {error.code}", None
    elif isinstance(error, UsageError):
        text, exc_info = f"the job stopped: {error}", None
    elif isinstance(error, KeyboardInterrupt):
        text, exc_info = "the job stopped: Ctrl-C", None
    else:
        text, exc_info = "the job failed:", (type(error), error, error.__traceback__)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, text, None, exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _run(cfg: DictConfig) -> None:
    """The Hydra task: one job, on every rank. Exits with 130 when Ctrl-C stopped it (a sweep stops there too)."""
    launched_here = "LOCAL_RANK" not in os.environ  # rank 0 of this job (ranks 1.. are its children)
    env_before = dict(os.environ)
    release_groups_at_exit()  # [Note: every rank releases its groups]
    _route_lightning_logs()
    if launched_here:
        _prepare_multirun_job()
    try:
        _, interrupted = train(cfg)
    except BaseException as e:
        _log_failure(e)
        raise
    finally:
        if launched_here and HydraConfig.get().mode == RunMode.MULTIRUN:
            release_all_groups()
            os.environ.clear()
            os.environ.update(env_before)
    if interrupted:
        raise SystemExit(130)


_hydra_main = hydra.main(config_path=CONF_PATH, config_name="config", version_base="1.3")(_run)


def main() -> None:
    """``lightning-mics-train`` (and ``python -m lightning_mics.app.train``): Hydra parses the command line."""
    _check_argv(sys.argv[1:])
    check_keys(sys.argv[1:], CONF_MODULE)  # [Note: did you mean] in keys.py
    _hydra_main()


if __name__ == "__main__":
    main()
