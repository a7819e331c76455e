"""What user code writes to a lent unit's plain parameters, written back into this rank's master rows.

[Note: writes between steps]
A unit lent to user code ([Note: the user-code boundary] in boundary.py) holds plain parameters (its full storage),
not the masters the optimizer steps. Before the masters are read (a step, a save, a state dict), when a pass next uses
a kept unit, and before the unit is released, each rank writes back its own rows where the plain parameters differ,
bit for bit, from what the gather delivered (the master rounded to ``param_dtype``, or its int8 round trip). Elements
left alone keep the masters' bits; every rank of a shard group holds the same plain parameters, so the masters agree
everywhere. Nothing is written back after an optimizer step: the copies hold the masters from before it.

[Note: masters moved outside a step]
User code may move the masters itself through the optimizer's DTensors while a unit is lent (SAM's climb, a decay by
hand); the copies then hold values the masters no longer have, and the masters win:
- a parameter whose DTensor was written in place since the fill (its version counter, which DTensor's op bumps alike
  on every rank; read for the root and a pinned unit) is not written back, and the unit is gathered again when a
  forward next enters it from outside;
- after a backward that ends a window while the unit stays gathered for user code (inside its forward, or pinned),
  the masters may move where no counter shows: they are copied (``snapshot``; a pinned unit copies at every fill), an
  element is written back only where they have not moved since, and the next forward gathers the unit again.
A move around the counter (``p.to_local()``, ``p.data``) with no such backward before it is overwritten by the copies.
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


class WriteBack:
    """One unit's plain parameters as lent to user code ([Note: writes between steps]). ``delivered(shard)``: the flat
    shard as its gather delivers it, up to the cast to ``param_dtype``. ``watches_versions``: the optimizer's DTensors'
    version counters are read at each fill (the root, a pinned unit); ``snapshots_at_fill``: the masters are copied at
    each fill (a pinned unit) rather than only when a window ends with the unit in use."""

    def __init__(self, params: List[ShardedParam], full_views: List[Tensor], shard_flat: Tensor,
                 delivered: Callable[[Tensor], Tensor], watches_versions: bool, snapshots_at_fill: bool) -> None:
        self.params, self.full_views, self.shard_flat = params, full_views, shard_flat
        self.delivered = delivered
        self.watches_versions, self.snapshots_at_fill = watches_versions, snapshots_at_fill
        self.versions: Optional[List[int]] = None  # of the optimizer's DTensors at the fill
        self.snapshot: Optional[Tensor] = None  # the masters the copies are compared against, when kept apart
        self.stale = False  # the masters may have moved where no counter shows: [Note: masters moved outside a step]

    def filled(self) -> None:
        """The copies were just filled from the masters (a gather issued, a refresh)."""
        self.stale = False
        if self.watches_versions:
            self.versions = [sp.sharded._version for sp in self.params]
        if self.snapshots_at_fill:
            self._copy_masters()
        else:
            self.snapshot = None

    def forget(self) -> None:
        """The copies were given back (a release, a reset)."""
        self.versions = self.snapshot = None
        self.stale = False

    def _copy_masters(self) -> None:
        if self.snapshot is None:
            self.snapshot = self.shard_flat.clone()
        else:
            self.snapshot.copy_(self.shard_flat)

    def window_ended_in_use(self) -> None:
        """A backward ended an accumulation window while user code holds the unit gathered: the masters may move
        before its next forward in ways no counter shows ([Note: masters moved outside a step])."""
        self.stale = True
        if self.snapshot is None:
            self._copy_masters()

    def _moved(self, k: int) -> bool:
        return self.versions is not None and self.params[k].sharded._version != self.versions[k]

    def moved_in_place(self) -> bool:
        """Whether an in-place op wrote one of the optimizer's DTensors since the fill; O(parameters)."""
        return self.versions is not None and any(self._moved(k) for k in range(len(self.params)))

    @torch.no_grad()
    def write_back(self) -> None:
        """[Note: writes between steps]: the copies into this rank's master rows wherever user code changed them and
        the masters did not move since they were filled."""
        snapshot = self.snapshot
        gathered = self.delivered(self.shard_flat if snapshot is None else snapshot)  # as the gather delivered it
        for k, (sp, full) in enumerate(zip(self.params, self.full_views)):
            sp.reattach(full)  # after ``p.data = x``
            if self._moved(k):  # [Note: masters moved outside a step]: the masters win
                continue
            # the optimizer's rows: with rows over replicas the others cross in their exchange
            # ([Note: rows between steps] in optimizer_rows.py), which with int8 deltas adds their change to the chunk
            lo, hi = sp.rows.sub_lo, sp.rows.sub_hi
            own, master = full[sp.rows.lo + lo:sp.rows.lo + hi], sp.optimizer_local
            if not own.numel():
                continue
            before = OptimizerRows.chunk_of(gathered, sp)[lo:hi].to(own.dtype)  # only these rows: 1/r of them
            written = bits(own) != bits(before)  # bit for bit (and integer compares vectorize on CPU)
            if snapshot is not None:
                was = OptimizerRows.chunk_of(snapshot, sp)[lo:hi]
                written &= bits(master) == bits(was)  # moved since the snapshot: the masters win
                was.copy_(torch.where(written, own.to(was.dtype), was))
            master.copy_(torch.where(written, own.to(master.dtype), master))
