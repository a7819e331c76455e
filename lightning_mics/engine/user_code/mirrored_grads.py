"""The optimizer's gradients mirrored on a lent unit's plain parameters.

[Note: gradients on the plain parameters]
While a unit lends plain parameters to user code (ZeRO-1's pinned unit between steps; at s > 1 the root for the whole
``training_step`` of manual optimization) each plain parameter's ``.grad`` mirrors the optimizer's: the same DTensor
(the rows this rank steps), or under a lower ``param_dtype`` a DTensor copy in the plain parameter's dtype. What user
code does to it is taken into the optimizer's gradient before the optimizer or the next window reads it: set to None
(``zero_grad()``) sets it to None; a copy's elements written in place are taken bit for bit; a DTensor of the same
placements put in its place (``p.grad = p.grad * c``) becomes it; any other tensor is refused. The optimizer's
``zero_grad()`` is followed at once. A copy does not follow the engine's own changes to the optimizer's gradient
(clipping, the loss scaler). The mirror leaves ``.grad`` before autograd accumulates into it and before the engine
reads the plain gradients, which are then again this rank's own gradients of the window.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mics.engine.unit import ShardedState, Unit
from lightning_mics.engine.user_code.write_back import bits
from lightning_mics.layout.placement import local


class MirroredGrads:
    """One unit's plain parameters mirroring the optimizer's gradients while it is gathered
    ([Note: gradients on the plain parameters]); of each ``ShardedParam``, ``full`` is the plain parameter and
    ``sharded`` the optimizer's DTensor."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.params = list(unit.params)
        self.mirrors: List[Optional[Tensor]] = [None] * len(self.params)
        self.values: List[Optional[Tensor]] = [None] * len(self.params)  # a copy's local values as mirrored or taken
        self.count = 0  # mirrors on the plain parameters now: with none, every call returns at once
        self._handles: Dict[int, Any] = {}  # registered when first mirrored (a frozen parameter takes no hook)

    def _before_accumulate(self, i: int):
        def hook(grad: Tensor) -> Tensor:
            self.withdraw(i)
            return grad
        return hook

    def _mirror(self, k: int) -> None:
        sp = self.params[k]
        g = sp.sharded.grad
        if self.mirrors[k] is None:
            self.count += 1
        self.mirrors[k] = g if g.dtype == sp.full.dtype else g.detach().to(sp.full.dtype)
        self.values[k] = None if self.mirrors[k] is g else local(self.mirrors[k]).clone()
        sp.full.grad = self.mirrors[k]

    def _unmirror(self, k: int) -> None:
        if self.mirrors[k] is not None:
            self.count -= 1
        self.params[k].full.grad = self.mirrors[k] = self.values[k] = None

    def mirror(self) -> None:
        """The optimizer's gradients on the plain parameters, if the unit is gathered: after the boundary published
        them, when the unit is gathered for a forward (not on a tensor-parallel part: a DTensor)."""
        if self.unit.state is not ShardedState.GATHERED:
            return
        for k, sp in enumerate(self.params):
            if sp.sharded.grad is None:
                if self.mirrors[k] is not None and sp.full.grad is self.mirrors[k]:  # zeroed while released
                    self._unmirror(k)
            elif sp.full.requires_grad and not isinstance(sp.full, DTensor):
                if k not in self._handles:
                    self._handles[k] = sp.full.register_hook(self._before_accumulate(k))
                self._mirror(k)

    def take_edits(self, i: Optional[int] = None) -> None:
        """What user code did to the mirrored gradients (of parameter ``i``, or all), into the optimizer's."""
        if not self.count:
            return
        for k in range(len(self.params)) if i is None else (i,):
            mirrored = self.mirrors[k]
            if mirrored is None:
                continue
            sp = self.params[k]
            now, own = sp.full.grad, sp.sharded.grad
            if now is None:  # zero_grad()
                sp.sharded.grad = None
                self._unmirror(k)
            elif now is not mirrored:  # replaced
                if not (isinstance(now, DTensor) and now.placements == sp.sharded.placements
                        and now.shape == sp.sharded.shape):
                    raise ValueError(
                        f"MiCSStrategy: a plain parameter's .grad was replaced by a {type(now).__name__} of shape "
                        f"{tuple(now.shape)}; a plain parameter (ZeRO-1's, or the root unit's in manual "
                        f"optimization) mirrors the optimizer's gradient, a DTensor placed {sp.sharded.placements}. "
                        "Allowed: writing it in place, setting it to None, or a DTensor of the same placements "
                        "(p.grad = p.grad * c).")
                sp.sharded.grad = now.detach().to(sp.sharded.dtype)
                self._mirror(k)
            elif own is None:  # the optimizer's gradient set to None by a path ``follow_zero_grad`` did not see
                self._unmirror(k)
            elif mirrored is not own:  # a copy in a lower dtype: the elements written since
                theirs, values, mine = local(mirrored), self.values[k], local(own)
                written = bits(theirs) != bits(values)
                mine.copy_(torch.where(written, theirs.to(mine.dtype), mine))
                # zeroed in place: all of it (a lower dtype's copy rounds the smallest gradients to zero, so
                # "unchanged" there is not "kept"); decided on the device, no host read per parameter
                mine.masked_fill_(~theirs.any(), 0)
                values.copy_(theirs)

    def follow_zero_grad(self) -> None:
        """The optimizer's ``zero_grad()`` set its gradients to None or zeroed them: the mirrors follow."""
        if not self.count:
            return
        for k, sp in enumerate(self.params):
            if self.mirrors[k] is None:
                continue
            if sp.sharded.grad is None:
                self._unmirror(k)
            elif self.mirrors[k] is not sp.sharded.grad:  # a copy: mirrored again
                self._mirror(k)

    def withdraw(self, i: Optional[int] = None) -> None:
        """Taken, then off the plain ``.grad`` (of parameter ``i``, or all): autograd or the reduction is next."""
        if not self.count:
            return
        for k in range(len(self.params)) if i is None else (i,):
            if self.mirrors[k] is not None:
                self.take_edits(k)
            if self.mirrors[k] is not None:
                self._unmirror(k)

    def remove(self) -> None:
        """The run ends: the mirrors off the plain parameters, the hooks removed."""
        for k, sp in enumerate(self.params):
            if self.mirrors[k] is not None and sp.full.grad is self.mirrors[k]:
                sp.full.grad = None
            self.mirrors[k] = self.values[k] = None
        self.count = 0
        for h in self._handles.values():
            h.remove()
        self._handles.clear()
