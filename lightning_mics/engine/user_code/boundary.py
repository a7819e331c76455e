"""The boundary between the engine and user code: the one object that lends plain parameters, mirrors gradients on
them and hears of optimizer steps. The core reports a few fixed events to it and asks nothing else of user code.

[Note: the user-code boundary]
A unit is *lent* while it is gathered and user code runs: a pinned unit (ZeRO-1) from setup to the end of the run; a
unit the schedule keeps gathered after its forward or backward, until a pass uses it again; the root while user code
runs inside its forward (the Trainer's ``training_step``, manual optimization). The core reports: a unit filled,
kept or released (unit.py, hooks.py), an iteration begun, a forward entered, a backward started, the plain gradients
about to be read, the window's gradients published, the masters about to be read, a step ended. For a unit that is
not lent each event returns at once; nothing is copied when a unit is gathered, and the DTensors' version counters
are compared only at the outermost entry into a unit that was already gathered. What a lent unit costs: the root's
and a pinned unit's counters read at each fill, one compare of the unit's rows with its gather when it is written
back, and a copy of the masters once a window ends with the unit in use (always for a pinned unit).

[Note: evaluations inside a step]
An optimizer step given a closure evaluates it after the step's pre-hook and before the update (Lightning's Trainer
always passes one; LBFGS evaluates it again after moving the masters). So a lent unit's writes are written back after
each evaluation, not in the pre-hook (``evaluations``); before an evaluation after the first, the masters may have
moved and the units are treated as after a step (``Schedule.after_optimizer_step``); after the update a unit still
gathered holds the masters from before it and is released without writing back.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

import torch

from lightning_mics.engine.schedule import Schedule
from lightning_mics.engine.unit import ShardedState, Unit
from lightning_mics.engine.user_code.mirrored_grads import MirroredGrads
from lightning_mics.engine.user_code.optimizer_watch import MethodHook, StepWatch, held_optimizers
from lightning_mics.engine.user_code.write_back import WriteBack


class UserCodeBoundary:
    """[Note: the user-code boundary]: the write-back of every unit, the root's (or pinned unit's) mirrored gradients,
    the optimizer steps heard of. Installs itself as every unit's ``lending``."""

    def __init__(self, units: List[Unit], schedule: Schedule) -> None:
        self.units, self.root, self.schedule = units, units[0], schedule
        self._write_backs: Dict[int, WriteBack] = {
            id(u): WriteBack(u.params, u.full_views, u.shard_flat, u.delivered,
                             watches_versions=u is units[0] or u.pinned, snapshots_at_fill=u.pinned)
            for u in units if u.params}
        # [Note: gradients on the plain parameters] in mirrored_grads.py: every pinned unit is the root
        self.mirrored = [MirroredGrads(u) for u in units if u.params and (u.pinned or u is units[0])]
        self._kept: Set[int] = set()  # units the schedule kept gathered after a pass, until a pass uses them
        self._steps = StepWatch(self.step_begins, self.step_ended)
        self._closure_step = self._evaluated = False  # [Note: evaluations inside a step]
        self.outer: Any = None  # DiLoCo's outer loop, told of each step ([Note: the outer step on shards] in outer_sync.py)
        for unit in units:
            unit.lending = self

    def write_back_of(self, unit: Unit) -> Optional[WriteBack]:
        return self._write_backs.get(id(unit))

    def _write_back(self, unit: Unit) -> None:
        wb = self._write_backs.get(id(unit))
        if wb is not None and unit.state is ShardedState.GATHERED:
            wb.write_back()

    def _use(self, unit: Unit) -> None:
        """A pass uses ``unit``: if it was kept for user code since the last one, what was written comes back first
        (before its reduce-scatter may stage in its full storage: [Note: staging in place] in full_storage.py)."""
        if id(unit) in self._kept:
            self._kept.discard(id(unit))
            self._write_back(unit)

    # -- a unit's own transitions (unit.py) -------------------------------------------------------------
    def filled(self, unit: Unit) -> None:
        wb = self._write_backs.get(id(unit))
        if wb is not None:
            wb.filled()

    def releasing(self, unit: Unit, stale: bool) -> None:
        """``unit`` goes back to its shard (``stale``: an optimizer step moved the masters since its gather)."""
        if (unit.pinned or id(unit) in self._kept) and not stale:
            self._write_back(unit)
        self.dropped(unit)

    def dropped(self, unit: Unit) -> None:
        self._kept.discard(id(unit))
        wb = self._write_backs.get(id(unit))
        if wb is not None:
            wb.forget()

    # -- passes (hooks.py) -----------------------------------------------------------------------------------
    def iteration_begins(self) -> None:
        """The root is entered from outside any forward: edits to mirrored gradients (a ``zero_grad()`` through the
        module), and the root's writes since the last pass, come in before the rows cross the replicas."""
        for m in self.mirrored:
            m.take_edits()
        self._use(self.root)

    def forward_entered(self, unit: Unit, outermost: bool, was_gathered: bool = False) -> None:
        """A forward entered ``unit`` (``outermost``: from outside its forward; ``was_gathered``: it was gathered
        before this entry, so user code may have run since its fill)."""
        if outermost:
            if unit is self.root:  # user code may run inside it (manual optimization's training_step)
                for m in self.mirrored:
                    m.mirror()
            self._use(unit)
        self.regather_if_stale(unit, check_versions=outermost and was_gathered)

    def unit_kept(self, unit: Unit, window_ended: bool) -> None:
        """The schedule left ``unit`` gathered after its forward or backward (``window_ended``: that backward ended
        an accumulation window). A pinned unit is written back only when the masters are read, so a write undone
        before then (weights swapped in for validation and back) leaves them as they were."""
        if not unit.pinned:
            self._kept.add(id(unit))
        wb = self._write_backs.get(id(unit))
        if window_ended and wb is not None and (unit.pinned or unit.depth > 0):
            wb.window_ended_in_use()  # [Note: masters moved outside a step] in write_back.py

    def backward_started(self, unit: Unit) -> None:
        self._use(unit)

    def grads_read(self) -> None:
        """The engine reads the plain gradients next: the mirrors leave them."""
        for m in self.mirrored:
            m.withdraw()

    def boundary_published(self) -> None:
        """The window's gradients are on the optimizer's DTensors: mirrored on a unit still gathered."""
        for m in self.mirrored:
            m.mirror()

    def regather_if_stale(self, unit: Unit, check_versions: bool) -> None:
        """If the masters may have moved since ``unit``'s plain parameters were filled, what user code wrote is
        written back, the rows cross the replicas and the unit is gathered again
        ([Note: masters moved outside a step] in write_back.py). Collective over the shard group (and the replica
        group with rows over replicas), decided the same way on every rank."""
        wb = self._write_backs.get(id(unit))
        if wb is None or unit.state is not ShardedState.GATHERED:
            return
        if wb.stale or (check_versions and wb.moved_in_place()):
            wb.write_back()
            self.schedule.exchange_rows()
            unit.refresh()

    # -- the masters read and moved ----------------------------------------------------------------------
    def masters_read(self, step: bool = False) -> None:
        """Before the masters are read (``step``: by an optimizer step, which also reads the mirrored gradients): every
        gathered unit's writes come back. A gather still in flight reads the masters the step writes next: it is
        released first, its result stale anyway ([Note: streams and buffer lifetime] in collectives.py)."""
        self.schedule.release_gathers_in_flight()
        for unit in self.units:
            self._write_back(unit)
        if step:
            for m in self.mirrored:
                m.take_edits()

    def refuse_rebinding(self) -> None:
        """ValueError if user code ran ``p.data = x`` on a DTensor parameter: torch ignores it there (as under FSDP2),
        and the run would go on from values the user meant to replace (SAM's reference code puts its weights back
        so). Checked when the masters are read: around every step, before a save."""
        for p in (p for u in self.units for p in u.all_params()):
            if p.rebound():
                raise ValueError(
                    f"MiCSStrategy: `p.data = x` on the parameter {p.fqn!r}, a DTensor the optimizer steps, did "
                    "nothing: torch leaves a DTensor's local tensor as it was (pytorch/pytorch#157391), as under "
                    "FSDP2. Write in place instead: `p.copy_(x)` under torch.no_grad(), or `p.data.copy_(x)`.")

    # -- optimizer steps ([Note: steps the engine hears of] in optimizer_watch.py) ----------------------------
    def watch(self, optimizer: torch.optim.Optimizer) -> List[MethodHook]:
        """The steps of ``optimizer`` and of the optimizers it holds, and their ``zero_grad``, reach the boundary;
        ``.remove()`` the returned hooks when the run ends."""
        return [hook for opt in held_optimizers(optimizer)
                for hook in (self._steps.watch(opt), self.follow_zero_grad(opt))]

    def follow_zero_grad(self, optimizer: torch.optim.Optimizer) -> MethodHook:
        """The mirrors follow ``optimizer.zero_grad()``; ``.remove()`` the returned handle when the run ends."""
        return MethodHook(optimizer, "zero_grad", after=lambda: [m.follow_zero_grad() for m in self.mirrored])

    def step_begins(self) -> None:
        """The outermost watched step begins: the masters are read ([Note: evaluations inside a step]: in a step
        that evaluates a closure, after each evaluation instead)."""
        self.refuse_rebinding()
        if not self._closure_step:
            self.masters_read(step=True)
        if self.outer is not None:
            self.outer.step_begins()

    def step_ended(self) -> None:
        """The outermost watched step ended: the masters moved ([``Schedule.after_optimizer_step``]), and every H-th
        step DiLoCo's outer step moves them again first."""
        self.refuse_rebinding()
        if self.outer is not None:
            self.outer.step_ended()
        self.schedule.after_optimizer_step()

    @contextmanager
    def closure_step(self) -> Iterator[None]:
        """An optimizer step whose closure's evaluations are bracketed by ``evaluating`` and ``evaluated``."""
        self._closure_step, self._evaluated = True, False
        try:
            yield
        finally:
            self._closure_step = self._evaluated = False

    def evaluating(self) -> None:
        """An evaluation of the step's closure begins: after the first, the optimizer may have moved the masters."""
        if self._evaluated:
            self.schedule.after_optimizer_step()

    def evaluated(self) -> None:
        """An evaluation of the step's closure ended (with the hooks that follow it): its writes, into the masters."""
        self.masters_read(step=True)
        self._evaluated = True

    def evaluations(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` bracketed by ``evaluating`` and ``evaluated``, for a step inside ``closure_step``."""
        def evaluate() -> Any:
            self.evaluating()
            out = closure()
            self.evaluated()
            return out
        return evaluate

    # -- the run ends -----------------------------------------------------------------------------------
    def remove(self) -> None:
        for m in self.mirrored:
            m.remove()

    def reset(self) -> None:
        """After an exception: no step is running."""
        self._steps.running = 0
        self._kept.clear()
