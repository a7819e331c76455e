"""One rank of the DiLoCo runs under Fabric: diloco_ranks.py's model and inner SGD in the usual Fabric loop
(``no_backward_sync`` while accumulating, ``fabric.backward``, ``fabric.clip_gradients``), H = 2, accumulation 2,
4 optimizer steps, 4 ranks, s = 2:

- ``loop``: the run's parameters (rank 0 also the single-process simulation of diloco_ranks.py);
- ``resumed``: the same loop saved with ``fabric.save`` after step 3 (inside a window), loaded into a new model and
  optimizer with ``fabric.load`` and run to step 4.

Once for each of ``VARIANTS``: ``window`` (H = 2) and ``streaming`` (H = 4, two fragments, a delay of one step,
fragment_mixing 0.5: fragment 1 is in flight at the save, sent after step 3 and applied after step 4).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

import lightning_mics.fabric as mics_fabric  # noqa: E402
from tests.diloco.diloco_ranks import build, data, inner_optimizer, rank_batches, simulate  # noqa: E402

STEPS, ACCUM, BATCH, CLIP = 4, 2, 4, 0.05
WINDOW = {"replica_sync": "diloco", "sync_every": 2}
VARIANTS = {"window": WINDOW, "streaming": dict(WINDOW, sync_every=4, sync_fragments=2, sync_delay=1,
                                                fragment_mixing=0.5)}


def steps(fabric, model, opt, x, y, rank, world, first, last):
    for step in range(first, last):
        for m in range(step * ACCUM, (step + 1) * ACCUM):
            idx = rank_batches(world, BATCH, rank, m)
            with fabric.no_backward_sync(model, enabled=m < (step + 1) * ACCUM - 1):
                fabric.backward(F.mse_loss(model(x[idx]), y[idx]) / ACCUM)
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad()


def params(fabric, model):
    """This replica's full parameters (each sharded one gathered over the shard group)."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()]).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    x, y = data(world, BATCH, STEPS, ACCUM)
    result = {"rank": rank}
    for name, options in VARIANTS.items():
        result[name] = run(args, world, rank, x, y, name, options)
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


def run(args, world, rank, x, y, name, options):
    strategy = mics_fabric.MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=20, **options)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    result = {}
    model = fabric.setup_module(build())
    opt = fabric.setup_optimizers(inner_optimizer(model.parameters()))
    steps(fabric, model, opt, x, y, rank, world, 0, STEPS)
    result["loop"] = params(fabric, model)
    model = fabric.setup_module(build())
    opt = fabric.setup_optimizers(inner_optimizer(model.parameters()))
    steps(fabric, model, opt, x, y, rank, world, 0, 3)
    path = Path(args.out) / f"{name}.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 3})
    model = fabric.setup_module(build())
    opt = fabric.setup_optimizers(inner_optimizer(model.parameters()))
    rest = fabric.load(path, {"model": model, "optimizer": opt})
    steps(fabric, model, opt, x, y, rank, world, rest["step"], STEPS)
    result["resumed"] = params(fabric, model)
    if rank == 0:
        groups = [list(range(g * 2, (g + 1) * 2)) for g in range(world // 2)]
        result["sim"] = simulate(dict(options, steps=STEPS, accum=ACCUM, clip=CLIP), world, BATCH, x, y, groups)
    return result


if __name__ == "__main__":
    main()
