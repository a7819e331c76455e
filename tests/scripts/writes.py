"""Parameters written outside the optimizer step, under the optimizer-state-only layout (``zero1``: s = 1,
``shard_optimizer_state=True``, every parameter sharded) or DDP, one case after another in one process (one rank).

    python writes.py --out DIR --strategy zero1|ddp --cases clamp,swap,bits

- ``clamp``: WGAN's weight clipping, ``p.data.clamp_`` on every parameter after every step (in
  ``on_train_batch_end``), with accumulation 2 (so also between the micro-batches of a window);
- ``swap``: weights kept as a running average (made at the first batch's end) swapped in for validation and back, as
  a hand-written EMA does: the validation loss and the trained parameters;
- ``bits`` (zero1 only): under ``bf16-mixed`` with no write, taking the plain parameters back into the masters
  after every step leaves every master bit as it was ([Note: writes between steps] in lightning_mics/unit.py).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.scripts.compat import BATCH, Base, classification_data, loader, main, params, trainer_for  # noqa: E402


class Clamp(Base):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in self.parameters():
                p.data.clamp_(-0.05, 0.05)


class Swap(Base):
    """Validation runs on an average of the weights, swapped in at its start and out at its end."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            if not hasattr(self, "average"):
                self.average = [p.detach().clone() for p in self.parameters()]
            for a, p in zip(self.average, self.parameters()):
                a.lerp_(p.detach(), 0.5)

    def on_validation_epoch_start(self):
        with torch.no_grad():
            self.saved = [p.detach().clone() for p in self.parameters()]
            for a, p in zip(self.average, self.parameters()):
                p.copy_(a)

    def on_validation_epoch_end(self):
        with torch.no_grad():
            for s, p in zip(self.saved, self.parameters()):
                p.copy_(s)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)


class Bits(Base):
    """After every step: the masters before and after taking back unwritten plain parameters (bf16 copies)."""

    changed = 0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        for unit in self.trainer.strategy.engine.units:
            before = unit.shard_flat.clone()
            unit.take_writes()
            self.changed += int((unit.shard_flat.view(torch.int32) != before.view(torch.int32)).sum())


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(4 * world * BATCH)
    strategy = MiCSStrategy(sharded_data_parallel_degree=1, shard_optimizer_state=True, param_persistence_threshold=0) \
        if kind == "zero1" else None
    result = {}
    if case == "clamp":
        m = Clamp()
        trainer_for(kind, world, max_epochs=2, accumulate_grad_batches=2, strategy=strategy).fit(
            m, loader(ds, kind, world, rank))
    elif case == "swap":
        m = Swap()
        trainer = trainer_for(kind, world, max_epochs=2, limit_val_batches=2, strategy=strategy)
        trainer.fit(m, loader(ds, kind, world, rank), loader(ds, kind, world, rank))
        result["val_loss"] = float(trainer.callback_metrics["val_loss"])
    elif case == "bits":
        m = Bits()
        trainer_for(kind, world, max_steps=4, precision="bf16-mixed", strategy=strategy).fit(
            m, loader(ds, kind, world, rank))
        result["changed"] = m.changed
    else:
        raise ValueError(case)
    result["params"] = params(m)
    return result


if __name__ == "__main__":
    main(run_case)
