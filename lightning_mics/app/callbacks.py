"""The main job's Lightning callbacks that keep progress: a periodic ``last`` checkpoint that also holds the step
training ended on, and a graceful stop on Ctrl-C.

[Note: Ctrl-C]
Ctrl-C sends SIGINT to every process of the terminal's foreground group: rank 0 and the ranks Lightning launched
from it. Without a handler each raises ``KeyboardInterrupt`` wherever it is, Lightning tears the job down and
exits with status 1, and nothing since the last checkpoint is kept. :class:`StopOnInterrupt` replaces the handler
while training runs: the first SIGINT only sets a flag; at the end of every optimizer step the ranks agree
(``strategy.reduce_boolean_decision``: one all-reduce of one element per optimizer step) whether any rank saw it,
so all stop after the same step, even when the signal reached one rank only or reached the ranks in different
steps. They then finish as a fit that reached ``max_steps`` does: the validation Lightning runs on an early stop,
:class:`LastCheckpoint` saves ``last`` at that step, the report is written, and the app exits with 130 (128 +
SIGINT, what a shell reports for a job ended by Ctrl-C). A second Ctrl-C raises ``KeyboardInterrupt`` at once
(Lightning's own handling: the job ends without saving).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, which also saves ``last`` at the step training ends on.

    Lightning saves ``last`` at the end of training only if it never saved during it, so with
    ``every_n_train_steps`` a run whose ``max_steps`` is not a multiple of it, or one stopped early by Ctrl-C,
    would keep the last periodic save and lose the steps after it. This one saves at the end of the batch whose
    optimizer step ends training (``max_steps`` reached, or ``trainer.should_stop`` set by then), where a
    periodic save would be: the loops still stand after that batch of the epoch, so a resume continues exactly
    as the run would have (saved after ``on_train_end``, the epoch would count as finished and a resume would
    start the next one). A stop decided later (say in a validation callback) is saved at ``on_train_end``."""

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        ends = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        if ends and self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)


class StopOnInterrupt(L.Callback):
    """Ctrl-C ends training after the current optimizer step, on every rank at the same step (see [Note: Ctrl-C]).

    ``stopped_at`` is the global step training stopped at, or None if it was not interrupted."""

    def __init__(self) -> None:
        self.requested = False
        self.stopped_at: Optional[int] = None
        self._previous: Any = None
        self._last_step = -1
        self._rank = 0

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._last_step = trainer.global_step  # the first boundary is after the first optimizer step (resumed or not)
        self._rank = trainer.global_rank
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            self._restore()
            raise KeyboardInterrupt
        self.requested = True
        if self._rank == 0:  # os.write: print() inside a signal handler can hit a print it interrupted
            os.write(2, b"\n[Ctrl-C] stopping after this optimizer step: every rank stops at the same step, then "
                        b"checkpoints/last.ckpt and the report are written (Ctrl-C again: stop now, without saving)\n")

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # inside an accumulation window: no optimizer step yet
            return
        self._last_step = trainer.global_step
        if trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            self.stopped_at = trainer.global_step
            trainer.should_stop = True

    def teardown(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
