"""One rank of ``tests/test_step_closure.py``'s Fabric cases (``--strategy fabric --cases ...``, ``compat.py``'s
main): loops as users write them, under MiCS's layouts, against one plain process on the union of the ranks' batches
(computed on rank 0). Each case gets its own ``L.Fabric``; rank 0 saves ``<case>.pt``: the parameters, the
reference's, and whether the module shows gradients after a last forward.

- ``<layout>_<zeroing>``: ``zero_grad`` through the module (``module``: set to None; ``module_false``: in place) or
  through the optimizer (``opt``), after each step;
- ``<layout>_clip``: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` by hand before each step, the
  module zeroed after it;
- ``<layout>_lbfgs``: ``optimizer.step(closure)`` with LBFGS (``max_iter=3``);
- ``<layout>_decay``: after each step, the optimizer's parameters decayed by hand (``p.mul_(0.99)``), the module
  zeroed through the optimizer; the parameters read after one more forward;
- ``<layout>_lookahead``: timm's Lookahead over AdamW (``masters_moved.py``'s: no torch step hooks), the module
  zeroed after each step;
- ``<layout>_sam``: SAM (``masters_moved.py``'s) with its two steps called from the loop, the masters moved by hand
  between them;
- ``_bf16`` after any of these: under ``bf16-mixed``.

Layouts: ``zero1`` (``sharded_data_parallel_degree=1, shard_optimizer_state=True``) and ``mics`` (s = 2), every
parameter sharded.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_mics.fabric import MiCSStrategy  # noqa: E402
from tests.scripts.compat import main  # noqa: E402
from tests.scripts.masters_moved import SAM, Lookahead, decay_by_hand  # noqa: E402

STEPS, PER_RANK = 6, 2


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(world):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(PER_RANK * world, 8, generator=g), torch.randn(PER_RANK * world, 4, generator=g))
            for _ in range(STEPS)]


def optimizer(how, params):
    if how == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=3)
    if how == "sam":
        return SAM(params, torch.optim.SGD, lr=0.1, momentum=0.9)
    if how == "lookahead":
        return Lookahead(torch.optim.AdamW(params, lr=0.01))
    return torch.optim.AdamW(params, lr=0.01)


def train(model, opt, data, how, fabric=None):
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            fabric.backward(loss) if fabric is not None else loss.backward()
            return loss
        if how == "lbfgs":
            opt.step(closure)
            continue
        if how == "sam":
            closure()
            opt.first_step(zero_grad=True)
            closure()
            opt.second_step(zero_grad=True)
            continue
        loss = ((model(x) - y) ** 2).mean()
        fabric.backward(loss) if fabric is not None else loss.backward()
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        if how == "decay":
            decay_by_hand(opt)
        if how in ("opt", "decay"):
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=how != "module_false")


def run_case(case, world, rank):
    layout, _, how = case.removesuffix("_bf16").partition("_")
    bf16 = case.endswith("_bf16")
    strategy = MiCSStrategy(sharded_data_parallel_degree=1 if layout == "zero1" else 2,
                            shard_optimizer_state=layout == "zero1", param_persistence_threshold=0)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy,
                      precision="bf16-mixed" if bf16 else "32-true")
    fabric.launch()
    model = fabric.setup_module(make())
    opt = fabric.setup_optimizers(optimizer(how, model.parameters()))
    lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
    train(model, opt, [(x[lo:hi], y[lo:hi]) for x, y in batches(world)], how, fabric)
    if how == "decay":  # ZeRO-1's plain parameters show a move made through the optimizer's from the next forward on
        model(batches(world)[0][0][lo:hi])
    got = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone() for p in model.parameters()]
    model(batches(world)[0][0][lo:hi])  # a forward: what the optimizer's zero_grad() cleared is off the module too
    ref = make()
    train(ref, optimizer(how, ref.parameters()), batches(world), how)
    return {"params": got, "reference": [p.detach().clone() for p in ref.parameters()],
            "after_forward": [p.grad is not None for p in model.parameters()]}


if __name__ == "__main__":
    main(lambda case, kind, world, rank, out: run_case(case, world, rank))  # --strategy: unused (the case names it)
