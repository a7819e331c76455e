"""The communication schedule: every decision about which units are gathered ahead of time, kept or released,
and how much may be gathered at once. The units carry the decisions out (unit.py); the hooks tell the schedule
when something happens (hooks.py).

[Note: prefetch]
An *iteration* starts when the root unit is entered from outside any forward. Each pass records the order in
which units start: forward from the pre-forward hooks, backward from the pre-backward hooks. On the next pass,
when the unit at position i starts, the units at positions i+1 .. i+prefetch of the recorded order get their
all-gather *issued* (async), so the transfer overlaps unit i's compute; each is *finished* (waited for, copied
out, swapped in) only when it runs. If a unit arrives out of the recorded order (control flow changed), nothing
more is prefetched in that pass and the new order is recorded instead.

[Note: live cap]
``max_live_parameters`` bounds the elements gathered at once, in param_dtype: a gather in flight counts its buffers
(``Unit.gather_numel``: the padded (s, S) output; with two hops also hop 1's output, and an int8 hop's wire), a
gathered unit its full storage (``Unit.stored_numel``, with its room for staging: [Note: staging in place] in
unit.py). The unit about to compute is always allowed: first, units that are gathered but idle (kept for backward,
or prefetched and not yet running) are released to make room; a prefetch that would exceed the cap is skipped, and
that unit is gathered when it runs. So the live elements never exceed the cap plus the running unit (its gather's
buffers and its full storage together, for the copy-out).

[Note: keep for backward]
The units whose backward comes first, the root (it computes the loss) and the last unit to start its forward,
stay gathered from forward into backward when grad is enabled (as FSDP2 keeps its root): releasing and gathering
them again is waste. Inside an accumulation window the root also stays gathered from one micro-batch's backward
into the next one's forward, which needs it first: the parameters cannot change before the optimizer step, whose
hook releases it. ``reshard_after_forward=False`` keeps *every* unit from its forward into its backward (one
all-gather per unit per micro-batch instead of two). Kept units are idle, so when something must be gathered the
cap evicts them first, the earliest kept first, to be gathered again in backward ([Note: live cap]); what is kept
and not used is released at the end of backward, at the next iteration, or after an optimizer step.
"""

from __future__ import annotations

from typing import List, Optional

from lightning_mics.engine.optimizer_rows import exchange
from lightning_mics.engine.unit import ShardedState, Unit


class Schedule:
    def __init__(self, units: List[Unit], prefetch: int, max_live: int, keep_for_backward: bool,
                 reshard_after_forward: bool = True) -> None:
        self.units = units
        self.root = units[0]
        self.prefetch = prefetch
        self.max_live = max_live
        self.keep_for_backward = keep_for_backward
        self.reshard_after_forward = reshard_after_forward
        self.forward_order: List[Unit] = []
        self.backward_order: List[Unit] = []
        self._forward_seen: List[Unit] = []
        self._backward_seen: List[Unit] = []
        self._forward_valid = False
        self._backward_valid = False

    # -- accounting -----------------------------------------------------------------------------------
    def live(self) -> int:
        return sum(u.live_numel for u in self.units)

    def make_room(self, unit: Unit) -> None:
        """Before ``unit`` is gathered to run: release idle gathered units while it would exceed the cap."""
        need = 0 if unit.is_live else unit.gather_numel
        if self.live() + need <= self.max_live:
            return
        for other in self._eviction_order(unit):
            other.release()
            if self.live() + need <= self.max_live:
                return

    def _eviction_order(self, unit: Unit) -> List[Unit]:
        idle = [u for u in self.units if u is not unit and u.is_live and not u.in_use]
        # prefetched-but-not-started last: they are the ones needed soonest
        return sorted(idle, key=lambda u: u.is_prefetched)

    def _try_prefetch(self, unit: Unit) -> None:
        if unit.is_live or not unit.full_numel:
            return
        if self.live() + unit.gather_numel > self.max_live:
            return
        unit.issue_gather(prefetched=True)

    # -- passes ---------------------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """The root is entered from outside any forward: a new forward pass starts; what a forward without
        backward left gathered (other than units still running) is released."""
        for unit in self.units:
            if unit.depth == 0 and unit is not self.root:
                unit.release()
        self.exchange_rows()  # after the root's writes came back (``UserCodeBoundary.iteration_begins``)
        if self._forward_seen:
            self.forward_order = self._forward_seen
        self._forward_seen = []
        self._forward_valid = bool(self.forward_order)

    def on_forward(self, unit: Unit) -> None:
        pos = len(self._forward_seen)
        self._forward_seen.append(unit)
        order = self.forward_order
        if self._forward_valid and (pos >= len(order) or order[pos] is not unit):
            self._forward_valid = False
        self.make_room(unit)
        if self._forward_valid and self.prefetch:
            for nxt in order[pos + 1: pos + 1 + self.prefetch]:
                self._try_prefetch(nxt)

    def on_backward(self, unit: Unit) -> None:
        """First pre-backward hook of ``unit`` in this backward pass."""
        if not self._backward_seen:
            self._backward_valid = bool(self.backward_order)
        pos = len(self._backward_seen)
        self._backward_seen.append(unit)
        order = self.backward_order
        if self._backward_valid and (pos >= len(order) or order[pos] is not unit):
            self._backward_valid = False
        self.make_room(unit)
        if self._backward_valid and self.prefetch:
            for nxt in order[pos + 1: pos + 1 + self.prefetch]:
                self._try_prefetch(nxt)

    def end_backward(self) -> None:
        if self._backward_seen:
            self.backward_order = self._backward_seen
        self._backward_seen = []

    def gather_for_recompute(self, unit: Unit) -> None:
        """A forward inside backward (activation checkpointing's recomputation): the unit runs again."""
        if not unit.is_live:
            self.make_room(unit)
        unit.finish_gather()

    def keep_after_forward(self, unit: Unit) -> bool:
        """[Note: keep for backward]."""
        if not self.reshard_after_forward:
            return True
        if not self.keep_for_backward:
            return False
        if unit is self.root:
            return True
        last: Optional[Unit] = next((u for u in reversed(self.forward_order) if u is not self.root), None)
        return unit is last

    def after_forward(self, unit: Unit, grad: bool) -> None:
        """The outermost forward call of ``unit`` returned: released unless kept for backward; after the root's
        forward without grad (evaluation) no backward follows, so nothing prefetched may linger."""
        if not (grad and self.keep_after_forward(unit)):
            unit.release()
        if unit is self.root and not grad:
            self.release_idle(pinned=False)

    def releases_after_backward(self, unit: Unit, boundary: bool) -> bool:
        """Whether ``unit`` is released once its backward is done (``boundary``: this backward ends an
        accumulation window)."""
        if unit.depth > 0 or unit.pinned:  # backward inside the unit's own forward (manual optimization)
            return False
        # [Note: keep for backward]: the next micro-batch of this window needs the root first
        return not (unit is self.root and not boundary and self.keep_for_backward)

    def after_backward(self, unit: Unit, boundary: bool) -> None:
        if self.releases_after_backward(unit, boundary):
            unit.release()

    def release_idle(self, pinned: bool = True) -> None:
        """Releases every unit that is not running (waiting for its prefetch): before a state dict or a save,
        so the modules hold their DTensor masters, and after a pass without grad, so no gather lingers
        (``pinned=False``: pinned units stay, as between training steps)."""
        for unit in self.units:
            unit.settle_rows()  # [Note: rows between steps] in optimizer_rows.py
            if not unit.in_use:
                unit.release(force=pinned)

    def exchange_rows(self) -> None:
        """The optimizer's rows that changed since the replicas agreed on them start across the replicas
        ([Note: rows between steps] in optimizer_rows.py). Collective over the replica group."""
        exchange([u.optimizer_rows for u in self.units if u.optimizer_rows is not None])

    def release_gathers_in_flight(self) -> None:
        """A gather still in flight reads the masters, which a step is about to write: released, its result stale
        anyway ([Note: streams and buffer lifetime] in collectives.py)."""
        for unit in self.units:
            if unit.state is ShardedState.GATHERING and not unit.in_use:
                unit.release()

    def after_optimizer_step(self) -> None:
        """The masters moved: after every optimizer step, and before a step's closure is evaluated again
        ([Note: evaluations inside a step] in user_code/boundary.py). The updated rows are due across the replicas
        ([Note: rows between steps] in optimizer_rows.py); units still in use, or pinned, get the new values; idle
        ones are released, their plain parameters (the masters before the step, written back then) left out."""
        for unit in self.units:
            unit.rows_stepped()
        for unit in self.units:
            if unit.state is ShardedState.GATHERED and (unit.depth > 0 or unit.pinned):
                unit.refresh()
            else:
                unit.release(stale=True)
