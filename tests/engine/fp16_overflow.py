"""fp16 loss scaling under sharding: rank 0 alone blows its loss up at step 1 -> every rank skips that step.

Checks reported per rank: the loss scale after each step, whether parameters changed at each step, NaNs.
``--optimizer fused-adamw``: AdamW(fused=True), which GradScaler hands the scale and the inf flag instead of
unscaling first (Lightning's plugin skips ``unscale_`` for it).
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
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402
from tests.helpers.models import gpt  # noqa: E402

BLOW_UP_STEP = 1


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt()

    def training_step(self, batch, idx):
        loss = self.model.loss(*batch)
        if idx == BLOW_UP_STEP and self.global_rank == 0:
            loss = loss * 1e5  # scaled by 2**16 this overflows fp16 gradients on rank 0 only
        return loss

    optimizer = "sgd"

    def configure_optimizers(self):
        if self.optimizer == "fused-adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Watch(L.Callback):
    def __init__(self):
        self.scales, self.changed, self.nan = [], [], False
        self.comm_dtypes = {}
        self._before = None

    def _snapshot(self, pl_module):
        # during fit the parameters are DTensors (this rank's shard): compare the local values
        return torch.cat([p.detach().to_local().reshape(-1).clone() for p in pl_module.parameters()])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = self._snapshot(pl_module)
        self.mode = CommCounter()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        for (op, _, _), dtype in zip(self.mode.events, self.mode.dtypes):
            self.comm_dtypes.setdefault(op, set()).add(str(dtype))
        after = self._snapshot(pl_module)
        self.changed.append(bool((after != self._before).any()))
        self.nan |= bool(torch.isnan(after).any() or torch.isinf(after).any())
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "fused-adamw"))
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 61, (world * 2 * 4, 13), generator=g)
    ds = TensorDataset(x[:, :-1], x[:, 1:])
    dl = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    watch = Watch()
    # Lightning turns precision="16-mixed" into bf16 on CPU; the fp16 plugin is passed explicitly.
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=4,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=100),
                        plugins=[MixedPrecision("16-mixed", "cpu")], use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[watch])
    module = Module()
    module.optimizer = args.optimizer
    trainer.fit(module, dl)
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({
        "scales": watch.scales, "changed": watch.changed, "nan": watch.nan,
        "scaler": type(trainer.precision_plugin.scaler).__name__,
        "comm_dtypes": {op: sorted(d) for op, d in watch.comm_dtypes.items()},
    }))


if __name__ == "__main__":
    main()
