"""The optimizer's gradients shown on plain parameters.

[Note: gradients on the plain parameters]
User code can run while a unit lends the module plain parameters, not the DTensors the optimizer steps: under the
optimizer-state-only layout ([Note: optimizer-state-only sharding] in gradients.py) the pinned unit between steps,
and at s > 1 the root unit for the whole ``training_step`` of manual optimization (it runs inside the root's forward,
[Note: keep for backward] in schedule.py). While such a unit is gathered (from the boundary's publish, or from the
root's gather for a forward) each plain parameter's ``.grad`` shows the optimizer's: the same DTensor (the rows this
rank steps), or under a lower ``param_dtype`` a DTensor copy in the plain parameter's dtype. What user code does to
it is taken into the optimizer's gradient before the optimizer or the next window reads it (``take``: the optimizers'
pre-step, after each evaluation of a step's closure, when a forward starts, before a backward adds to it):

- set to None (``zero_grad()``): the optimizer's gradient is set to None;
- written in place: the same tensor, so already there; a copy's elements that changed since it was shown are taken
  (bit for bit, as [Note: writes between steps] in lent.py takes parameters). A copy does not follow the engine's own
  changes to the optimizer's gradient (clipping by norm, the loss scaler's unscaling);
- replaced by another DTensor of the same placements (``p.grad = p.grad * c``): taken as the optimizer's gradient;
  any other tensor is refused with a ``ValueError``;
- the optimizer's ``zero_grad()``: the plain ``.grad`` follows at once (None, or a copy shown again), as under DDP,
  where they are the same tensors.

The shown gradient leaves ``.grad`` before autograd accumulates into it (a hook on the parameter, which runs before
the accumulation) and before the engine reads the plain gradients at the end of backward, so the plain ``.grad`` is
again this rank's own gradient of the window, as the reduction expects.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mics.engine.lent import bits
from lightning_mics.layout.placement import local
from lightning_mics.engine.unit import ShardedState, Unit


class ShownGrads:
    """One unit's plain parameters showing the optimizer's gradients while it is gathered
    ([Note: gradients on the plain parameters]); its ``ShardedParam``s: ``full`` the plain parameter, ``sharded`` the
    optimizer's DTensor."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.params = list(unit.params)
        self.shown: List[Optional[Tensor]] = [None] * len(self.params)
        self.seen: List[Optional[Tensor]] = [None] * len(self.params)  # a copy's local values as shown or taken
        self._handles: Dict[int, Any] = {}  # registered when first shown (a frozen parameter takes no hook)

    def _before_accumulate(self, i: int):
        def hook(grad: Tensor) -> Tensor:
            self.hide(i)
            return grad
        return hook

    def _show(self, k: int) -> None:
        sp = self.params[k]
        g = sp.sharded.grad
        self.shown[k] = g if g.dtype == sp.full.dtype else g.detach().to(sp.full.dtype)
        self.seen[k] = None if self.shown[k] is g else local(self.shown[k]).clone()
        sp.full.grad = self.shown[k]

    def _unshow(self, k: int) -> None:
        self.params[k].full.grad = self.shown[k] = self.seen[k] = None

    def show(self) -> None:
        """The optimizer's gradients on the plain parameters, if the unit is gathered: after the boundary published
        them, when the unit is gathered for a forward (not on a tensor-parallel part: a DTensor)."""
        if self.unit.state is not ShardedState.GATHERED:
            return
        for k, sp in enumerate(self.params):
            if sp.sharded.grad is None:
                if self.shown[k] is not None and sp.full.grad is self.shown[k]:  # zeroed while released
                    self._unshow(k)
            elif sp.full.requires_grad and not isinstance(sp.full, DTensor):
                if k not in self._handles:
                    self._handles[k] = sp.full.register_hook(self._before_accumulate(k))
                self._show(k)

    def take(self, i: Optional[int] = None) -> None:
        """What user code did to the shown gradients (of parameter ``i``, or all), into the optimizer's."""
        for k in range(len(self.params)) if i is None else (i,):
            shown = self.shown[k]
            if shown is None:
                continue
            sp = self.params[k]
            now, own = sp.full.grad, sp.sharded.grad
            if now is None:  # zero_grad()
                sp.sharded.grad = None
                self._unshow(k)
            elif now is not shown:  # replaced
                if not (isinstance(now, DTensor) and now.placements == sp.sharded.placements
                        and now.shape == sp.sharded.shape):
                    raise ValueError(
                        f"MiCSStrategy: a plain parameter's .grad was replaced by a {type(now).__name__} of shape "
                        f"{tuple(now.shape)}; a plain parameter (ZeRO-1's, or the root unit's in manual "
                        f"optimization) shows the optimizer's gradient, a DTensor placed {sp.sharded.placements}. "
                        "Allowed: writing it in place, setting it to None, or a DTensor of the same placements "
                        "(p.grad = p.grad * c).")
                sp.sharded.grad = now.detach().to(sp.sharded.dtype)
                self._show(k)
            elif own is None:  # the optimizer's gradient set to None by a path ``follow`` did not see
                self._unshow(k)
            elif shown is not own:  # a copy in a lower dtype: the elements written since
                theirs, seen, mine = local(shown), self.seen[k], local(own)
                written = bits(theirs) != bits(seen)
                mine.copy_(torch.where(written, theirs.to(mine.dtype), mine))
                # zeroed in place: all of it (a lower dtype's copy rounds the smallest gradients to zero, so
                # "unchanged" there is not "kept"); decided on the device, no host read per parameter
                mine.masked_fill_(~theirs.any(), 0)
                seen.copy_(theirs)

    def follow(self) -> None:
        """The optimizer's ``zero_grad()`` set its gradients to None or zeroed them: what is shown follows."""
        for k, sp in enumerate(self.params):
            if self.shown[k] is None:
                continue
            if sp.sharded.grad is None:
                self._unshow(k)
            elif self.shown[k] is not sp.sharded.grad:  # a copy: shown again
                self._show(k)

    def hide(self, i: Optional[int] = None) -> None:
        """Taken, then off the plain ``.grad`` (of parameter ``i``, or all): autograd or the reduction is next."""
        for k in range(len(self.params)) if i is None else (i,):
            if self.shown[k] is not None:
                self.take(k)
            if self.shown[k] is not None:
                self._unshow(k)

    def remove(self) -> None:
        """The run ends: the shown gradients off the plain parameters, the hooks removed."""
        for k, sp in enumerate(self.params):
            if self.shown[k] is not None and sp.full.grad is self.shown[k]:
                sp.full.grad = None
            self.shown[k] = self.seen[k] = None
        for h in self._handles.values():
            h.remove()
        self._handles.clear()
