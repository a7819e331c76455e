"""The main job: train a small GPT on a byte corpus with the configured strategy (default: MiCS). Hydra app.

    lightning-mics-train                                   # = python -m lightning_mics.app.train; CPU, 2 ranks
    lightning-mics-train strategy.sharded_data_parallel_degree=2 trainer.devices=4 \\
        trainer.accumulate_grad_batches=4 model.n_layer=6
    lightning-mics-train strategy=ddp                      # same job on Lightning's DDP
    lightning-mics-train trainer=gpu model.n_layer=12 model.n_embd=768
    lightning-mics-train -m strategy.sharded_data_parallel_degree=1,2 trainer.devices=2   # sweep
    lightning-mics-train --cfg job                         # print the composed config and exit
    lightning-mics-train --config-dir my_conf model=my_model data=my_data   # your own config groups

Configs live in ``conf/`` at the repository root; the wheel installs that folder as the package
``lightning_mics.app.conf`` (see pyproject.toml) and the app reads it through Hydra's search path
``pkg://lightning_mics.app.conf``, in an installed wheel and in an editable install alike, from any working
folder. ``--config-dir DIR`` (or ``hydra.searchpath=[file://DIR]``) adds a folder of your own config groups
(``DIR/model/my_model.yaml`` selected as ``model=my_model``). Each run writes into its Hydra output folder
(``outputs/<date>/<time>/``, or ``multirun/<date>/<time>/<job>/``) under the working folder:
``csv/metrics.csv``, ``checkpoints/last.ckpt``, ``report.json``, ``report.md`` and ``loss.png``.

[Note: ranks under Hydra]
Lightning's ``_SubprocessScriptLauncher`` starts ranks 1..n-1 by re-running this command with
``hydra.run.dir=<rank 0's run.dir> hydra.output_subdir=null`` appended, so every rank composes the same config
and shares rank 0's output folder. That works for a single run only: under ``-m`` the children would re-run
the whole sweep, and ``hydra.run.dir`` is not the sweep job's folder. So in a multirun job, rank 0 first
rewrites ``sys.argv`` to this job's own overrides (no ``-m``) and points ``hydra.run.dir`` at the job's output
folder; after the job it destroys the process group and restores the environment variables the launcher set
(``LOCAL_RANK`` left behind would make the next job believe its processes were launched externally).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write

from lightning_mics.config import MiCSConfig

# The configs as a Python package (conf/ mapped to lightning_mics.app.conf by pyproject.toml).
CONF_MODULE = "lightning_mics.app.conf"
CONF_PATH = f"pkg://{CONF_MODULE}"


@dataclass
class MiCSStrategyConf(MiCSConfig):
    """Schema of ``conf/strategy/mics.yaml``: every MiCSConfig option plus the class to instantiate."""

    _target_: str = "lightning_mics.MiCSStrategy"


ConfigStore.instance().store(group="strategy", name="mics_schema", node=MiCSStrategyConf)

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


def _instantiate_dict(node: Any) -> List[Any]:
    return [hydra.utils.instantiate(v, _convert_="all") for v in (node or {}).values() if v is not None]


def train(cfg: DictConfig) -> Dict[str, Any]:
    import lightning as L

    from lightning_mics.app.report import RunStats, write_report

    out_dir = HydraConfig.get().runtime.output_dir
    L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data, _convert_="all")
    model = hydra.utils.instantiate(cfg.model, _convert_="all")
    strategy = hydra.utils.instantiate(cfg.strategy, _convert_="all")
    stats = RunStats()
    logger = hydra.utils.instantiate(cfg.logger, _convert_="all") if cfg.get("logger") else False
    callbacks = [*_instantiate_dict(cfg.get("callbacks")), stats]
    # callbacks.checkpoint=null means no checkpoint at all, not Lightning's default ModelCheckpoint
    no_checkpoint = {} if any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks) else {
        "enable_checkpointing": False}
    trainer = hydra.utils.instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks,
                                      _convert_="all", **no_checkpoint)
    trainer.fit(model, datamodule=datamodule)

    report: Dict[str, Any] = {}
    if trainer.is_global_zero and cfg.report:
        metrics_csv = os.path.join(logger.log_dir, "metrics.csv") if logger else ""
        report = write_report(trainer, stats, out_dir, metrics_csv,
                              extra={"output_dir": out_dir, "data": getattr(datamodule, "source", None),
                                     "model": cfg.model.get("_target_"),
                                     "model_params": sum(p.numel() for p in model.parameters())})
        _print_report(report, out_dir)
    return report


def _print_report(report: Dict[str, Any], out_dir: str) -> None:
    from lightning_mics.app.report import summary_lines

    lines = [f"[report] {line}" for line in summary_lines(report)]
    lines.append(f"[report] written to {out_dir}/report.md, report.json, loss.png")
    print("\n".join(lines), flush=True)


@hydra.main(config_path=CONF_PATH, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    launched_here = "LOCAL_RANK" not in os.environ  # rank 0 of this job (ranks 1.. are its children)
    env_before = dict(os.environ)
    if launched_here:
        _prepare_multirun_job()
    try:
        train(cfg)
    finally:
        if launched_here and HydraConfig.get().mode == RunMode.MULTIRUN:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.clear()
            os.environ.update(env_before)


if __name__ == "__main__":
    main()
