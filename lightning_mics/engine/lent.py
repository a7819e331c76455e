"""The plain parameters a gathered unit lends to user code, and what is taken back from them into the masters.

[Note: writes between steps]
A unit that stays gathered while user code runs lends it plain parameters (``full_flat``), not the masters the
optimizer steps (``shard_flat``): a pinned unit between steps ([Note: optimizer-state-only sharding] in
gradients.py) and a unit kept gathered after a pass (``exposed``: the root between the micro-batches of a window,
[Note: keep for backward] in schedule.py). What user code writes to them is taken into the masters before the
masters are read (the optimizers' pre-step hook, a sharded save), when a pass next uses a kept unit (before its
reduce-scatter may stage in the full storage) and before the plain parameters are freed: each rank takes its own rows
where they differ, bit for bit, from what its gather delivered (the master rounded to param_dtype, or its int8 round
trip); elements left alone keep the master's bits, and every rank of a shard group holds the same plain parameters,
so the masters agree everywhere (with rows over replicas once the rows have crossed). A pinned unit is never marked
exposed: its writes are taken only when the masters are read, so a write undone before then (weights swapped in for
validation and back) leaves the masters as they were. A save made while such a write is in place saves it, as DDP's
does.

[Note: masters moved outside a step]
The engine hears of the masters moving from the optimizers' steps and those of the optimizers they hold
([Note: steps the engine hears of] in optimizer_hooks.py); user code may also move them itself, through the optimizer's
DTensors (SAM's climb and return, a decay by hand). A unit that lends copies across user code (the root at s > 1 under
manual optimization, ZeRO-1's pinned unit) then holds copies of masters that are no longer there. So:

- a lending unit keeps the masters as they were when its copies were filled (``base``: a copy of the flat shard in
  the master dtype, only while gathered); a take compares the copies with what that base delivered and takes an
  element only where the masters have not moved since: where both moved, the masters win, as after a step;
- a unit whose copies may be behind the masters is gathered again when a forward next enters it, after its writes are
  taken and the rows over replicas exchanged (``Schedule.catch_up``), unless a step refreshed it first. Behind,
  decided alike on every rank: after a backward that ends an accumulation window while the unit is still gathered
  (user code inside its forward, or pinned), or when one of its DTensors was written in place since the fill (its
  version counter, which DTensor's SPMD op bumps on every rank), read when a forward enters the unit from outside.

Cost: that copy, and one more all-gather of the root (ZeRO-1: of the model) where a forward follows a synchronized
backward with no step between. Not seen: a move made around the version counter with no backward before it
(``p.data.mul_``, ``p.to_local()``, a foreach op), until the next step. A ``.data = x`` on a DTensor master leaves its
local tensor as it was (torch, pytorch/pytorch#157391): ``MiCSEngine.refuse_rebinding`` refuses the run at the next step
or save.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import Tensor

from lightning_mics.engine.optimizer_rows import OptimizerRows
from lightning_mics.layout.placement import ShardedParam


def bits(t: Tensor) -> Tensor:
    """``t``'s bits as integers of its width: a bit-for-bit compare."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class Lent:
    """One unit's plain parameters as lent to user code: [Note: writes between steps] and
    [Note: masters moved outside a step]. ``delivered(shard)``: the flat shard as its gather delivers it, up to the cast
    to ``param_dtype`` (the shard itself, or its int8 round trip with quantize_allgather)."""

    def __init__(self, params: List[ShardedParam], full_views: List[Tensor], shard_flat: Tensor,
                 delivered: Callable[[Tensor], Tensor], keeps_base: bool) -> None:
        self.params, self.full_views, self.shard_flat = params, full_views, shard_flat
        self.delivered = delivered
        self.keeps_base = keeps_base and bool(params)
        self.base: Optional[Tensor] = None  # the masters the copies were filled from
        self.behind = False  # the masters may have moved since: [Note: masters moved outside a step]
        self.versions = 0  # of the optimizer's DTensors then

    def filled(self) -> None:
        """The copies were just filled from the masters (a gather issued, a refresh)."""
        self.behind = False
        if self.keeps_base:
            if self.base is None:
                self.base = self.shard_flat.clone()
            else:
                self.base.copy_(self.shard_flat)
            self.versions = self._versions()

    def _versions(self) -> int:
        return sum(sp.sharded._version for sp in self.params)

    def written_in_place(self) -> bool:
        """Whether an in-place op ran on one of the optimizer's DTensors since the fill (its version counter, which
        the op bumps alike on every rank of the mesh): [Note: masters moved outside a step]."""
        return self.keeps_base and self._versions() != self.versions

    def returned(self) -> None:
        """The copies were given back (a release, a reset)."""
        self.base, self.behind = None, False

    @torch.no_grad()
    def take(self) -> None:
        """[Note: writes between steps]: the copies into this rank's master rows wherever a write outside the
        optimizer step changed them and the masters did not move since they were filled."""
        base = self.base
        gathered = self.delivered(self.shard_flat if base is None else base)  # as the gather delivered the shard
        for sp, full in zip(self.params, self.full_views):
            sp.reattach(full)  # after ``p.data = x``
            # the optimizer's rows: with rows over replicas the others cross in their exchange
            # ([Note: rows between steps] in optimizer_rows.py), which with int8 deltas adds their change to the chunk
            lo, hi = sp.rows.sub_lo, sp.rows.sub_hi
            own, master = full[sp.rows.lo + lo:sp.rows.lo + hi], sp.stepped
            if not own.numel():
                continue
            before = OptimizerRows.chunk_of(gathered, sp)[lo:hi].to(own.dtype)  # only these rows: 1/r of them
            written = bits(own) != bits(before)  # bit for bit (and integer compares vectorize on CPU)
            if base is not None:
                was = OptimizerRows.chunk_of(base, sp)[lo:hi]
                written &= bits(master) == bits(was)  # [Note: masters moved outside a step]: they win
                was.copy_(torch.where(written, own.to(was.dtype), was))
            master.copy_(torch.where(written, own.to(master.dtype), master))
