"""Checkpoint, resume and reshard: phase A trains 2 steps (one epoch) under s=A and saves (full and sharded); phase B
resumes each under s=B to step 4. Rank 0 compares with an uninterrupted 4-step single-process reference (SGD with
momentum, so the optimizer state must survive the round trip)."""

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

import lightning_mics  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from tests.engine.equiv import Module, data, reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", required=True)
    ap.add_argument("--s", type=int, required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    x, y = data(world, 2, 2, 1)  # 2 batches per epoch: the checkpoint falls on an epoch boundary
    ds = TensorDataset(x, y)
    dl = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    result = {}
    for kind in ("full", "sharded"):  # the same run saved both ways, each resumed under s=B
        result[kind] = run(args, world, rank, x, y, dl, kind)
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


def run(args, world, rank, x, y, dl, kind):
    ckpt = Path(args.out) / f"mid_{kind}.ckpt"
    epochs = 1 if args.phase == "a" else 2  # phase "c": 2 epochs uninterrupted (a control)
    # Saved during training, at the end of epoch 0, as users do with ModelCheckpoint.
    saver = ModelCheckpoint(dirpath=args.out, filename=f"mid_{kind}", save_on_train_epoch_end=True)
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=epochs, use_distributed_sampler=False,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=args.s, param_persistence_threshold=100,
                                              state_dict_type=kind),
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[saver] if args.phase == "a" else [], enable_checkpointing=args.phase == "a")
    torch.manual_seed(0)
    module = Module("gpt", "sgd")
    trainer.fit(module, dl, ckpt_path=str(ckpt) if args.phase == "b" else None)
    if args.phase == "a":
        return {}
    result = {"step": trainer.global_step}
    if rank == 0:
        class A:
            model, optimizer, batch, accum, steps, clip = "gpt", "sgd", 2, 1, 4, 0.0
        _, ref, _ = reference(A, world, torch.cat([x, x]), torch.cat([y, y]))  # epoch 1 = epoch 0 again
        got = module.model.state_dict()
        result["max_abs"] = max((got[k] - ref[k]).abs().max().item() for k in ref)
        if args.phase == "c":
            return result
        plain = lightning_mics.consolidate(ckpt)
        result["ckpt_keys_ok"] = sorted(plain["state_dict"]) == sorted(module.state_dict())
        states = plain["optimizer_states"][0]["state"].values()
        result["ckpt_opt_momentum"] = all("momentum_buffer" in st for st in states)
    return result


if __name__ == "__main__":
    main()
