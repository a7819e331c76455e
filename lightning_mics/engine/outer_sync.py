"""DiLoCo's outer loop on the sharded layout ([Note: DiLoCo across replica groups] in options.py): the anchor (the
last synced masters), the pseudo-gradients, their average over the replica groups, the outer SGD.

[Note: the outer step on shards]
Rank k of every replica group holds the same rows of the model (its shard of each unit, and the replicated
parameters whole), so DiLoCo's sync needs no gather: each rank averages the change of its own masters since the last
sync, ``anchor - masters`` (in fp32), with rank k of the other groups (one all-reduce on the replica group, in int8
blocks with ``quantize_gradients=True``), and takes a step of ``torch.optim.SGD`` over the anchors with that average as
their gradient; the anchors are then copied into the masters. Invariant: after every outer step each master equals its
anchor on every replica group, and the anchor and the outer momentum are the same on every rank of a replica group
(the same inputs, the same fp32 ops). Between outer steps the anchor is untouched. The sync runs at the end of every
``sync_every``-th optimizer step the engine hears of, before the schedule refreshes what stays gathered. With
fragments, each fragment's masters and anchors keep this invariant at its own sync ([Note: streaming fragments] in
fragments.py).

[Note: an outer step not taken]
With ``across`` set (fault tolerance: the replica groups are torchrun jobs averaged through torchft's manager), a
sync (with fragments: each fragment's, at its apply) ends with the manager's commit decision. When it is False (a
group of the quorum failed in the average), this group applies no outer step: the masters synced (the fragment's) are
set back to their anchors (the last committed sync's model, as torchft's DiLoCo restores its original parameters),
the anchors and the outer momentum stay as they were, the inner optimizer keeps its state, and the window's inner
steps stay taken by the loop (its step count, the data it read): the window is dropped, not retried.
``outer_steps`` counts committed syncs only, ``dropped`` the others.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol

import torch
from torch import Tensor

from lightning_mics.comm import collectives, quantized
from lightning_mics.comm.telemetry import CommLog
from lightning_mics.engine.fragments import Average, InFlight, applies_after, sent_after, split_units
from lightning_mics.layout.topology import Topology
from lightning_mics.engine.unit import Unit


class Across(Protocol):
    """The average across replica groups beyond this engine's world ([Note: DiLoCo across fault-tolerant groups] in
    frontends/fault_tolerance/groups.py): ``quorum`` before the pseudo-gradients are taken (it may replace this
    rank's state with a live peer's, in place), ``average`` of one flat fp32 buffer in place (``async_op``: it may
    return a work still in flight, waited for before ``commit``), ``commit``."""

    def quorum(self) -> None: ...

    def average(self, flat: Tensor, async_op: bool) -> Optional[Any]: ...

    def commit(self) -> bool: ...


class OuterSync:
    """The outer loop of one engine: its anchors, the outer SGD over them, the count of inner steps since the last
    sync ([Note: the outer step on shards])."""

    def __init__(self, units: List[Unit], topo: Topology, options: Any, log: CommLog) -> None:
        self.topo, self.log = topo, log
        self.sync_every, self.delay, self.mixing = options.sync_every, options.sync_delay, options.fragment_mixing
        self.lr, self.momentum, self.nesterov = options.outer_lr, options.outer_momentum, options.outer_nesterov
        self.quantize = bool(options.quantize_gradients)
        self.block_size, self.kernels = options.quantization_block_size, options.kernels
        # the masters, in a fixed order (the same on every rank of a replica group): each unit's flat shard, then
        # its replicated parameters
        self.masters: List[Tensor] = []
        by_unit, sizes, held = [], [], []  # of each unit that has masters: their indices, its elements counted whole
        for k, unit in enumerate(units):
            first = len(self.masters)
            if unit.params:
                self.masters.append(unit.shard_flat)
            self.masters.extend(rp.local for rp in unit.replicated)
            if len(self.masters) > first:
                by_unit.append(list(range(first, len(self.masters))))
                sizes.append(unit.full_numel + sum(rp.local.numel() for rp in unit.replicated))
                held.append(k)
        # [Note: streaming fragments] in fragments.py: each fragment's units (their index in ``units``) and masters
        runs = split_units(sizes, options.sync_fragments)
        self.fragment_units = [[held[u] for u in run] for run in runs]
        self.fragments = [[i for u in run for i in by_unit[u]] for run in runs]
        self.in_flight: Optional[InFlight] = None  # the fragment sent and not yet applied
        self.anchors: Optional[List[Tensor]] = None  # taken at the first step (after any load)
        self.optimizer: Optional[torch.optim.SGD] = None
        self.steps = 0  # inner optimizer steps into the window (since the last sync of the whole shard or fragment F - 1)
        self.outer_steps = 0
        self.across: Optional[Across] = None  # the front end's, under fault tolerance (else the replica group's)
        self.dropped = 0  # syncs not committed ([Note: an outer step not taken])
        self.loaded_inner: Optional[Dict[str, Any]] = None  # a load's inner optimizer state, until the optimizers load

    # -- the anchor -------------------------------------------------------------------------------------
    @torch.no_grad()
    def take_anchors(self) -> None:
        """The current masters become the last synced ones (setup, a load without outer state); the outer momentum
        starts from zero."""
        self.anchors = [m.detach().float().clone() for m in self.masters]
        self.optimizer = torch.optim.SGD(self.anchors, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)

    def forget(self) -> None:
        """The masters were replaced (a load): the anchors are taken again before the next step; a fragment in flight
        is waited for and dropped."""
        self.settle()
        self.anchors, self.optimizer, self.steps, self.in_flight = None, None, 0, None

    def step_begins(self) -> None:
        """An inner optimizer step begins: the first one takes the anchors (the masters as the run starts)."""
        if self.anchors is None:
            self.take_anchors()

    def step_ended(self) -> None:
        """An inner optimizer step ended: every ``sync_every``-th one is followed by the outer step (with fragments:
        a fragment is sent, and one applies, on their steps of [Note: streaming fragments] in fragments.py).
        Collective over the replica group."""
        if self.anchors is None:  # a step nobody heard begin (cannot happen through the watch; kept safe)
            self.take_anchors()
        self.steps += 1
        count = len(self.fragments)
        sent = sent_after(self.steps, self.sync_every, count, self.delay)
        if sent is not None:
            self.send(sent)
        if self.in_flight is not None and self.steps == applies_after(self.in_flight.fragment, self.sync_every, count):
            self.apply()
        if self.steps >= self.sync_every:
            self.steps = 0

    def sends_next(self) -> bool:
        """Whether the next inner step ends with a send (the whole shard's or a fragment's): its quorum is due."""
        return sent_after(self.steps + 1, self.sync_every, len(self.fragments), self.delay) is not None

    def buffers(self) -> List[Tensor]:
        """What the outer loop keeps (model-state accounting): the anchors and the outer momentum."""
        if self.anchors is None or self.optimizer is None:
            return []
        momentum = [self.optimizer.state.get(a, {}).get("momentum_buffer") for a in self.anchors]
        return [*self.anchors, *(m for m in momentum if m is not None)]

    # -- the outer step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def pseudo_gradient(self, which: List[int]) -> Tensor:
        """``anchor - master`` of the masters ``which``, in one fp32 flat (this rank's contribution)."""
        assert self.anchors is not None
        return torch.cat([(self.anchors[i] - self.masters[i].float()).reshape(-1) for i in which])

    @torch.no_grad()
    def average(self, flat: Tensor, async_op: bool = False) -> Average:
        """The mean of ``flat`` over the replica group, in place (int8 blocks with ``quantize_gradients``), made
        by the returned ``Average``'s ``wait()``; ``async_op``: still in flight until then. Over the quorum's groups
        through ``across`` when set (a mean already divided when its work is waited for)."""
        if self.across is not None:
            return Average(flat, self.across.average(flat, async_op), 1, self.log)
        group, r = self.topo.replica_group, self.topo.layout.replicas
        work = None
        if r > 1:
            if self.quantize:
                work = quantized.quantized_all_reduce(flat, group, self.block_size, async_op=async_op, log=self.log,
                                                      group_name="replicate", kernels=self.kernels)
            else:
                work = collectives.all_reduce_sum(flat, group, async_op=async_op, log=self.log, group_name="replicate")
        return Average(flat, work, r, self.log)

    @torch.no_grad()
    def send(self, fragment: int) -> None:
        """Fragment ``fragment``'s pseudo-gradient into its average over the replica group (in flight with a delay)."""
        assert self.in_flight is None, "a fragment is still in flight"  # sync_delay < sync_every / sync_fragments
        if self.across is not None:
            self.across.quorum()  # a peer's state, if taken, is in place before the pseudo-gradients
        flat = self.pseudo_gradient(self.fragments[fragment])
        self.in_flight = InFlight(fragment, self.average(flat, async_op=self.delay > 0))

    @torch.no_grad()
    def apply(self) -> None:
        """[Note: the outer step on shards] for the fragment in flight: its average waited for, its anchors stepped
        and copied into its masters (merged with them by ``fragment_mixing``: [Note: streaming fragments])."""
        assert self.anchors is not None and self.optimizer is not None and self.in_flight is not None
        fragment, average = self.in_flight
        self.in_flight = None
        which = self.fragments[fragment]
        anchors = [self.anchors[i] for i in which]
        mean = average.wait()
        if self.across is not None and not self.across.commit():  # [Note: an outer step not taken]
            for i, a in zip(which, anchors):
                self.masters[i].copy_(a)
            self.dropped += 1
            return
        for a, g in zip(anchors, mean.split([a.numel() for a in anchors])):
            a.grad = g.view_as(a)
        self.optimizer.step()  # SGD steps only the anchors with a gradient: this fragment's
        for i, a in zip(which, anchors):
            a.grad = None
            m = self.masters[i]
            m.copy_(torch.lerp(a, m.float(), self.mixing) if self.mixing else a)
        self.outer_steps += 1

    def settle(self) -> None:
        """Waits for the fragment in flight, if any (it still applies at its step): before a save or a teardown."""
        if self.in_flight is not None:
            self.in_flight.average.wait()

    def drop_unfinished(self) -> None:
        """After an exception (no collective: a peer may be gone): a fragment still in flight is dropped unwaited."""
        if self.in_flight is not None and not self.in_flight.average.done:
            collectives.abandon(self.in_flight.average.work)
            self.in_flight = None

    # -- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """What resumes the outer loop: the anchors, the outer momentum, the inner steps into the window, the outer
        steps, the fragment in flight (-1: none) and its average, waited for here (the anchors taken now if no step
        took them yet)."""
        if self.anchors is None:
            self.take_anchors()
        assert self.optimizer is not None
        self.settle()
        momentum = [self.optimizer.state.get(a, {}).get("momentum_buffer") for a in self.anchors]
        pending = -1 if self.in_flight is None else self.in_flight.fragment
        out = {"anchors": list(self.anchors),
               "momentum": [torch.zeros_like(a) if m is None else m for a, m in zip(self.anchors, momentum)],
               "has_momentum": torch.tensor([m is not None for m in momentum]),
               "steps": torch.tensor([self.steps, self.outer_steps, pending], dtype=torch.int64)}
        if self.in_flight is not None:
            out["in_flight"] = self.in_flight.average.wait()
        return out

    @torch.no_grad()
    def load_state(self, state: Dict[str, Any]) -> None:
        """Takes back ``state`` (of ``state()``, on a run of this layout: checked by the caller)."""
        anchors = state["anchors"]
        if [a.numel() for a in anchors] != [m.numel() for m in self.masters]:
            raise ValueError("the checkpoint's DiLoCo anchors hold "
                             f"{[a.numel() for a in anchors][:6]} elements, this rank's masters "
                             f"{[m.numel() for m in self.masters][:6]}: it was saved with another model or layout")
        self.anchors = [a.detach().float().clone().view_as(m) for a, m in zip(anchors, self.masters)]
        self.optimizer = torch.optim.SGD(self.anchors, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        for a, m, has in zip(self.anchors, state["momentum"], state["has_momentum"].tolist()):
            if has:
                self.optimizer.state[a]["momentum_buffer"] = m.detach().float().clone().view_as(a)
        steps = [int(v) for v in state["steps"].tolist()]
        self.steps, self.outer_steps = steps[:2]
        pending = steps[2] if len(steps) > 2 else -1  # (saved before fragments: none in flight)
        self.settle()
        self.in_flight = None if pending < 0 else \
            InFlight(pending, Average.of(state["in_flight"].detach().float().clone().reshape(-1)))
