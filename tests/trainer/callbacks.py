"""Lightning's callbacks that steer a fit, under a strategy, one case after another in one process (one rank):

    python callbacks.py --out DIR --strategy mics|mics_os|zero1|ddp --cases accum_schedule,early_stop,...

- ``accum_schedule``: ``GradientAccumulationScheduler({0: 1, 1: 3, 2: 2})``, the window changing between epochs
  (the engine learns a window's end from Lightning's ``no_backward_sync``, not from a setting read at setup);
- ``early_stop``: ``EarlyStopping`` on a validation loss logged with ``sync_dist``: the epoch it stops at;
- ``last``: ``ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)``, then a second fit to 4 epochs
  resumed with ``ckpt_path="last"``: the files kept and the parameters;
- ``on_exception``: ``training_step`` raises at step 5 on every rank, ``OnExceptionCheckpoint`` saves, and a second
  fit resumes from that checkpoint to the end.

AdamW with a StepLR schedule; rank 0 saves the parameters and the case's observations (``tests/helpers/trainer_cases.py``'s ``main``).
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, GradientAccumulationScheduler  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

from tests.helpers.trainer_cases import BATCH, Base, classification_data, loader, main, params, strategy_of, trainer_for  # noqa: E402

RAISE_AT = 5


class Logged(Base):
    explode = False

    def training_step(self, batch, batch_idx):
        if self.explode and self.trainer.global_step == RAISE_AT:
            raise RuntimeError(f"raised at step {RAISE_AT}")
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(8 * world * BATCH)

    def fit(m, ckpt_path=None, **kwargs):
        trainer = trainer_for(kind, world, strategy=strategy_of(kind), **kwargs)
        trainer.fit(m, loader(ds, kind, world, rank), loader(ds, kind, world, rank), ckpt_path=ckpt_path)
        return trainer

    result, m = {}, Logged()
    if case == "accum_schedule":
        fit(m, max_epochs=3, limit_val_batches=0, callbacks=[GradientAccumulationScheduler({0: 1, 1: 3, 2: 2})])
    elif case == "early_stop":
        trainer = fit(m, max_epochs=8, limit_val_batches=2, callbacks=[EarlyStopping("val_loss", patience=1,
                                                                                     min_delta=0.5)])
        result["epoch"] = trainer.current_epoch
    elif case == "last":
        d = Path(out) / f"last_{kind}"

        def kept():
            return ModelCheckpoint(d, monitor="val_loss", save_top_k=2, save_last=True)
        fit(m, max_epochs=2, limit_val_batches=2, enable_checkpointing=True, callbacks=[kept()])
        m = Logged()
        fit(m, "last", max_epochs=4, limit_val_batches=2, enable_checkpointing=True, callbacks=[kept()])
        result["files"] = sorted(os.listdir(d))
    elif case == "on_exception":
        d = Path(out) / f"on_exception_{kind}"
        m.explode = True
        try:
            fit(m, max_epochs=2, limit_val_batches=0, enable_checkpointing=True, callbacks=[OnExceptionCheckpoint(d)])
        except RuntimeError as e:
            result["raised"] = str(e)
        m = Logged()
        fit(m, str(d / "on_exception.ckpt"), max_epochs=2, limit_val_batches=0)
        result["files"] = sorted(os.listdir(d))
    else:
        raise ValueError(case)
    result["params"] = params(m)
    return result


if __name__ == "__main__":
    main(run_case)
