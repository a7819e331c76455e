"""One rank of a fit that records where every reduce-scatter's input lies ([Note: staging in place] in
gradients.py): in the full-parameter storage of the unit being released, or in a buffer of its own (the root
kept gathered inside an accumulation window). Also records, after every batch, which units still hold their
full storage, and (rank 0) compares the parameters with one plain process on the same global batches."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.engine.equiv import Module, data, reference  # noqa: E402

REDUCE_SCATTER = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"}


class WhereStaged(TorchDispatchMode):
    def __init__(self, units, events):
        super().__init__()
        self.units, self.events = units, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._schema.name.split("::")[-1] in REDUCE_SCATTER:
            src = args[1] if isinstance(args[1], torch.Tensor) else args[1][0]
            ptr = src.untyped_storage().data_ptr()
            owner = [u.path for u in self.units if u.full_flat.untyped_storage().nbytes()
                     and u.full_flat.untyped_storage().data_ptr() == ptr]
            self.events.append(owner[0] if owner else None)
        return func(*args, **(kwargs or {}))


class Record(L.Callback):
    def __init__(self):
        self.mode, self.per_batch, self.held, self.units = None, [], [], []

    def on_train_start(self, trainer, pl_module):
        self.units = [u.path for u in trainer.strategy.engine.units]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        events = []
        self.per_batch.append(events)
        self.mode = WhereStaged(trainer.strategy.engine.units, events)
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.held.append([u.path for u in trainer.strategy.engine.units if u.full_flat.untyped_storage().nbytes()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--precision", default="32-true")
    args = ap.parse_args()
    args.model, args.optimizer, args.batch, args.clip = "gpt", "adamw", 2, 0.0
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    x, y = data(world, args.batch, args.steps, args.accum)
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=args.batch, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    rec = Record()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=args.steps, accumulate_grad_batches=args.accum,
                        precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[rec],
                        strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0))
    torch.manual_seed(0)
    module = Module("gpt", "adamw")
    trainer.fit(module, loader)
    result = {"rank": rank, "units": rec.units, "staged": rec.per_batch, "held": rec.held}
    if rank == 0:
        _, ref, _ = reference(args, world, x, y)
        got = {k[len("model."):]: v for k, v in trainer.strategy.lightning_module_state_dict().items()}
        result["max_rel"] = max(((got[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref.items())
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
