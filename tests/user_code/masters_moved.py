"""Optimizers that move the masters outside their own step, under a strategy, one case after another in one process
(one rank; ``tests/helpers/trainer_cases.py``'s ``main``):

    python masters_moved.py --out DIR --strategy mics|mics_os|zero1|ddp --cases sam_manual,sam_closure,lookahead

- ``sam_manual``: SAM (Foret et al.) as its reference implementation writes it, under manual optimization: a
  backward, ``first_step`` climbs to ``w + e(w)`` with ``p.add_``, a second forward and backward there, then
  ``second_step`` puts ``w`` back with ``p.copy_`` and steps the base optimizer (SGD with momentum) alone;
- ``sam_closure``: the same SAM under automatic optimization, its ``step(closure)`` evaluating Lightning's closure
  at ``w`` and at ``w + e(w)``;
- ``lookahead``: Lookahead over AdamW as timm writes it (``Optimizer.__init__`` skipped on purpose, so torch's step
  hooks do not exist on it): every 2 steps of the base optimizer it pulls the slow weights halfway and copies them
  into the parameters, after its base step;
- ``adamw``: AdamW alone, whose all-gathers Lookahead's are compared with;
- ``decay``: AdamW, and after every batch a callback decays the optimizer's parameters by hand (``p.mul_(0.99)``
  under ``torch.no_grad()``): no backward between that move and the next forward;
- ``decay_acc2``: the same with accumulation 2, so the decay also comes between the micro-batches of a window, while
  the root stays gathered (lent) for the next one: its DTensors written in place since its gather;
- ``sam_heard``: ``sam_manual`` with the climb and the putting back each run inside the step of an optimizer SAM
  holds (``Mover``), so that the engine hears of them as of any step: what the engine does on its own for moves it
  did not hear of must come to the same bits, in any precision;
- ``*_bf16``: under ``bf16-mixed``;
- ``sam_data``: ``sam_manual`` with ``p.data = w`` for putting ``w`` back, as SAM's reference code writes it: on a
  DTensor torch ignores it; the ``ValueError`` is saved.

Rank 0 saves the parameters, its all-gathers in the training batches (``CommCounter``), and how often the root
kept a copy of its masters beside its shard where user code could next run (before and after each backward, and
after each batch: ``WriteBack.snapshot``, [Note: masters moved outside a step]).
"""

import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from tests.helpers.comm_mode import CommCounter  # noqa: E402
from tests.helpers.trainer_cases import BATCH, Base, classification_data, loader, main, params, strategy_of, trainer_for  # noqa: E402


class Mover(torch.optim.Optimizer):
    """An optimizer whose step runs what it is given: a move of the parameters the engine hears of."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure):
        closure()


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization over a base optimizer, as github.com/davda54/sam writes it, but for putting ``w``
    back in place (``p.copy_``; ``p.data = w`` is ignored on a DTensor, under FSDP2 too) and taking the norm of a
    DTensor gradient whole."""

    def __init__(self, params, base_optimizer, rho=0.05, rebind=False, heard=False, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.rebind = rebind  # ``p.data = w``, as the reference code puts ``w`` back
        self.mover = Mover([p for g in self.param_groups for p in g["params"]]) if heard else None
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    def _move(self, fn):
        if self.mover is not None:
            self.mover.step(fn)
        else:
            fn()

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        scale = self.param_groups[0]["rho"] / (self._grad_norm() + 1e-12)
        self._move(lambda: self._climb(scale))
        if zero_grad:
            self.zero_grad()

    def _climb(self, scale):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * scale)

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        self._move(self._put_back)
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def _put_back(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self.rebind:
                    p.data = self.state[p]["old_p"]
                elif p.grad is not None:
                    p.copy_(self.state[p]["old_p"])

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            closure()
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            closure()
        self.second_step()

    def _grad_norm(self):
        norms = [p.grad.norm(2) for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm(2)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead (``timm/optim/lookahead.py``): ``Optimizer.__init__`` is not called, on purpose."""

    def __init__(self, base_optimizer, alpha=0.5, k=2):
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self.state = defaultdict(dict)
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def update_slow(self, group):
        for fast in group["params"]:
            if fast.grad is None:
                continue
            state = self._base_optimizer.state[fast]
            if "lookahead_slow_buff" not in state:
                state["lookahead_slow_buff"] = fast.detach().clone()
            slow = state["lookahead_slow_buff"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self._base_optimizer.zero_grad(set_to_none)


class SAMManual(Base):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        sam = self.optimizers().optimizer
        self.manual_backward(self.loss(batch))
        sam.first_step(zero_grad=True)
        self.manual_backward(self.loss(batch))
        sam.second_step(zero_grad=True)

    def configure_optimizers(self):
        return SAM(self.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)


class SAMHeard(SAMManual):
    def configure_optimizers(self):
        return SAM(self.parameters(), torch.optim.SGD, heard=True, lr=0.1, momentum=0.9)


class SAMData(SAMManual):
    def configure_optimizers(self):
        return SAM(self.parameters(), torch.optim.SGD, rebind=True, lr=0.1, momentum=0.9)


class SAMClosure(Base):
    def configure_optimizers(self):
        return SAM(self.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)


class LookaheadAdamW(Base):
    def configure_optimizers(self):
        return Lookahead(torch.optim.AdamW(self.parameters(), lr=0.01))


class AdamW(Base):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


MODELS = {"sam_manual": SAMManual, "sam_closure": SAMClosure, "lookahead": LookaheadAdamW, "adamw": AdamW,
          "sam_data": SAMData, "sam_heard": SAMHeard}


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    decay = case.startswith("decay")
    model = MODELS["adamw" if decay else case.removesuffix("_bf16")]()
    counted = Counted()
    callbacks = [counted, DecayByHand()] if decay else [counted]
    trainer = trainer_for(kind, world, strategy=strategy_of(kind), max_epochs=2, limit_val_batches=0,
                          callbacks=callbacks, precision="bf16-mixed" if case.endswith("_bf16") else "32-true",
                          accumulate_grad_batches=2 if case == "decay_acc2" else 1)
    try:
        trainer.fit(model, loader(classification_data(4 * world * BATCH), kind, world, rank))
    except ValueError as e:
        if case != "sam_data":
            raise
        return {"error": str(e)}
    gathers = sum(n for (op, _), n in counted.counter.counts().items() if op == "all_gather")
    return {"params": params(model), "all_gathers": gathers, "snapshots": counted.snapshots, "looks": counted.looks}


def decay_by_hand(optimizer):
    """The optimizer's parameters decayed in place (``p.mul_(0.99)``), as a callback or a loop may write it."""
    with torch.no_grad():
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            p.mul_(0.99)


class DecayByHand(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        decay_by_hand(trainer.optimizers[0])


class Counted(L.Callback):
    """The collectives of the training batches (setup's, and the optimizer's probes, left out)."""

    def __init__(self):
        self.counter = CommCounter()
        self.snapshots = self.looks = 0  # the root's copies of its masters seen, of the times looked

    def look(self, trainer):
        engine = trainer.strategy.engine if hasattr(trainer.strategy, "engine") else None
        if engine is not None:
            wb = engine.user_code.write_back_of(engine.units[0])
            self.looks += 1
            self.snapshots += int(wb is not None and wb.snapshot is not None)

    def on_train_batch_start(self, *args):
        self.counter.__enter__()

    def on_before_backward(self, trainer, *args):
        self.look(trainer)  # the root is kept from its forward into its backward

    def on_after_backward(self, trainer, *args):
        self.look(trainer)  # a window ended: with the root still lent (manual optimization), its copy is due

    def on_train_batch_end(self, trainer, *args):
        self.counter.__exit__(None, None, None)
        self.look(trainer)  # inside a window the root stays gathered for the next micro-batch


if __name__ == "__main__":
    main(run_case)
