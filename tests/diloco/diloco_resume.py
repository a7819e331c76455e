"""One rank of the DiLoCo checkpoint runs ([Note: DiLoCo in checkpoints] in lightning_mics/checkpoint/diloco.py), with
diloco_ranks.py's model, data and inner SGD with momentum, H = 2, 3 optimizer steps per epoch:

- ``whole``: 2 epochs (6 steps, outer steps after steps 2, 4, 6) uninterrupted;
- ``first``: epoch 0 only, a sharded checkpoint saved at its end by ModelCheckpoint: after step 3, one step into a
  window, when the replica groups' masters and inner momenta differ;
- ``resumed``: ``fit(ckpt_path=...)`` of that checkpoint to the end of epoch 1.
Every rank writes its replica's parameters after ``whole`` and ``resumed``, and what it held at the save; once for
each configuration of ``CONFIGS``: ``window`` (H = 2) and ``streaming`` (H = 4, two fragments, a delay of one step,
fragment_mixing 0.5: fragment 1 is sent after step 3 and applies after step 4, so the save holds it in flight).
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
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.diloco.diloco_ranks import Module, data  # noqa: E402

OPTIONS = dict(sharded_data_parallel_degree=2, param_persistence_threshold=20, replica_sync="diloco", sync_every=2)
CONFIGS = {"window": OPTIONS, "streaming": dict(OPTIONS, sync_every=4, sync_fragments=2, sync_delay=1,
                                                fragment_mixing=0.5)}


class AtSave(L.Callback):
    """This replica's masters when the checkpoint is written (they differ across replica groups then)."""

    def __init__(self):
        self.masters = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        engine = trainer.strategy.engine
        self.masters = torch.cat([m.reshape(-1) for m in engine.outer.masters]).tolist()
        self.steps = engine.outer.steps
        self.in_flight = None if engine.outer.in_flight is None else engine.outer.in_flight.fragment


def fit(options, out, world, dl, epochs, save=False, ckpt=None):
    callbacks = [AtSave()]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=out, filename="first", save_on_train_epoch_end=True))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=epochs, use_distributed_sampler=False,
                        strategy=MiCSStrategy(**options), logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=save,
                        limit_val_batches=0, num_sanity_val_steps=0)
    module = Module()
    trainer.fit(module, dl, ckpt_path=ckpt)
    params = torch.cat([p.detach().reshape(-1) for p in module.model.parameters()]).tolist()
    return {"params": params, "step": trainer.global_step, "at_save": callbacks[0].masters,
            "steps_at_save": getattr(callbacks[0], "steps", None),
            "in_flight_at_save": getattr(callbacks[0], "in_flight", None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    x, y = data(world, 4, 3, 1)  # 3 batches of 4 per rank per epoch
    ds = TensorDataset(x, y)
    dl = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    result = {"rank": rank}
    for name, options in CONFIGS.items():
        out = Path(args.out) / name
        result[name] = {"whole": fit(options, out, world, dl, 2), "first": fit(options, out, world, dl, 1, save=True)}
        result[name]["resumed"] = fit(options, out, world, dl, 2, ckpt=str(out / "first.ckpt"))
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
