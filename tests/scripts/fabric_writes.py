"""Parameters read and written between steps in a Fabric loop (one rank; rank 0 also trains the reference: one plain
process on the same global batches, the union of the ranks' micro-batches).

    python fabric_writes.py --out DIR --kind mics|mics_os|zero1

compat.py's Net, SGD with momentum, accumulation 2 under ``no_backward_sync``; after every micro-batch every parameter
is scaled by 0.99 (a decay by hand: also between the micro-batches of a window), after every step clamped to [-0.05,
0.05] (WGAN's weight clipping); after every step a running average of the parameters is updated (read), and after every
second step it is swapped in for an evaluation forward under ``no_grad`` and swapped out again; right after the clamp of
step 2 the model is saved (``fabric.save``), before any step reads the masters. The loss adds an L2 penalty over every
parameter, computed outside the forward as under FSDP2 (a DTensor parameter through ``full_tensor``). Rank 0 writes
``result.json``: the largest difference to the reference's parameters and evaluation losses, and whether every rank
ended with the same parameters. Before the optimizer is built, a forward with grad and no backward (a shape probe)
leaves the root unit gathered, so ``model.parameters()`` gives its plain parameters (``point_at_shards`` in
lightning_mics/frontends/shared.py).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_mics import consolidate  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402
from tests.scripts.compat import BATCH, Net, classification_data  # noqa: E402
from tests.scripts.writes import whole  # noqa: E402

STEPS, ACCUM, LIMIT, DECAY, SAVE_AT, PENALTY = 6, 2, 0.05, 0.99, 2, 0.1
KINDS = {"mics": dict(sharded_data_parallel_degree=2),  # [Note: writes between steps] in user_code/write_back.py: the kept root
         "mics_os": dict(sharded_data_parallel_degree=2, shard_optimizer_state=True),  # [Note: rows between steps]
         "zero1": dict(sharded_data_parallel_degree=1, shard_optimizer_state=True)}


def train(model, opt, batches, forward, no_sync, average_eval, save):
    """The loop both runs share: ``batches[step][m]`` is (idx, y) of this process; ``save()`` right after the
    clamp of step SAVE_AT, before any step reads the masters."""
    average, evals = None, []
    for step in range(STEPS):
        for m in range(ACCUM):
            idx, y = batches[step][m]
            with no_sync(m < ACCUM - 1):
                loss = F.cross_entropy(model(idx), y)
                forward((loss + PENALTY * sum(whole(p).pow(2).sum() for p in model.parameters())) / ACCUM)
            with torch.no_grad():
                for p in model.parameters():
                    p.data.mul_(DECAY)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.data.clamp_(-LIMIT, LIMIT)
        if step == SAVE_AT:
            save()
        with torch.no_grad():
            params = list(model.parameters())
            if average is None:
                average = [p.detach().clone() for p in params]
            for a, p in zip(average, params):
                a.lerp_(p.detach(), 0.5)
            if step % 2 == 1:
                saved = [p.detach().clone() for p in params]
                for a, p in zip(average, params):
                    p.copy_(a)
                evals.append(average_eval(model))
                for s, p in zip(saved, params):
                    p.copy_(s)
    return evals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", required=True, choices=sorted(KINDS))
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    x, y = classification_data(STEPS * ACCUM * world * BATCH).tensors
    x, y = x.view(STEPS, ACCUM, world, BATCH, -1), y.view(STEPS, ACCUM, world, BATCH)
    ex, ey = classification_data(world * BATCH).tensors  # the evaluation batch: rank k's slice of it

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=MiCSStrategy(param_persistence_threshold=0,
                                                                              **KINDS[args.kind]))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    after_setup = sorted({type(p).__name__ for p in model.parameters()})  # zero1: plain, as under DDP
    model(x[0, 0, rank])  # a probe: a forward with grad and no backward leaves the root unit gathered
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))

    def evaluate(m):
        loss = F.cross_entropy(m(ex[rank * BATCH:(rank + 1) * BATCH]), ey[rank * BATCH:(rank + 1) * BATCH])
        return float(fabric.all_reduce(loss.detach(), reduce_op="mean"))

    mine = [[(x[s, m, rank], y[s, m, rank]) for m in range(ACCUM)] for s in range(STEPS)]
    saved_at = Path(args.out) / "mid.ckpt"
    evals = train(model, opt, mine, fabric.backward, lambda on: fabric.no_backward_sync(model, enabled=on), evaluate,
                  lambda: fabric.save(saved_at, {"model": model}))
    state = fabric.strategy.get_module_state_dict(model.module)  # rank 0's, gathered from the masters
    everyone = [None] * world
    dist.all_gather_object(everyone, {n: p.detach().clone() for n, p in model.module.named_parameters()
                                      if not hasattr(p, "full_tensor")} or None)
    if rank != 0:
        return

    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    union = [[(x[s, m].reshape(world * BATCH, -1), y[s, m].reshape(-1)) for m in range(ACCUM)] for s in range(STEPS)]

    class Null:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    snapshot = {}
    ref_evals = train(ref, ref_opt, union, lambda loss: loss.backward(), lambda on: Null(),
                      lambda m: float(F.cross_entropy(m(ex), ey)),
                      lambda: snapshot.update({n: p.detach().clone() for n, p in ref.named_parameters()}))
    mid = consolidate(saved_at)["model"]
    got = {n: t.float() for n, t in state.items() if n in dict(ref.named_parameters())}
    plain = [e for e in everyone if e is not None]
    result = {
        "n": len(got),
        "max_param_diff": max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()),
        "max_eval_diff": max(abs(a - b) for a, b in zip(evals, ref_evals)),
        "saved_n": len([n for n in snapshot if n in mid]),
        "max_saved_diff": max((mid[n].float() - p).abs().max().item() for n, p in snapshot.items()),
        "evals": evals, "ref_evals": ref_evals,
        "clamped": max(p.abs().max().item() for p in ref.parameters()) <= LIMIT + 1e-7,
        "after_setup": after_setup,
        # plain parameters (zero1's whole copies) alike on every rank
        "ranks_alike": all(all(torch.equal(e[n], plain[0][n]) for n in plain[0]) for e in plain),
    }
    (Path(args.out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
