"""Lightning's ``StochasticWeightAveraging`` under a strategy ([Note: SWA over the shards] in
lightning_mics/frontends/weight_averaging.py), one case after another in one process (one rank; ``compat.py``'s ``main``):

    python swa.py --out DIR --strategy mics|mics_os|mics_full|zero1|ddp --cases swa,swa_bn

- ``swa``: AdamW with a StepLR schedule (the callback swaps in its SWALR from epoch 2), validation every epoch;
- ``swa_bf16``: ``swa`` under ``bf16-mixed``;
- ``swa_bn``: SGD with momentum, a batch norm before the head: after the last epoch the callback copies the average
  in and runs one more epoch of forwards without backward to recompute the running statistics, whose closing step
  reuses the last gradients (zeroed by the validation's ``on_validation_model_zero_grad``).

5 epochs, a checkpoint saved at the end of the second (the average in the callback's state), then a second fit
resumed from it. Rank 0 saves the validation losses, the parameters and buffers after fit, the resumed fit's
parameters, and what the average holds on this rank. ``mics_full``: MiCS at s = 2 with ``state_dict_type="full"``.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import StochasticWeightAveraging  # noqa: E402

from tests.scripts.compat import BATCH, D, Base, classification_data, loader, main, params  # noqa: E402
from tests.scripts.compat import strategy_for, trainer_for  # noqa: E402
from tests.scripts.writes import strategy_of  # noqa: E402

SAVE_AT = 1


class Tracked(Base):
    path = None

    def __init__(self, bn=False):
        super().__init__()
        self.bn = bn
        if bn:
            self.net.head = nn.Sequential(nn.BatchNorm1d(D), self.net.head)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def on_train_epoch_end(self):
        self.losses = getattr(self, "losses", []) + [float(self.trainer.callback_metrics.get("val_loss", -1.0))]
        if self.path is not None and self.current_epoch == SAVE_AT:
            self.trainer.save_checkpoint(self.path)

    def configure_optimizers(self):
        if self.bn:  # AdamW would turn the zero gradient of the bias before the norm into steps of its noise
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(4 * world * BATCH)
    base = kind.replace("_full", "")

    def fit(m, ckpt_path=None):
        strategy = strategy_for(base, state_dict_type="full") if kind.endswith("_full") else strategy_of(kind)
        callback = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)
        trainer = trainer_for(base, world, max_epochs=5, limit_val_batches=2, strategy=strategy, callbacks=[callback],
                              precision="bf16-mixed" if case.endswith("_bf16") else "32-true")
        trainer.fit(m, loader(ds, base, world, rank), loader(ds, base, world, rank), ckpt_path=ckpt_path)
        return callback

    first = Tracked(bn=case == "swa_bn")
    first.path = Path(out) / f"{case}_{kind}.ckpt"
    callback = fit(first)
    average = [p.detach() for p in callback._average_model.parameters()]
    result = {"losses": first.losses, "params": params(first),
              "average_dtypes": sorted({str(p.dtype) for p in average}),
              "buffers": {n: b.clone() for n, b in first.named_buffers()},
              "average_types": sorted({type(p).__name__ for p in average}),
              "average_held": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in average),
              "numel": sum(p.numel() for p in average)}
    again = Tracked(bn=case == "swa_bn")
    fit(again, first.path)
    result.update(resumed=params(again), resumed_losses=again.losses)
    return result


if __name__ == "__main__":
    main(run_case)
