"""Optimizers written by hand, per parameter, as a user writes one (no foreach, no fused kernel), under a strategy,
one case after another in one process (one rank; ``tests/helpers/trainer_cases.py``'s ``main``):

    python custom_optimizers.py --out DIR --strategy mics|mics_os|zero1|ddp --cases lamb,lion

- ``lamb``: LAMB, whose trust ratio divides the norm of the whole parameter by the norm of its whole update: on a
  DTensor shard ``p.norm()`` is a partial norm that DTensor reduces over the mesh (a collective per parameter, in
  the same order on every rank; with the optimizer's rows over replicas, over the replicas' rows too);
- ``lion``: Lion, ``sign`` of an interpolation of the momentum and the gradient.

State created with ``torch.zeros_like(p)`` (a DTensor of ``p``'s placement), accumulation 2; rank 0 saves the
parameters after 2 epochs.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from tests.helpers.trainer_cases import BATCH, Base, classification_data, loader, main, params, strategy_of, trainer_for  # noqa: E402


class ByHand(torch.optim.Optimizer):
    """``step`` runs the closure (Lightning's), then ``update(group, p, state)`` for every parameter with a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.update(g, p, self.state[p])


class Lamb(ByHand):
    """LAMB: a trust ratio from the whole parameter's and the whole update's norms."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-6, wd=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, wd=wd))

    def update(self, g, p, st):
        b1, b2 = g["betas"]
        if not st:
            st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
        st["step"] += 1
        st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
        st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        mh, vh = st["m"] / (1 - b1 ** st["step"]), st["v"] / (1 - b2 ** st["step"])
        upd = mh / (vh.sqrt() + g["eps"]) + g["wd"] * p
        wn, un = p.norm(), upd.norm()
        trust = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
        p.sub_(g["lr"] * trust * upd)


class Lion(ByHand):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    def update(self, g, p, st):
        b1, b2 = g["betas"]
        if not st:
            st["m"] = torch.zeros_like(p)
        p.add_(torch.sign(st["m"].mul(b1).add(p.grad, alpha=1 - b1)), alpha=-g["lr"])
        st["m"].mul_(b2).add_(p.grad, alpha=1 - b2)


class WithOptimizer(Base):
    opt = "lamb"

    def configure_optimizers(self):
        return (Lamb if self.opt == "lamb" else Lion)(self.parameters())


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(4 * world * BATCH)
    m = WithOptimizer()
    m.opt = case.removesuffix("_bf16")
    precision = "bf16-mixed" if case.endswith("_bf16") else "32-true"
    trainer_for(kind, world, max_epochs=2, accumulate_grad_batches=2, strategy=strategy_of(kind),
                precision=precision).fit(m, loader(ds, kind, world, rank))
    return {"params": params(m)}

if __name__ == "__main__":
    main(run_case)
