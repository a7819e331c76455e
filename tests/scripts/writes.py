"""Parameters read and written outside the optimizer step, under the layouts with ``shard_optimizer_state=True``
(every parameter sharded) or DDP, one case after another in one process (one rank):

- ``zero1``: s = 1, the optimizer-state-only layout;
- ``mics``: s = 2 (the root kept gathered between the micro-batches of a window);
- ``mics_os``: s = 2, the optimizer's rows over the replicas (r = 2 on 4 ranks); ``mics_os_q8``: the same with
  ``quantize_gradients="error_feedback"`` (the rows' change travels in int8); ``mics_os_q8_exact``: with
  ``quantization_block_size=1``, a scale per element, so that int8 carries every value without rounding.

    python writes.py --out DIR --strategy zero1|mics|mics_os|mics_os_q8|mics_os_q8_exact|ddp --cases clamp,swap,read

- ``clamp``: WGAN's weight clipping, ``p.data.clamp_`` on every parameter after every step (in
  ``on_train_batch_end``), with accumulation 2 (so also between the micro-batches of a window);
- ``clamp_save``: the clamp, and right after it, in the same hook, ``trainer.save_checkpoint`` once: the
  checkpoint (consolidated: ``lightning_mics.consolidate``) must hold the clamped parameters;
  ``clamp_save_bf16``: the same under ``bf16-mixed``;
- ``swap``: weights kept as a running average (made at the first batch's end) swapped in for validation and back, as
  a hand-written EMA does: the validation loss and the trained parameters;
- ``swap_bf16``: ``swap`` under ``bf16-mixed``;
- ``penalty``: an L2 penalty over the parameters added to the loss in ``training_step``, outside the module's
  forward, with accumulation 2, written as under FSDP2: a DTensor parameter through ``full_tensor`` (a collective
  whose backward hands this rank's rows of the gradient to the DTensor's ``.grad``, where the engine adds its own);
- ``read``: every parameter's norm, read in ``on_train_batch_end`` after every step (a DTensor's through
  ``full_tensor``);
- ``start`` (zero1 and ddp): L2-SP, the distance from the weights kept at ``on_fit_start`` added to the loss in
  ``training_step``, a fit of one epoch saving a checkpoint and a second fit resumed from it; with the types the
  module's parameters have in the hooks (DDP's: plain in every one) and the parameters after each fit;
- ``bits`` (zero1 only): under ``bf16-mixed`` with no write, taking the plain parameters back into the masters
  after every step leaves every master bit as it was ([Note: writes between steps] in lightning_mics/engine/user_code/write_back.py).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_mics import MiCSStrategy, consolidate  # noqa: E402
from lightning_mics.engine.unit import ShardedState  # noqa: E402
from tests.scripts.compat import BATCH, Base, classification_data, loader, main, params, strategy_for  # noqa: E402
from tests.scripts.compat import trainer_for  # noqa: E402


def whole(p):
    """A parameter as one full tensor on every rank: a released unit's DTensor through ``full_tensor``."""
    return p.full_tensor() if isinstance(p, DTensor) else p


class Clamp(Base):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in self.parameters():
                p.data.clamp_(-0.05, 0.05)


class ClampSave(Clamp):
    """The clamp, then a checkpoint saved in the same hook: before the next step reads the masters."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.trainer.global_step == 3:
            self.trainer.save_checkpoint(self.path)
            self.at_save = {n: whole(p).detach().clone() for n, p in self.named_parameters()}  # collective


def kinds(module):
    return sorted({type(p).__name__ for p in module.parameters()})


class FromStart(Base):
    """L2-SP: the weights kept at on_fit_start pull the parameters back in every training_step. A resumed fit
    keeps them at on_train_start: Lightning restores a checkpoint before on_fit_start under DDP, after it under
    the sharded strategies (``restore_checkpoint_after_setup``, as FSDP's), and before on_train_start under both."""

    def on_fit_start(self):
        self.start = [p.detach().clone() for p in self.parameters()]
        self.seen = {"on_fit_start": kinds(self)}

    def on_train_start(self):
        self.seen["on_train_start"] = kinds(self)
        if self.path is None:
            self.start = [p.detach().clone() for p in self.parameters()]

    def on_validation_start(self):
        self.seen["on_validation_start"] = kinds(self)

    def training_step(self, batch, batch_idx):
        self.seen["training_step"] = kinds(self)
        pull = sum(((p - p0) ** 2).sum() for p, p0 in zip(self.parameters(), self.start))
        return self.loss(batch) + 0.5 * pull

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def on_train_epoch_end(self):
        self.seen["on_train_epoch_end"] = kinds(self)
        if self.path is not None:
            self.trainer.save_checkpoint(self.path)


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


class Penalty(Base):
    """At s > 1 the root's parameters are plain here (kept gathered for backward) and the other units' DTensors."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch) + 0.1 * sum(whole(p).pow(2).sum() for p in self.parameters())


class Read(Base):
    """Every parameter's norm after every step, as a callback logging them reads it."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.norms = getattr(self, "norms", [])
        with torch.no_grad():
            self.norms.append(torch.stack([whole(p).norm() for p in self.parameters()]))


class Bits(Base):
    """After every step: the masters before and after taking back unwritten plain parameters (bf16 copies)."""

    changed = 0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        engine = self.trainer.strategy.engine
        for unit in engine.units:
            before = unit.shard_flat.clone()
            if unit.state is ShardedState.GATHERED:
                engine.user_code.write_back_of(unit).write_back()
            self.changed += int((unit.shard_flat.view(torch.int32) != before.view(torch.int32)).sum())


def strategy_of(kind):
    """A fresh strategy of ``kind`` (one per fit)."""
    if kind == "zero1":
        return MiCSStrategy(sharded_data_parallel_degree=1, shard_optimizer_state=True, param_persistence_threshold=0)
    if kind in ("mics_os_q8", "mics_os_q8_exact"):  # exact: one scale per element, int8 without rounding
        return strategy_for("mics_os", quantize_gradients="error_feedback",
                            quantization_block_size=1 if kind == "mics_os_q8_exact" else 2048)
    return strategy_for(kind)


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(4 * world * BATCH)
    strategy = strategy_of(kind)
    result = {}
    if case == "clamp":
        m = Clamp()
        trainer_for(kind, world, max_epochs=2, accumulate_grad_batches=2, strategy=strategy).fit(
            m, loader(ds, kind, world, rank))
    elif case in ("clamp_save", "clamp_save_bf16"):
        m = ClampSave()
        m.path = Path(out) / f"{case}_{kind}.ckpt"
        trainer_for(kind, world, max_epochs=2, strategy=strategy,
                    precision="bf16-mixed" if case == "clamp_save_bf16" else "32-true").fit(
            m, loader(ds, kind, world, rank))
        if rank == 0:  # a sharded checkpoint is a directory, read in one process with no process group
            result["saved"] = (torch.load(m.path, weights_only=False) if m.path.is_file()
                               else consolidate(m.path))["state_dict"]
            result["at_save"] = m.at_save
    elif case in ("swap", "swap_bf16"):
        m = Swap()
        trainer = trainer_for(kind, world, max_epochs=2, limit_val_batches=2, strategy=strategy,
                              precision="bf16-mixed" if case == "swap_bf16" else "32-true")
        trainer.fit(m, loader(ds, kind, world, rank), loader(ds, kind, world, rank))
        result["val_loss"] = float(trainer.callback_metrics["val_loss"])
        result["dtypes"] = sorted({str(p.dtype) for p in m.parameters()})
    elif case in ("read", "penalty"):
        m = Read() if case == "read" else Penalty()
        trainer_for(kind, world, max_epochs=2, accumulate_grad_batches=2, strategy=strategy).fit(
            m, loader(ds, kind, world, rank))
        result["norms"] = torch.stack(m.norms) if case == "read" else None
    elif case == "start":
        path = Path(out) / f"start_{kind}.ckpt"
        m, m.path = FromStart(), path
        data = loader(ds, kind, world, rank)
        trainer_for(kind, world, max_epochs=1, limit_val_batches=1, strategy=strategy).fit(m, data, data)
        result["seen"], result["first"] = m.seen, params(m)
        again, again.path = FromStart(), None
        trainer_for(kind, world, max_epochs=2, limit_val_batches=1, strategy=strategy_of(kind)).fit(
            again, data, data, ckpt_path=path)
        result["seen_resumed"], m = again.seen, again
    elif case == "bits":
        m = Bits()
        trainer_for(kind, world, max_steps=4, precision="bf16-mixed", strategy=strategy).fit(
            m, loader(ds, kind, world, rank))
        result["changed"] = m.changed
    else:
        raise ValueError(case)
    result["params"] = params(m)
    ranks = [None] * world  # every rank's parameters: the replicas must hold the same bits
    dist.all_gather_object(ranks, result["params"])
    result["ranks"] = ranks
    return result


if __name__ == "__main__":
    main(run_case)
