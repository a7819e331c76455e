"""The Trainer's quorum: a callback the fault-tolerant strategy puts first in the Trainer's list, that forms the
quorum at the points [Note: joining at the current step] (in groups.py) names, keeps the fit loop's
counters as a joining peer takes them, shows the quorum in the progress bar and the loggers, and keeps the
manager's committed-step count in checkpoints."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_mics.frontends import weight_averaging
from lightning_mics.frontends.fault_tolerance.groups import FaultTolerance, progress_metrics, refuse_optimizers


class TrainerQuorum(Callback):
    """See the module's docstring; ``state_key`` is fixed so a checkpoint finds it whatever the callbacks."""

    def __init__(self, ft: FaultTolerance) -> None:
        self.ft = ft
        self.trainer: Optional["pl.Trainer"] = None
        self._joining = False
        self._loops: Optional[Dict[str, Any]] = None  # the fit loop at the last on_train_batch_end (or start)
        self._steps_seen = 0
        self._loop_step = 0  # DiLoCo: the loop step at the last ``_loops``

    @property
    def state_key(self) -> str:
        return "MiCSFaultTolerance"

    def bind(self, trainer: "pl.Trainer", engine: Any, optimizers: Any) -> None:
        """Registers the state a joining peer takes (the engine's, the optimizers', the schedulers', the loop's)."""
        self.trainer = trainer
        self.ft.attach(engine, optimizers, extra_state=self._extra_state, extra_load=self._extra_load)

    # -- what a joining peer takes ([Note: joining at the current step] in groups.py) ---------------------
    def _extra_state(self) -> Dict[str, Any]:
        trainer = self.trainer
        return {"schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                "loops": self._loops, "global_step": trainer.global_step}

    def _extra_load(self, extra: Dict[str, Any]) -> None:
        trainer = self.trainer
        for config, state in zip(trainer.lr_scheduler_configs, extra.get("schedulers", [])):
            config.scheduler.load_state_dict(state)
        if self._joining:
            fit_loop = trainer.fit_loop
            fit_loop.load_state_dict(copy.deepcopy(extra["loops"]))
            fit_loop.reset()  # what a fit resumed from a checkpoint runs before on_train_start
            if not fit_loop._iteration_based_training():
                fit_loop.epoch_progress.current.completed = fit_loop.epoch_progress.current.processed
        elif extra.get("global_step") != trainer.global_step:
            raise RuntimeError(f"MiCSStrategy(fault_tolerance=True): a live peer is at loop step "
                               f"{extra.get('global_step')}, this group at {trainer.global_step}, in the middle of a "
                               "fit: allowed is the same loop in every group (its steps, accumulation, max_steps).")

    # -- the hooks --------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._loops = copy.deepcopy(trainer.fit_loop.state_dict())
        self._joining = True
        try:
            self.ft.quorum(now=True)
        finally:
            self._joining = False
        self._loops = copy.deepcopy(trainer.fit_loop.state_dict())
        self._steps_seen = len(self.ft.group.log.committed)
        self._loop_step = trainer.global_step

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.ft.quorum()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.ft.outer is not None:  # [Note: DiLoCo across fault-tolerant groups] in groups.py: a peer joins at a
            if trainer.global_step != self._loop_step:  # sync step's first batch, so the loop after every step
                self._loop_step = trainer.global_step
                self._loops = copy.deepcopy(trainer.fit_loop.state_dict())
                self._log_quorum(pl_module)
            return
        decided = len(self.ft.group.log.committed)
        if decided == self._steps_seen:  # inside an accumulation window: no commit decision yet
            return
        if decided > self._steps_seen + 1:
            raise ValueError("MiCSStrategy(fault_tolerance=True): more than one optimizer step in one training "
                             "batch; allowed is at most one (each step needs its own quorum before its forward).")
        self._steps_seen = decided
        self._loops = copy.deepcopy(trainer.fit_loop.state_dict())
        self._log_quorum(pl_module)

    def _log_quorum(self, pl_module: "pl.LightningModule") -> None:
        if not self.ft.group.log.participants:  # DiLoCo before its first sync
            return
        metrics = progress_metrics(self.ft)
        pl_module.log("quorum", metrics["quorum"], prog_bar=True, on_step=True, on_epoch=False, logger=True)
        pl_module.log("ft_failed", metrics["ft_failed"], prog_bar=True, on_step=True, on_epoch=False, logger=True)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"manager": self.ft.group.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "manager" in state_dict:
            self.ft.group.load_state_dict(state_dict["manager"])


def start(trainer: "pl.Trainer", engine: Any, optimizers: Any, device: Any, options: Any) -> FaultTolerance:
    """The managed group and the quorum callback, first in the Trainer's list ([Note: joining at the current step]
    in groups.py). Refused alike on every rank: state a joining group could not take."""
    averaging = weight_averaging.averaging_callbacks(trainer) + weight_averaging._swa_callbacks(trainer)
    if averaging:
        raise ValueError(f"MiCSStrategy(fault_tolerance=True) with {type(averaging[0]).__name__}: allowed is no "
                         "weight-averaging callback (its average is not part of the state a joining group takes).")
    refuse_optimizers(optimizers)
    ft = FaultTolerance(device, options.timeout, options.reduce_bucket_size)
    quorum = TrainerQuorum(ft)
    quorum.bind(trainer, engine, optimizers)
    trainer.callbacks.insert(0, quorum)
    return ft


def stop(strategy: Any, wait: bool) -> None:
    """The strategy's managed group shut down (``wait=False`` after a failure), the callback out of the Trainer's
    list, and the quorum's summary kept as ``strategy.fault_tolerance_summary`` (for reports)."""
    ft: Optional[FaultTolerance] = strategy.fault_tolerance
    if ft is None:
        return
    strategy.fault_tolerance_summary = ft.summary()
    ft.shutdown(wait=wait)
    strategy.fault_tolerance = None
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    if trainer is not None:
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, TrainerQuorum)]
