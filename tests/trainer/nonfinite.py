"""stop_on_nonfinite: the job stops at the first non-finite loss or gradient norm, on every rank at once.

Phases (in order, one process group):
    loss     rank --bad-rank's loss is NaN at step BAD_STEP: every rank raises NonFiniteError naming the step
    grad     rank --bad-rank's loss is finite but its gradient is NaN at step BAD_STEP (a hook on the loss)
    added    NaN added to rank --bad-rank's loss (its gradients finite) at step BAD_STEP: in the first of two
             accumulated micro-batches (accumulation 2), and under manual optimization (``manual``)
    count    3 optimizer steps with the option off and on, no NaN: the c10d collectives per step
    off      the option off, NaN loss at BAD_STEP: nothing stops (as before this option)
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.models import gpt  # noqa: E402
from lightning_mics.layout.placement import local  # noqa: E402
from lightning_mics.frontends.reliability import NonFiniteError  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

BAD_STEP = 3


class Module(L.LightningModule):
    def __init__(self, bad, bad_rank):
        super().__init__()
        self.bad, self.bad_rank = bad, bad_rank
        self.model = gpt()

    def training_step(self, batch, idx):
        loss = self.model.loss(*batch)
        if self.global_rank == self.bad_rank and self.global_step == BAD_STEP:
            if self.bad == "loss":
                loss = loss * float("nan")
            elif self.bad == "grad":
                loss.register_hook(lambda g: g * float("nan"))
            elif self.bad == "added" and idx % 2 == 0:  # the window's first micro-batch (or every batch, manual)
                loss = loss + float("nan")  # the gradients stay finite
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Manual(Module):
    """The same step under manual optimization: ``manual_backward``, then the optimizer's step."""

    def __init__(self, bad, bad_rank):
        super().__init__(bad, bad_rank)
        self.automatic_optimization = False

    def training_step(self, batch, idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, 0))
        opt.step()


class Count(Callback):
    def __init__(self):
        self.per_step = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = CommCounter()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.per_step.append([[op, list(g) if g else None] for op, g, _ in self.mode.events])


def fit(world, rank, on, bad, bad_rank, steps, callbacks=(), accum=1, manual=False):
    torch.manual_seed(0)
    x = torch.randint(0, 61, (64 * world, 13))
    ds = TensorDataset(x[:, :-1], x[:, 1:])
    dl = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False, callbacks=list(callbacks), accumulate_grad_batches=accum,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0,
                                              stop_on_nonfinite=on))
    module = (Manual if manual else Module)(bad, bad_rank)
    error = None
    try:
        trainer.fit(module, dl)
    except NonFiniteError as err:
        error = str(err)
    params_finite = all(bool(torch.isfinite(local(p.detach())).all()) for p in module.parameters())
    return {"error": error, "global_step": trainer.global_step, "params_finite": params_finite}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bad-rank", type=int, default=1)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    res = {
        "loss": fit(world, rank, True, "loss", args.bad_rank, 8),
        "grad": fit(world, rank, True, "grad", args.bad_rank, 8),
        "off": fit(world, rank, False, "loss", args.bad_rank, BAD_STEP + 2),
        "added": fit(world, rank, True, "added", args.bad_rank, 8, accum=2),
        "added_manual": fit(world, rank, True, "added", args.bad_rank, 8, manual=True),
    }
    for on in (False, True):
        counter = Count()
        fit(world, rank, on, None, args.bad_rank, 3, [counter])
        res[f"count_{'on' if on else 'off'}"] = counter.per_step
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
