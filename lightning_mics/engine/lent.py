"""The plain parameters a gathered unit lends to user code, and what is taken back from them into the masters.

[Note: writes between steps]
A unit that stays gathered while user code runs lends it plain parameters (``full_flat``), not the masters the
optimizer steps (``shard_flat``): a pinned unit between steps ([Note: optimizer-state-only sharding] in
gradients.py), whose refresh after the next step overwrites them from the masters, and a unit kept gathered after
a pass (``exposed``: the root between the micro-batches of a window, [Note: keep for backward] in schedule.py),
whose release frees them. A write to them (a clamp after the step or after a micro-batch, weights swapped in for
validation and back) would be lost: before the clamp between micro-batches was taken, it ended 0.0094 from DDP on
4 ranks at s = 2. So before the masters are read (the optimizers' pre-step hook, which Lightning runs before the
closure's forward; a sharded save, which saves the masters: before, a save right after a clamp held the unclamped
weights, 0.034 from DDP's checkpoint under ZeRO-1 on 2 ranks), when a pass next uses a kept unit (its forward or
its backward begins: before its reduce-scatter may stage in the full storage) and before the plain parameters are
freed otherwise (a release) each rank takes its own rows of them (the optimizer's) into its masters where they
differ from what its gather delivered (the master rounded to param_dtype, or its int8 round trip with
quantize_allgather): the elements left alone keep the master's bits. Every rank of a shard group holds the same
plain parameters and takes its own rows, so the masters agree with them everywhere (with rows over replicas once
the rows have crossed). A pinned unit is never marked exposed: its writes are taken only when the masters are
read, since a write undone before then (weights swapped in for validation and back) would otherwise round the
masters to the param_dtype copies it restores (0.013 from DDP under bf16-mixed). A save made while such a write is
in place (an average swapped in) saves it, as DDP's does; under bf16-mixed the copies restored after it then round
those masters at the next step.

[Note: masters moved outside a step]
The engine hears of the masters moving from the optimizers' steps (and those of the optimizers they hold: SAM's
``base_optimizer``, Lookahead's; [Note: steps the engine hears of] in optimizer_hooks.py). User code may also move
them itself, through the optimizer's DTensors: SAM's first step climbs to ``w + e(w)`` with ``p.add_`` after a
backward, runs a second forward and backward there, then puts ``w`` back with ``p.copy_`` and steps its base
optimizer. A unit that stays gathered through that (the root at s > 1 under manual optimization, whose
``training_step`` runs inside its forward; ZeRO-1's pinned unit) then lends copies of masters that are no longer
there, and a take compared them with the masters as they are now: every moved element looked written, and the stale
copy went back into the masters. SAM under manual optimization ended 0.19 from DDP at s = 2 and under ZeRO-1 (2
ranks), 0.15 with rows over replicas (4 ranks), and SAM's loop under Fabric's ZeRO-1 0.32 from one process; the
optimizer's parameters decayed by hand after each batch under ZeRO-1, 0.32 from DDP (tests/test_masters_moved.py,
test_step_closure.py). So:

- the units that lend copies across user code (the root and the pinned ones) keep the masters as they were when
  their copies were filled (``base``: a copy of the flat shard in the master dtype, only while gathered);
  a take compares the copies with what that base delivered, and takes an element only where the masters have not
  moved since: where both moved, the masters win, as after a step;
- a unit whose copies may be behind the masters is gathered again when a forward next enters it, after its writes
  are taken and the rows over replicas exchanged (``Schedule.catch_up``), unless an optimizer step refreshed it
  first. Behind, decided alike on every rank: after a backward that ends an accumulation window, a unit still
  gathered because user code runs inside its forward, or pinned (``behind``: the same events everywhere); and a
  lending unit one of whose DTensors an in-place op wrote since the fill (its version counter, which DTensor's
  SPMD op bumps on every rank; the decay by hand has no backward before it), read when a forward enters the unit
  from outside it. Inside an accumulation window nothing else is taken to move them: the root kept between its
  micro-batches is not gathered again.

The cost is that copy (1/s of the unit in the master dtype: under ZeRO-1 one more shard, kept) and one more
all-gather of the root (ZeRO-1: of the model) where a forward follows a synchronized backward with no step between:
SAM's second forward, manual accumulation that does not block the gradients' synchronization, and a forward after
an in-place write to the optimizer's DTensors. Not seen: a move with no backward before it made around the DTensor's
version counter (``p.data.mul_``, ``p.to_local()``, a foreach op), until the next step. Under ZeRO-1 the module's
plain parameters show a move made through the optimizer's DTensors from the next forward or step on.

A ``.data = x`` on a DTensor master leaves its local tensor as it was (torch, pytorch#157391): the engine refuses the
run at the next step or save (``MiCSEngine.refuse_rebinding``); write in place.
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
    """One unit's plain parameters as lent to user code: [Note: writes between steps] and [Note: masters moved
    outside a step]. ``delivered(shard)``: the flat shard as its gather delivers it, up to the cast to
    ``param_dtype`` (the shard itself, or its int8 round trip with quantize_allgather)."""

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
            # the optimizer's rows: with rows over replicas the others cross in their exchange ([Note: rows
            # between steps] in optimizer_rows.py), which with int8 deltas adds their change to the chunk
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
