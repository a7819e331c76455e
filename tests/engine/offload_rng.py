"""One rank of tests/engine/test_offload_rng.py: the engine (a real ``L.Fabric`` with ``MiCSStrategy``, s = 2) trains the
dropout stack of tests/helpers/offload_check.py three ways from the same seeds: no checkpointing, grouped
checkpointing (groups of 2), and grouped checkpointing with ``activation_offload``. Each rank's dropout draws its
own masks (seeded by rank); after every backward it records its gradient shards and its RNG state, after every step
its parameter shards. The test compares them bit for bit ([Note: offload and the RNG] in activations.py)."""

import argparse
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_mics.fabric import MiCSStrategy  # noqa: E402
from tests.helpers.offload_check import BATCH, D, DropoutStack  # noqa: E402

BLOCK = "tests.helpers.offload_check.DropoutBlock"
STEPS = 3


def _local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def run(world, checkpointing, offload):
    options = dict(sharded_data_parallel_degree=2, param_persistence_threshold=0)
    if checkpointing:
        options.update(activation_checkpointing=[BLOCK], checkpoint_group_size=2, activation_offload=offload)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=MiCSStrategy(**options))
    fabric.launch()
    torch.manual_seed(0)
    model = DropoutStack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    rank = fabric.global_rank
    x = torch.randn(STEPS, BATCH, D, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(100 + rank)  # each rank its own masks
    grads, params, rng, losses = [], [], [], []
    for step in range(STEPS):
        loss = model(x[step]).square().mean()
        fabric.backward(loss)
        losses.append(loss.detach().clone())
        grads.append([_local(p.grad) for p in model.parameters() if p.grad is not None])
        rng.append(torch.get_rng_state().clone())
        opt.step()
        offloaded = fabric.strategy.comm_stats.get("mem/offloaded_bytes", 0.0)  # the step's telemetry
        opt.zero_grad()
        params.append([_local(p) for p in model.parameters()])
    return {"losses": losses, "grads": grads, "params": params, "rng": rng,
            "offloaded": offloaded,
            "n_grads": len(grads[0])}


def same(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    runs = {name: run(args.world, ckpt, off) for name, (ckpt, off) in
            {"plain": (False, False), "checkpointed": (True, False), "offloaded": (True, True)}.items()}
    ref = runs["checkpointed"]
    out = {"n_grads": ref["n_grads"], "offloaded_bytes": runs["offloaded"]["offloaded"],
           "losses": [float(v) for v in ref["losses"]]}
    for name in ("plain", "offloaded"):
        for key in ("losses", "grads", "params", "rng"):
            out[f"{key}_equal_{name}"] = same(runs[name][key], ref[key])
    # the masks moved between steps (else an RNG that never advanced would also compare equal)
    out["rng_advances"] = not any(torch.equal(a, b) for a, b in zip(ref["rng"], ref["rng"][1:]))
    rank = torch.distributed.get_rank()
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
