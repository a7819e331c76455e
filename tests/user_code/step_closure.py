"""What runs inside an optimizer step's closure, and the gradients user code reaches through the module, under a
strategy, one case after another in one process (one rank; ``tests/helpers/trainer_cases.py``'s ``main``):

    python step_closure.py --out DIR --strategy mics|mics_os|zero1|ddp --cases no_backward,clamp_before_step,...

- ``no_backward``: the last epoch runs forwards without backward in one window (Lightning's
  ``StochasticWeightAveraging`` does so for its batch-norm epoch); its closing step reuses the last gradients;
- ``clamp_before_step``: every weight clamped in ``on_before_optimizer_step`` (after backward, before the update);
- ``lbfgs``: LBFGS with ``max_iter=3``, its closure evaluated again after the masters moved;
- ``data_assign``: ``p.data = p.data.clamp(...)`` after every step (ZeRO-1's plain parameters; on a DTensor torch
  ignores it);
- ``module_zero_grad``: manual optimization zeroing through the module (``self.zero_grad()``), half the steps with
  ``set_to_none=False``, the gradient norms read after each backward (inside the root's forward);
- ``grads_seen``: ``on_before_optimizer_step`` reads the module's gradients (``lightning_mics.grad_norm``, as
  Lightning's ``grad_norm`` under DDP) and doubles them in place;
- ``*_bf16``: under ``bf16-mixed``.

Rank 0 saves the parameters, and what the case observed.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm  # noqa: E402

from lightning_mics import grad_norm  # noqa: E402
from tests.helpers.trainer_cases import BATCH, Base, classification_data, loader, main, params, strategy_of, trainer_for  # noqa: E402
from tests.trainer.compat import EvenRows  # noqa: E402


class AdamW(Base):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class NoBackward(Callback):
    """From epoch 2 on: no backward (and so no zero_grad), one window over the epoch, as SWA's batch-norm epoch."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 2:
            trainer.fit_loop._skip_backward = True
            trainer.accumulate_grad_batches = trainer.fit_loop.max_batches


class ClampBeforeStep(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.clamp_(-0.05, 0.05)


class RebindData(Callback):
    """``p.data = p.data.clamp(...)`` after every step: a rebinding, not a write in place (WGAN-style clipping as
    some code writes it)."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        for p in pl_module.parameters():
            p.data = p.data.clamp(-0.05, 0.05)


class ModuleZeroGrad(Base):
    """Manual optimization zeroing through the module, after the step (``set_to_none=False`` on odd steps)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.loss(batch))
        self.norms = getattr(self, "norms", []) + [norms_of(self)]  # read inside the root's forward
        opt.step()
        self.zero_grad(set_to_none=batch_idx % 2 == 0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def norms_of(module):
    """The module's gradient norms: ``lightning_mics.grad_norm`` under MiCS, Lightning's ``grad_norm`` under DDP."""
    sharded = module.trainer.strategy.__class__.__name__ == "MiCSStrategy"
    return {k: float(v) for k, v in (grad_norm if sharded else lightning_grad_norm)(module, norm_type=2).items()}


class GradsSeen(AdamW):
    def on_before_optimizer_step(self, optimizer):
        self.norms = getattr(self, "norms", []) + [norms_of(self)]
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(2.0)


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(4 * world * BATCH)
    base = case.removesuffix("_bf16")
    precision = "bf16-mixed" if case.endswith("_bf16") else "32-true"
    result, callbacks, extra = {}, [], {}
    m = {"lbfgs": EvenRows, "module_zero_grad": ModuleZeroGrad, "grads_seen": GradsSeen}.get(base, AdamW)()
    if base == "no_backward":
        callbacks, extra = [NoBackward()], {"max_epochs": 3}
    elif base == "clamp_before_step":
        callbacks, extra = [ClampBeforeStep()], {"max_epochs": 2, "accumulate_grad_batches": 2}
    elif base == "data_assign":
        callbacks, extra = [RebindData()], {"max_epochs": 2}
    elif base == "lbfgs":
        m.optimizer, m.options = "LBFGS", {"max_iter": 3}
        extra = {"max_steps": 3}
    elif base in ("module_zero_grad", "grads_seen"):
        extra = {"max_epochs": 2}
    else:
        raise ValueError(case)
    trainer = trainer_for(kind, world, strategy=strategy_of(kind), callbacks=callbacks, precision=precision,
                          limit_val_batches=0, **extra)
    trainer.fit(m, loader(ds, kind, world, rank))
    if base in ("grads_seen", "module_zero_grad"):
        result["norms"] = m.norms
    result["params"] = params(m)
    return result


if __name__ == "__main__":
    main(run_case)
