"""One rank of ``tests/user_code/test_step_closure.py``'s Fabric cases (``--strategy fabric --cases ...``,
tests/helpers/trainer_cases.py's ``main``): loops as users write them, under MiCS's layouts, against one plain process on the union of the ranks' batches
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
- ``<layout>_lamb``, ``<layout>_lion``: the optimizers written by hand of ``custom_optimizers.py`` (LAMB's trust
  ratio from whole-parameter norms of DTensor shards, Lion's sign), the module zeroed after each step;
- ``_bf16`` after any of these: under ``bf16-mixed``; the result then also holds ``policy``, one process under
  MiCS's precision policy (``policy_loss``: each rank's batch through autocast over bf16 copies of the fp32
  parameters, as ``compat.Bf16Copies`` runs DDP).

Rank 0 saves the module's parameters after the loop (``params``: under ZeRO-1 with bf16-mixed, the bf16 copies it
lends) and the optimizer's (``masters``).

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
from tests.helpers.bf16_policy import on_bf16_copies  # noqa: E402
from tests.helpers.trainer_cases import main  # noqa: E402
from tests.user_code.custom_optimizers import Lamb, Lion  # noqa: E402
from tests.user_code.masters_moved import SAM, Lookahead, decay_by_hand  # noqa: E402

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
    if how == "lamb":
        return Lamb(params)
    if how == "lion":
        return Lion(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01)


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def policy_loss(model, world):
    """The loss of ``world`` ranks under MiCS's bf16-mixed policy, in one process: each rank's batch through
    autocast over bf16 copies of the fp32 parameters (the output in fp32, as Fabric returns it), its bf16 gradients
    cast to fp32 and summed there, scaled by 1 / world (exact: a power of two) as the engine scales its reduction."""
    def forward(x):
        return on_bf16_copies(model, (x,)).float()

    def loss(_, x, y):
        return sum(mse(forward, xr, yr) for xr, yr in zip(x.chunk(world), y.chunk(world))) / world
    return loss


def train(model, opt, data, how, fabric=None, loss_of=mse):
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = loss_of(model, x, y)
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
        loss = loss_of(model, x, y)
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
    full = lambda ps: [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in ps]  # noqa: E731
    got = [p.float() for p in full(model.parameters())]
    masters = full(p for g in opt.param_groups for p in g["params"])
    model(batches(world)[0][0][lo:hi])  # a forward: what the optimizer's zero_grad() cleared is off the module too
    ref = make()
    train(ref, optimizer(how, ref.parameters()), batches(world), how)
    result = {"params": got, "masters": masters, "reference": [p.detach().clone() for p in ref.parameters()],
              "after_forward": [p.grad is not None for p in model.parameters()]}
    if bf16:
        ref = make()
        train(ref, optimizer(how, ref.parameters()), batches(world), how, loss_of=policy_loss(ref, world))
        result["policy"] = [p.detach().clone() for p in ref.parameters()]
    return result


if __name__ == "__main__":
    main(lambda case, kind, world, rank, out: run_case(case, world, rank))  # --strategy: unused (the case names it)
