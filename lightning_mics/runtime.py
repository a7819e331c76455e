"""Units and the hooks that drive them: gather before compute, release after, reduce gradients, sync replicas.

[Note: one optimizer step]
forward, unit by unit:  the outermost entry into a unit (its module, or for the root any module holding a root
                        parameter) finishes its all-gather (issued earlier by a prefetch, or now), swaps the full
                        parameters into the modules and prefetches the next units ([Note: prefetch] in
                        schedule.py); when the last nested call returns, the unit is released (or kept for
                        backward) and hooks its outputs for backward.
backward, reverse:      a hook on the unit's outputs gathers it again; the unit's gradients are complete when an
                        autograd function on its inputs fires (or, for a unit whose inputs need no gradient, when
                        every trainable parameter's gradient has been accumulated): they are reduce-scattered in
                        the shard group (async) into the unit's accumulator and the unit is released.
end of backward:        a callback on the autograd engine reduces what is left, then, only at an accumulation
                        boundary (Lightning's block_backward_sync marks the others), all-reduces the accumulators
                        across the replica group (MiCS 2-hop sync) and the replicated parameters' gradients
                        across the world, and adds the result to the DTensor parameters' ``.grad`` (added, as
                        plain PyTorch does, when the user has not zeroed them).
optimizer step:         the user's optimizer steps the DTensor shards ([Note: placement] in placement.py); a
                        post-step hook refreshes any unit that is still gathered (manual optimization steps inside
                        the root's forward) and drops stale prefetches.

[Note: unit lifecycle]
``ShardedState``: SHARDED -> GATHERING (all-gather issued) -> GATHERED (copied out, full parameters in the
modules) -> SHARDED. ``TrainingState``: IDLE -> FORWARD -> (IDLE) -> PRE_BACKWARD -> POST_BACKWARD -> IDLE.
``depth`` counts nested forward calls into the unit; only the outermost one gathers, hooks the backward and
releases. Whether autograd is running comes from autograd itself (``_current_graph_task_id``): a forward that
runs inside backward (activation checkpointing's recomputation) finds its unit gathered by the pre-backward
hook and neither counts nor releases. Manual optimization runs backward and ``optimizer.step`` inside the
root's forward: the end-of-backward callback reduces the root without releasing it (depth > 0), and the
post-step hook refreshes it.

[Note: optimizer-state-only sharding]
``shard_optimizer_state=True`` with s = 1 (SageMaker's optimizer state sharding, ZeRO stage 1) is the same
machinery with the placement spread over the whole data-parallel group: the layout's shard group is all W
ranks, and one unit (the root) owns every parameter and is *pinned*: gathered at its first forward and kept,
so parameters and gradients stay whole on every rank and no forward or backward gathers anything. Its full
gradients accumulate locally over the micro-batches of a window (moved into reduce_dtype accumulators at the
end of each backward when param_dtype is lower, so bf16 gradients are summed in fp32 as the per-micro-batch
reduce-scatter sums them otherwise); at the boundary they are reduce-scattered
once over the W ranks, each rank's optimizer steps its 1/W rows (the DTensor shards, with 1/W of the optimizer
state), and the post-step hook's refresh is the one all-gather that makes the parameters whole again. Only a
state dict or a save unpins (``quiesce``); the next forward gathers again.

[Note: staging in place]
A unit released right after its gradients are reduce-scattered no longer needs its full parameters once the
reduction starts: its backward is done. The rank-major reduce-scatter input is laid out in the unit's own
full-parameter storage (allocated with room for it: the padded s x S elements in reduce_dtype, when
reduce_dtype is no wider than param_dtype), instead of in a new buffer of the unit's size. The release then
leaves the storage allocated until the last reduce-scatter reading it is waited for (``finish_reduce`` frees
it), and a gather or refresh that writes the storage first waits for those reductions. Units kept gathered
(the root inside an accumulation window, a pinned unit, a unit still running its forward) stage in a buffer
of their own as before. On CPU, where a buffer above glibc's mmap threshold is a fresh mapping every time, this
saves the page faults of one unit-sized buffer per reduction; everywhere it lowers the backward peak by one.

[Note: replica sync overlap]
In the boundary micro-batch the replica all-reduce of a unit's accumulator starts as soon as the unit's last
reduce-scatter of this backward is finished, while the backward of the units before it still runs (as DDP and
FSDP2 HSDP start cross-replica traffic per bucket); the end of backward waits for all of them before the
optimizer step. Collectives on one group must be issued in the same order on every rank, whatever the timing:
the all-reduces are issued in the fixed order ``reversed(units)`` (the usual backward order), a unit only after
every unit before it in that order, and whatever the backward did not issue is issued at the end in the same
order. A unit reduced again after its all-reduce was issued (a gradient accumulated after its post-backward)
adds the late part to a second buffer that is all-reduced at the end: AR(a) + AR(b) = AR(a + b).

[Note: version counters]
Autograd saves the full parameters for backward. Between forward and backward their storage is freed and then
refilled by the re-gather, an in-place write that would bump the version counter and make autograd refuse the
saved tensors; the refill restores the counter, as FSDP2 does, because the values are the same. The refresh
after an optimizer step does bump it: the values changed, and a graph built before the step must fail as it
would in plain PyTorch.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_mics import collectives as C
from lightning_mics.activations import ActivationCheckpointing, plan_groups
from lightning_mics.materialize import has_meta, materialize
from lightning_mics.placement import ReplicatedParam, Rows, ShardedParam, as_dtensor, local
from lightning_mics.replicated import ReplicatedReducer
from lightning_mics.schedule import Schedule
from lightning_mics.sharding import UnitPlan, plan_sharding, resolve_classes
from lightning_mics.telemetry import CommLog
from lightning_mics.config import MiCSOptions
from lightning_mics.topology import Topology


class ShardedState(enum.Enum):
    SHARDED = "sharded"  # only the local flat shard exists
    GATHERING = "gathering"  # all-gather issued, not yet copied out
    GATHERED = "gathered"  # full parameters are swapped into the modules


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


def in_backward() -> bool:
    """Whether the autograd engine is executing a backward pass on this thread (as FSDP2 asks it)."""
    return torch._C._current_graph_task_id() != -1


class _Bucket(NamedTuple):
    slots: Tuple[int, ...]  # indices into Unit.params
    lo: int  # region of the flat shard when the slots are consecutive, else -1
    hi: int


class _PendingReduce(NamedTuple):
    unit: "Unit"
    bucket: _Bucket
    result: C.ReduceScatterResult
    in_full: bool  # its input lies in the unit's full-parameter storage ([Note: staging in place])


class Unit:
    """One gather/release unit: its flat shard, full parameters, replicated parameters and gradient state."""

    def __init__(self, plan: UnitPlan, topo: Topology, *, param_dtype: Optional[torch.dtype],
                 reduce_dtype: torch.dtype, bucket_size: int, kernels: str, log: CommLog,
                 device: torch.device, nodes: Optional[C.NodeGroups] = None) -> None:
        self.path = plan.path or "<root>"
        self.module = plan.module
        self.topo, self.kernels, self.log = topo, kernels, log
        self.s = topo.layout.shard_size
        self.dp_size = topo.layout.dp_size  # gradients average over the data-parallel ranks (W / t)
        self.bucket_size = bucket_size
        self.nodes = nodes  # two-hop all-gather groups, or None: flat
        dtypes = {pp.param.dtype for pp in plan.params}
        if len(dtypes) > 1:
            raise ValueError(f"unit {self.path!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "MiCSStrategy needs one dtype per unit (see the shard_units option)")
        self.dtype = dtypes.pop() if dtypes else torch.get_default_dtype()
        self.param_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype
        self.device = device

        # Sharded parameters: padded regions of one flat shard (the optimizer's DTensors are views into it).
        tp_locals = [local(pp.param) for pp in plan.params]  # [Note: tensor-parallel placement] in placement.py
        rows = [Rows(t.shape[0], t[0].numel() if t.shape[0] else 0, self.s, topo.shard_rank) for t in tp_locals]
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r.padded_numel)
        self.shard_flat = torch.zeros(offsets[-1], dtype=self.dtype, device=device)
        self.params: List[ShardedParam] = []
        for i, (pp, r) in enumerate(zip(plan.params, rows)):
            sp = ShardedParam(i, pp.refs, pp.param, topo.mesh, r, self.shard_flat, offsets[i])
            if not sp.meta:
                sp.copy_rows_from_full(tp_locals[i].detach())
            self.params.append(sp)

        # Full parameters: Parameters aliasing one buffer in param_dtype whose storage is freed while sharded.
        numels = [math.prod(sp.shape) for sp in self.params]
        self.full_numel = sum(numels)
        self.full_flat = torch.empty(self.full_numel, dtype=self.param_dtype, device=device)
        self._full_nbytes = self.full_flat.untyped_storage().nbytes()
        # [Note: staging in place]: room for the reduce-scatter input of the whole unit after the parameters
        staging_nbytes = self.s * self.shard_flat.numel() * reduce_dtype.itemsize
        self._stage_in_full = self.s > 1 and reduce_dtype.itemsize <= self.param_dtype.itemsize
        self._gathered_nbytes = max(self._full_nbytes, staging_nbytes) if self._stage_in_full else self._full_nbytes
        self._reading_full: List[dist.Work] = []  # reduce-scatters whose input lies in the full storage
        self.full_views: List[Tensor] = []
        start = 0
        for sp, n in zip(self.params, numels):
            view = self.full_flat[start:start + n].view(sp.shape)
            self.full_views.append(view)
            sp.full = sp.make_full(view)
            start += n
        self.full_flat.untyped_storage().resize_(0)

        self.replicated: List[ReplicatedParam] = [
            ReplicatedParam(i, pp.refs, pp.param, topo.mesh, device) for i, pp in enumerate(plan.replicated)]

        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.is_prefetched = False  # issued by the schedule, not yet run
        self.pinned = False  # gathered once and kept ([Note: optimizer-state-only sharding])
        self.depth = 0  # nested forward calls in progress
        self.pending_post_backward = 0  # forward calls whose post-backward has not fired
        self.registered_post_backward = 0  # forward calls (this iteration) that hooked their inputs
        self.accumulated = 0  # trainable full parameters whose gradient autograd accumulated this backward
        self.needs_reduce = False
        self.accum: Optional[Tensor] = None  # this window's reduced shard gradients (reduce_dtype), lazily
        self.replica_issued = False  # the accumulator's replica all-reduce is in flight ([Note: replica sync
        self.late: Optional[Tensor] = None  # overlap]); reductions finished after that go to ``late``
        self._replica_work: List[Tuple[Optional[dist.Work], Optional[Tensor], List[Tensor]]] = []
        self.stash: List[Optional[Tensor]] = [None] * len(self.params)  # [Note: optimizer-state-only sharding]
        self.got_grad = torch.zeros(len(self.params), dtype=torch.bool)
        self._gather: Optional[C.AllGatherResult] = None
        self._buckets: Dict[Tuple[int, ...], List[_Bucket]] = {}
        self.on_accumulated: Optional[Any] = None  # the engine's post-accumulate-grad hooks, sharded params
        self.on_replicated: Optional[Any] = None  # and replicated ones (called with the ReplicatedParam)
        self.hook_handles: Dict[int, Any] = {}  # registered lazily: only a tensor that requires grad takes one
        self._swap_sharded()

    # -- properties -----------------------------------------------------------------------------------
    @property
    def is_live(self) -> bool:
        return self.state is not ShardedState.SHARDED

    @property
    def in_use(self) -> bool:
        return self.depth > 0 or self.training_state is TrainingState.PRE_BACKWARD

    def trainable(self) -> Tuple[int, ...]:
        """Sharded parameters that take part in gradient reduction: ``requires_grad`` of the DTensor, which
        the user sets alike on every rank, so every rank issues the same collectives."""
        return tuple(i for i, sp in enumerate(self.params) if sp.requires_grad)

    # -- swapping -------------------------------------------------------------------------------------
    def _swap_sharded(self) -> None:
        for p in (*self.params, *self.replicated):
            for ref in p.refs:
                ref.module._parameters[ref.attr] = p.sharded

    def _swap_full(self) -> None:
        for p in (*self.params, *self.replicated):
            if p.full.requires_grad != p.sharded.requires_grad:
                p.full.requires_grad_(p.sharded.requires_grad)
            if p.full.requires_grad and id(p) not in self.hook_handles:
                if isinstance(p, ShardedParam) and self.on_accumulated is not None:
                    self.hook_handles[id(p)] = p.full.register_post_accumulate_grad_hook(self.on_accumulated)
                elif isinstance(p, ReplicatedParam) and self.on_replicated is not None:
                    hook = self.on_replicated
                    self.hook_handles[id(p)] = p.full.register_post_accumulate_grad_hook(lambda _, rp=p: hook(rp))
            for ref in p.refs:
                ref.module._parameters[ref.attr] = p.full

    # -- gather / release -----------------------------------------------------------------------------
    def issue_gather(self, prefetched: bool = False) -> None:
        """SHARDED -> GATHERING: the all-gather of the flat shard (cast to param_dtype) is issued, async."""
        if self.state is not ShardedState.SHARDED:
            return
        if self.params:
            self._gather = self._all_gather(async_op=True)
        self.state = ShardedState.GATHERING
        self.is_prefetched = prefetched
        self.log.live(self.full_numel)

    def finish_gather(self) -> None:
        """-> GATHERED: waits for the all-gather, copies out into the full parameters, swaps them in."""
        if self.state is ShardedState.GATHERED:
            return
        if self.state is ShardedState.SHARDED:
            self.issue_gather()
        if self.params:
            res, self._gather = self._gather, None
            out = C.gathered(res, self.log)
            self._settle_full()
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full_flat):
                self.full_flat.untyped_storage().resize_(self._full_nbytes if self.pinned else self._gathered_nbytes)
                C.copy_out(out, self.full_views, self.s, self.kernels)
        self._swap_full()
        self.state = ShardedState.GATHERED
        self.is_prefetched = False

    def _all_gather(self, async_op: bool) -> C.AllGatherResult:
        if self.nodes is not None:
            return C.all_gather_two_hop(self.shard_flat, self.nodes, dtype=self.param_dtype, async_op=async_op,
                                        log=self.log, kernels=self.kernels)
        return C.all_gather_flat(self.shard_flat, self.topo.shard_group, self.s, dtype=self.param_dtype,
                                 async_op=async_op, log=self.log, kernels=self.kernels)

    def release(self, force: bool = False) -> None:
        """-> SHARDED: the DTensors go back into the modules and the full storage is freed. A pinned unit
        stays gathered unless ``force``."""
        if self.state is ShardedState.SHARDED or (self.pinned and not force):
            return
        if self._gather is not None:  # a prefetch never used: its first hop is waited, no second hop (alike
            C.wait(self._gather.work, self.log)  # on every rank: these decisions follow the same events)
            self._gather = None
        self._swap_sharded()
        if self.params and not self._reading_full:  # else the last reduce-scatter reading it frees it
            self.full_flat.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED
        self.is_prefetched = False
        self.log.live(-self.full_numel)

    def _settle_full(self) -> None:
        """Before the full storage is written again: the reduce-scatters still reading it are waited for."""
        for work in self._reading_full:
            C.wait(work, self.log)
        self._reading_full.clear()

    def refresh(self) -> None:
        """After an optimizer step, a unit still in use gets the new values ([Note: version counters])."""
        if not self.params or self.state is not ShardedState.GATHERED:
            return
        out = C.gathered(self._all_gather(async_op=False), self.log)
        self._settle_full()
        with torch.no_grad():  # an in-place write: it bumps the version counter, as an optimizer step does
            C.copy_out(out, self.full_views, self.s, self.kernels)

    def drop(self) -> None:
        """Local reset after a failure: no collective, no wait (a peer may be gone)."""
        self._gather = None
        for sp in self.params:
            sp.full.grad = None
        self._swap_sharded()
        if self.params and not self._reading_full:  # a collective may still read it: left allocated
            self.full_flat.untyped_storage().resize_(0)
        self._reading_full.clear()
        if self.state is not ShardedState.SHARDED:
            self.log.live(-self.full_numel)
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.is_prefetched = False
        self.depth = self.pending_post_backward = self.registered_post_backward = self.accumulated = 0
        self.needs_reduce = False
        self.accum = self.late = None
        self.replica_issued = False
        self._replica_work.clear()
        self.stash = [None] * len(self.params)
        self.got_grad.zero_()

    # -- gradients --------------------------------------------------------------------------------------
    def buckets(self, slots: Tuple[int, ...]) -> List[_Bucket]:
        """Runs of ``slots`` of at most ``bucket_size`` full elements (at least one parameter each)."""
        cached = self._buckets.get(slots)
        if cached is not None:
            return cached
        runs = C.bucket_runs([math.prod(self.params[i].shape) for i in slots], self.bucket_size)
        out = [self._bucket([slots[k] for k in run]) for run in runs]
        self._buckets[slots] = out
        return out

    def _bucket(self, slots: List[int]) -> _Bucket:
        consecutive = all(b == a + 1 for a, b in zip(slots, slots[1:]))
        if consecutive:
            first, last = self.params[slots[0]], self.params[slots[-1]]
            return _Bucket(tuple(slots), first.offset, last.offset + last.rows.padded_numel)
        return _Bucket(tuple(slots), -1, -1)

    def _regions(self, bucket: _Bucket, flat: Tensor) -> List[Tensor]:
        return [flat[sp.offset:sp.offset + sp.rows.padded_numel] for sp in (self.params[i] for i in bucket.slots)]

    def issue_reduce(self, releasing: bool = False) -> List[_PendingReduce]:
        """Reduce-scatters the full gradients of the trainable parameters (zeros where this rank has none),
        bucket by bucket, async; frees the full gradients. ``finish_reduce`` adds the results. ``releasing``:
        the unit is released right after, so its full storage can hold the input ([Note: staging in place])."""
        self.needs_reduce = False
        slots = self.trainable()
        pending: List[_PendingReduce] = []
        in_full = releasing and self._stage_in_full and self.state is ShardedState.GATHERED
        at = 0  # next free byte of the full storage
        if slots:
            for bucket in self.buckets(slots):
                grads = []
                for i in bucket.slots:
                    g = _local_grad(self.params[i])
                    stashed, self.stash[i] = self.stash[i], None
                    if stashed is not None:
                        g = stashed if g is None else stashed.add_(g)
                    if g is None:
                        g = torch.zeros(self.params[i].shape, dtype=self.param_dtype, device=self.device)
                    else:
                        self.got_grad[i] = True
                    grads.append(g)
                staging = None
                if in_full:
                    n = self.s * sum(self.params[i].rows.padded_numel for i in bucket.slots)
                    staging = torch.empty(0, dtype=self.reduce_dtype, device=self.device).set_(
                        self.full_flat.untyped_storage(), at // self.reduce_dtype.itemsize, (self.s, n // self.s))
                    at += n * self.reduce_dtype.itemsize
                res = C.reduce_scatter_grads(grads, self.topo.shard_group, self.s, dtype=self.reduce_dtype,
                                             scale=1.0 / self.dp_size, async_op=True, log=self.log,
                                             kernels=self.kernels, staging=staging)
                if in_full and res.work is not None:
                    self._reading_full.append(res.work)
                pending.append(_PendingReduce(self, bucket, res, in_full))
        for sp in self.params:
            sp.full.grad = None
        return pending

    def stash_grads(self) -> None:
        """Inside an accumulation window with optimizer-state-only sharding: the full gradients (param_dtype)
        move into reduce_dtype accumulators, so that the window sums in reduce_dtype, as the reduce-scatter
        of every micro-batch does otherwise."""
        for i, sp in enumerate(self.params):
            g = _local_grad(sp)
            if g is None:
                continue
            if self.stash[i] is None:
                self.stash[i] = g.to(self.reduce_dtype, copy=True)
            else:
                self.stash[i].add_(g)
            sp.full.grad = None

    def finish_reduce(self, p: _PendingReduce) -> None:
        C.wait(p.result.work, self.log)
        self._accumulate(p.bucket, p.result.output)
        if p.in_full and p.result.work in self._reading_full:
            self._reading_full.remove(p.result.work)
            if not self._reading_full and self.state is ShardedState.SHARDED:
                self.full_flat.untyped_storage().resize_(0)  # the release left it to the last reader

    def _accumulate(self, bucket: _Bucket, out: Tensor) -> None:
        """Adds a bucket's reduced shard gradients to the window's accumulator (to ``late`` once the replica
        all-reduce of the accumulator is in flight: [Note: replica sync overlap])."""
        if self.accum is None:
            if bucket.lo == 0 and bucket.hi == self.shard_flat.numel():
                self.accum = out  # the window's first reduction of the whole unit: its output is the accumulator
                return
            self.accum = torch.zeros(self.shard_flat.numel(), dtype=self.reduce_dtype, device=self.device)
        target = self.accum
        if self.replica_issued:
            if self.late is None:
                self.late = torch.zeros_like(self.accum)
            target = self.late
        if bucket.lo >= 0:
            target[bucket.lo:bucket.hi].add_(out)
        else:
            regions = self._regions(bucket, target)
            torch._foreach_add_(regions, list(out.split([r.numel() for r in regions])))

    def issue_replica_sync(self) -> None:
        """Accumulation boundary: starts the all-reduce of the window's shard gradients across the replica
        group, bucket by bucket, async ([Note: replica sync overlap]); ``finish_replica_sync`` waits."""
        slots = self.trainable()
        if not slots or self.replica_issued:
            return
        self.replica_issued = True
        if self.accum is None:  # no gradient reached this unit in the window on this rank: still take part
            self.accum = torch.zeros(self.shard_flat.numel(), dtype=self.reduce_dtype, device=self.device)
        if self.topo.layout.replicas == 1:
            return
        for bucket in self.buckets(slots):
            self._replica_work.append(self._all_reduce_bucket(bucket, self.accum, async_op=True))

    def _all_reduce_bucket(self, bucket: _Bucket, target: Tensor, async_op: bool
                           ) -> Tuple[Optional[dist.Work], Optional[Tensor], List[Tensor]]:
        if bucket.lo >= 0:
            work = C.all_reduce_sum(target[bucket.lo:bucket.hi], self.topo.replica_group, async_op=async_op,
                                    log=self.log, group_name="replicate")
            return work, None, []
        regions = self._regions(bucket, target)
        buf = torch.cat(regions)
        work = C.all_reduce_sum(buf, self.topo.replica_group, async_op=async_op, log=self.log,
                                group_name="replicate")
        if not async_op:
            torch._foreach_copy_(regions, list(buf.split([r.numel() for r in regions])))
            return None, None, []
        return work, buf, regions

    def finish_replica_sync(self) -> None:
        """Waits for the replica all-reduce (issuing it first if nothing did); a contribution reduced after it
        was issued (``late``) is all-reduced now and added: AR(a) + AR(b) = AR(a + b)."""
        self.issue_replica_sync()
        for work, buf, regions in self._replica_work:
            C.wait(work, self.log)
            if buf is not None:
                torch._foreach_copy_(regions, list(buf.split([r.numel() for r in regions])))
        self._replica_work.clear()
        self.replica_issued = False
        late, self.late = self.late, None
        if late is None:
            return
        if self.topo.layout.replicas > 1:
            for bucket in self.buckets(self.trainable()):
                self._all_reduce_bucket(bucket, late, async_op=False)
        self.accum.add_(late)

    def publish(self, got_any: Tensor) -> None:
        """Adds the synced shard gradients to the DTensor parameters' ``.grad`` (sets it where it is None).
        ``got_any[k]``: did any rank produce a gradient for the k-th trainable parameter in the window."""
        slots = self.trainable()
        for k, i in enumerate(slots):
            if not bool(got_any[k]):
                continue
            sp = self.params[i]
            region = self.accum[sp.offset:sp.offset + sp.rows.padded_numel]
            new = region.view(sp.rows.chunk, *sp.shape[1:])[: sp.rows.local_rows]
            if new.dtype != sp.local.dtype:
                new = new.to(sp.local.dtype)
            if sp.sharded.grad is None:
                sp.sharded.grad = sp.wrap(new)  # a view: the accumulator's memory becomes the gradient's
            else:
                local(sp.sharded.grad).add_(new)
        self.accum = None  # the next window allocates its own (the old one lives on as the gradients)
        self.got_grad.zero_()

    # -- full values (state dicts, restore) ---------------------------------------------------------------
    def gather_rows(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype, dst: Optional[int],
                    scratch: Optional["Scratch"] = None) -> Optional[List[Optional[Tensor]]]:
        """Full tensors from per-parameter local rows (``None``: no such tensor for that parameter).

        Collective over the shard group. ``dst`` = a global rank: only it gets the result (the others hold
        nothing more than their shard); ``dst=None``: every rank gets it. One unit's worth of memory at most;
        ``scratch`` lends the send and receive buffers, so a loop over units and state keys reuses them (and no
        receive buffer waits for gloo's thread to drop its Work before the next one is allocated).
        """
        scratch = scratch or Scratch()
        if all(t is sp.local for sp, t in zip(self.params, locals_)) and dtype == self.dtype:
            flat = self.shard_flat  # the master shard itself is the send buffer (padding rows are zero)
        else:
            flat = scratch.get(self.shard_flat.numel(), dtype, self.device)
            flat.zero_()
            for sp, t in zip(self.params, locals_):
                if t is not None:
                    flat[sp.offset:sp.offset + t.numel()].copy_(t.reshape(-1))
        n = self.s * self.shard_flat.numel()
        if dst is None:
            out = C.all_gather_flat(flat, self.topo.shard_group, self.s,
                                    out=scratch.get(n, dtype, self.device, "recv")).output \
                if self.s > 1 else flat.view(1, -1)
        else:
            recv = scratch.get(n, dtype, self.device, "recv") if dist.get_rank() == dst else None
            out = C.gather_flat(flat, self.topo.shard_group, self.s, dst, out=recv)
            if out is None:
                return None
        fulls = [torch.empty(sp.shape, dtype=dtype, device=self.device) for sp in self.params]
        C.copy_out(out, fulls, self.s, "torch")
        return [f if t is not None else None for f, t in zip(fulls, locals_)]

    def gather_master(self, dst: Optional[int], scratch: Optional["Scratch"] = None) -> Optional[List[Tensor]]:
        """The full parameters in the master dtype (never through param_dtype): bit-exact with the shards."""
        return self.gather_rows([sp.local for sp in self.params], self.dtype, dst, scratch)


def _local_grad(p: Any) -> Optional[Tensor]:
    """The full parameter's gradient as a plain tensor: with tensor parallelism a DTensor in the parameter's
    own placement (redistributed if autograd produced another one, e.g. a pending sum)."""
    g = p.full.grad
    if isinstance(g, DTensor):
        if g.placements != p.full.placements:
            g = g.redistribute(g.device_mesh, p.full.placements)
        return g._local_tensor
    return g


class Scratch:
    """One reusable 1-D buffer per dtype and purpose (``key``: "send" or "recv"), grown to the largest request.

    ``units``: size the buffers for the largest of them at the first request, so a loop over the units never
    regrows one (gloo's thread may still hold the smaller predecessor's Work, and both would be live at once).
    """

    def __init__(self, units: Sequence["Unit"] = ()) -> None:
        self._bufs: Dict[Tuple[torch.dtype, str], Tensor] = {}
        self._least = {"send": max((u.shard_flat.numel() for u in units), default=0),
                       "recv": max((u.s * u.shard_flat.numel() for u in units), default=0)}

    def get(self, n: int, dtype: torch.dtype, device: torch.device, key: str = "send") -> Tensor:
        buf = self._bufs.get((dtype, key))
        if buf is None or buf.numel() < n:
            self._bufs.pop((dtype, key), None)  # the old one goes before the larger one comes
            size = max(n, self._least.get(key, 0))
            buf = self._bufs[(dtype, key)] = torch.empty(size, dtype=dtype, device=device)
        return buf[:n]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward is complete."""

    @staticmethod
    def forward(ctx, hook, *inputs):  # type: ignore[override]
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.hook()
        return (None,) + grads


class MiCSEngine:
    """Shards a module in place and drives the hooks of all its units ([Note: one optimizer step])."""

    def __init__(self, root: nn.Module, topo: Topology, options: MiCSOptions, device: torch.device,
                 keep_for_backward: bool = True) -> None:
        """``options``: resolved (``MiCSOptions.resolved``: dtypes and the gather's hops decided)."""
        self.root, self.topo, self.kernels, self.options = root, topo, options.kernels, options
        shard_units, persistence_threshold = options.shard_units, options.param_persistence_threshold
        bucket_size, param_dtype, reduce_dtype = options.reduce_bucket_size, options.param_dtype, options.reduce_dtype
        kernels, prefetch, max_live_parameters = options.kernels, options.prefetch, options.max_live_parameters
        hierarchical, activation_checkpointing = options.hierarchical_allgather, options.activation_checkpointing
        checkpoint_group_size, activation_offload = options.checkpoint_group_size, options.activation_offload
        reshard_after_forward, optimizer_state_only = options.reshard_after_forward, options.shard_optimizer_state
        self.log = CommLog()
        self.optimizer_state_only = optimizer_state_only
        # [Note: optimizer-state-only sharding]: one unit (the root) holds every parameter
        classes = () if optimizer_state_only else resolve_classes(shard_units, "shard_units")
        groups = plan_groups(root, activation_checkpointing, checkpoint_group_size) \
            if activation_checkpointing else None  # validated before anything changes in the module
        plan = plan_sharding(root, classes, persistence_threshold, topo.layout.shard_size)
        on_meta = has_meta(root)  # before the units replace the parameters with their (allocated) shards
        nodes = topo.node_groups() if hierarchical else None
        self.units = [Unit(up, topo, param_dtype=param_dtype, reduce_dtype=reduce_dtype, bucket_size=bucket_size,
                           kernels=kernels, log=self.log, device=device, nodes=nodes) for up in plan.units]
        for unit in self.units:
            unit.pinned = optimizer_state_only
        self.device = device
        by_param = {id(rp.full): rp for u in self.units for rp in u.replicated}
        order = [by_param[id(p)] for p in self._plain_parameters() if id(p) in by_param]
        # the default group as None, looked up per call: holding it would keep it alive after a lone failure
        # ([Note: a lone failure] in reliability.py); with t > 1 the data-parallel group, which the mesh holds
        dp_group = topo.dp_group if topo.layout.tp_size > 1 else None
        self.reducer = ReplicatedReducer(order, dp_group, topo.layout.dp_size, bucket_size, device, self.log,
                                         group_name="world" if topo.layout.tp_size == 1 else "dp")
        if on_meta:  # [Note: sharded initialization] in materialize.py
            materialize(root, {(id(r.module), r.attr): p for u in self.units for p in (*u.params, *u.replicated)
                               for r in p.refs}, device)
        self.schedule = Schedule(self.units, prefetch, max_live_parameters, keep_for_backward,
                                 reshard_after_forward)
        self.sync_replicas = True  # False inside Lightning's block_backward_sync (not a boundary)
        self._callback_queued = False
        self._pending_reduces: List[_PendingReduce] = []
        self._sync_order = list(reversed(self.units))  # [Note: replica sync overlap]
        self._sync_cursor = 0
        self._handles: List[Any] = []
        for unit, up in zip(self.units, plan.units):
            for module in self._entry_modules(unit, up):
                self._handles.append(module.register_forward_pre_hook(
                    self._make_pre_forward(unit), with_kwargs=True, prepend=True))
                self._handles.append(module.register_forward_hook(
                    self._make_post_forward(unit), with_kwargs=True, always_call=True))
            unit.on_accumulated = self._make_accumulated(unit)
            unit.on_replicated = self._replicated_ready
        # after the units' hooks: its pre-hooks run first ([Note: grouped checkpointing] in activations.py)
        self.activations = ActivationCheckpointing(groups, activation_offload, self.log) if groups else None

    def _entry_modules(self, unit: Unit, plan: UnitPlan) -> List[nn.Module]:
        """Where a unit is entered: its module; for the root also every module holding a root parameter,
        so that the module works wherever user code calls it (hooks, callbacks, ``pl_module.model(x)``)."""
        if unit is not self.units[0]:
            return [unit.module]
        refs = plan.ref_modules
        names = {id(m): n for n, m in self.root.named_modules()}
        paths = [names[id(m)].split(".") if names.get(id(m)) else [] for m in refs]
        common: List[str] = []
        for level in zip(*paths) if paths else []:
            if len(set(level)) != 1:
                break
            common.append(level[0])
        modules = [unit.module, self.root.get_submodule(".".join(common)) if common else self.root, *refs]
        out, seen = [], set()
        for m in modules:
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
        return out

    def _plain_parameters(self) -> List[Tensor]:
        """The full (plain) parameters in the module's registration order."""
        at = {(id(r.module), r.attr): p.full for u in self.units for p in (*u.params, *u.replicated) for r in p.refs}
        out, seen = [], set()
        for module in self.root.modules():
            for name in module._parameters:
                full = at.get((id(module), name))
                if full is not None and id(full) not in seen:
                    seen.add(id(full))
                    out.append(full)
        return out

    # -- parameters as the optimizer sees them ------------------------------------------------------------
    def sharded_params(self) -> List[nn.Parameter]:
        return [p.sharded for u in self.units for p in (*u.params, *u.replicated)]

    @property
    def replicated(self) -> List[ReplicatedParam]:
        return [rp for u in self.units for rp in u.replicated]

    # -- hooks ----------------------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
            if in_backward():  # recomputation inside backward (activation checkpointing): gather if released
                if not unit.is_live:
                    self.schedule.make_room(unit)
                unit.finish_gather()
                return args, kwargs
            unit.depth += 1
            if unit.depth > 1:
                return args, kwargs
            if unit is self.units[0]:
                self._begin_iteration()
            self.schedule.on_forward(unit)
            unit.finish_gather()
            unit.training_state = TrainingState.FORWARD
            if not torch.is_grad_enabled():
                return args, kwargs
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
            if idx:
                unit.pending_post_backward += 1
                unit.registered_post_backward += 1
                outs = _PostBackward.apply(lambda: self._post_backward(unit), *(flat[i] for i in idx))
                for i, t in zip(idx, outs):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
            return args, kwargs
        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Tuple, kwargs: Dict, output: Any) -> Any:
            if in_backward():
                return output
            unit.depth = max(unit.depth - 1, 0)
            if unit.depth > 0:
                return output
            unit.training_state = TrainingState.IDLE
            grad = torch.is_grad_enabled()
            if not (grad and self.schedule.keep_after_forward(unit)):
                unit.release()
            if unit is self.units[0] and not grad:
                self.quiesce(pinned=False)  # evaluation: no backward follows, nothing prefetched may linger
            if grad and output is not None:
                flat, _ = tree_flatten(output)
                for t in flat:
                    if isinstance(t, Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
            return output
        return hook

    def _make_pre_backward(self, unit: Unit):
        def hook(grad: Tensor) -> Tensor:
            self._queue_end_of_backward()
            if unit.training_state is not TrainingState.PRE_BACKWARD:
                unit.training_state = TrainingState.PRE_BACKWARD
                self.schedule.on_backward(unit)
            unit.finish_gather()
            unit.needs_reduce = True
            return grad
        return hook

    def _make_accumulated(self, unit: Unit):
        def hook(param: Tensor) -> None:
            self._queue_end_of_backward()
            unit.needs_reduce = True
            unit.accumulated += 1
            # A unit whose inputs needed no gradient has no post-backward. Once the gradient of *every* sharded
            # parameter is in, every op that uses one has run its backward (an op computes its weight's and its
            # input's gradients in one node), so the unit can go. With a frozen sharded parameter an op of the
            # unit may still need it: then the end-of-backward callback reduces and releases.
            if (unit.registered_post_backward == 0 and unit.accumulated == len(unit.params)
                    and unit.depth == 0 and unit.state is ShardedState.GATHERED and self._reduce_now()):
                self._reduce(unit)
                self._release_after_backward(unit)
                unit.training_state = TrainingState.POST_BACKWARD
        return hook

    def _replicated_ready(self, rp: ReplicatedParam) -> None:
        self._queue_end_of_backward()
        if self.sync_replicas:
            self.reducer.on_ready(rp)

    def _post_backward(self, unit: Unit) -> None:
        unit.pending_post_backward -= 1
        if unit.pending_post_backward > 0:
            return
        if unit.needs_reduce and self._reduce_now():
            self._reduce(unit)
        self._release_after_backward(unit)
        unit.training_state = TrainingState.POST_BACKWARD

    def _releases_after_backward(self, unit: Unit) -> bool:
        if unit.depth > 0 or unit.pinned:  # backward inside the unit's own forward (manual optimization)
            return False
        # [Note: keep for backward]: the next micro-batch of this window needs the root first
        return not (unit is self.units[0] and not self.sync_replicas and self.schedule.keep_for_backward)

    def _release_after_backward(self, unit: Unit) -> None:
        if self._releases_after_backward(unit):
            unit.release()

    def _reduce_now(self) -> bool:
        """Reduce-scatter every micro-batch, except with optimizer-state-only sharding: there the full
        gradients accumulate locally and are reduce-scattered once, at the accumulation boundary."""
        return self.sync_replicas or not self.optimizer_state_only

    def _reduce(self, unit: Unit) -> None:
        self._pending_reduces.extend(unit.issue_reduce(releasing=self._releases_after_backward(unit)))
        while len(self._pending_reduces) > 1:  # one reduce-scatter in flight while the next one is built
            p = self._pending_reduces.pop(0)
            p.unit.finish_reduce(p)
        self._advance_replica_sync()

    def _drain_reduces(self) -> None:
        while self._pending_reduces:
            p = self._pending_reduces.pop(0)
            p.unit.finish_reduce(p)
        self._advance_replica_sync()

    def _advance_replica_sync(self) -> None:
        """[Note: replica sync overlap]: in the boundary micro-batch, issues the replica all-reduce of each unit
        whose gradients are complete, in the fixed order ``reversed(units)``, as far as that order allows."""
        if not self.sync_replicas:
            return
        order = self._sync_order
        while self._sync_cursor < len(order):
            unit = order[self._sync_cursor]
            done = (unit.training_state is TrainingState.POST_BACKWARD and not unit.needs_reduce
                    and all(p.unit is not unit for p in self._pending_reduces))
            if not done:
                return
            unit.issue_replica_sync()
            self._sync_cursor += 1

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for unit in reversed(self.units):  # same order on every rank
            if unit.needs_reduce and self._reduce_now():
                self._reduce(unit)
            elif unit.needs_reduce and unit.param_dtype != unit.reduce_dtype:
                unit.stash_grads()  # [Note: optimizer-state-only sharding]: the window sums in reduce_dtype
            self._release_after_backward(unit)
            unit.pending_post_backward = unit.registered_post_backward = unit.accumulated = 0
            unit.training_state = TrainingState.IDLE
        self._drain_reduces()
        self.schedule.end_backward()
        if self.sync_replicas:
            self.sync()

    def _begin_iteration(self) -> None:
        """The root is entered from outside any forward: forget what a forward without backward left."""
        for unit in self.units:
            if unit.depth == 0 and unit is not self.units[0]:
                unit.release()
            unit.pending_post_backward = unit.registered_post_backward = unit.accumulated = 0
        self.schedule.begin_iteration()

    def quiesce(self, pinned: bool = True) -> None:
        """Releases every unit that is not running (waiting for its prefetch): before a state dict or a save,
        so the modules hold their DTensor masters, and after a pass without grad, so no gather lingers
        (``pinned=False``: pinned units stay, as between training steps)."""
        for unit in self.units:
            if not unit.in_use:
                unit.release(force=pinned)

    def after_optimizer_step(self) -> None:
        """Post-step hook of every optimizer: units still in use get the new values; idle ones are released."""
        for unit in self.units:
            if unit.state is ShardedState.GATHERED and (unit.depth > 0 or unit.pinned):
                unit.refresh()
            else:
                unit.release()

    # -- accumulation boundary ------------------------------------------------------------------------------
    def sync(self) -> None:
        """MiCS 2-hop sync: replica all-reduce of shard gradients, world all-reduce of replicated ones
        ([Note: replicated gradients] in replicated.py, whose last bucket carries the sharded parameters'
        flags: did any rank get a gradient?, so that a parameter no rank used keeps ``grad=None``)."""
        for unit in self._sync_order:  # what the backward did not issue, in the same fixed order
            unit.issue_replica_sync()
        for unit in self._sync_order:
            unit.finish_replica_sync()
        self._sync_cursor = 0
        flags = [u.got_grad[list(u.trainable())] for u in self.units]
        got = self.reducer.finish(torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool))
        start = 0
        for unit in self.units:
            n = len(unit.trainable())
            unit.publish(got[start:start + n])
            start += n

    # -- whole-model views ----------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, dst: Optional[int] = 0) -> Dict[str, Tensor]:
        """The module's own state dict with full CPU tensors in the master dtype, gathered unit by unit onto
        global rank ``dst`` ({} elsewhere); ``dst=None``: on every rank. Collective."""
        self.quiesce()
        rank = dist.get_rank()
        keep = dst is None or rank == dst
        tp = self.topo.layout.tp_size > 1  # every rank takes part: tensor-parallel parts are gathered too
        full: Dict[int, Tensor] = {}
        scratch = Scratch(self.units)
        for unit in self.units:
            if not tp and dst is not None and rank not in self.topo.layout.shard_group_of(dst):
                continue  # only dst's shard group takes part
            values = unit.gather_master(None if tp else dst, scratch) if unit.params else []
            if values is not None:
                for sp, v in zip(unit.params, values):
                    v = as_dtensor(v, sp.tp_spec).full_tensor() if sp.tp_spec is not None else v
                    if keep:
                        full[id(sp.sharded)] = full[id(sp.full)] = v.cpu()
            for rp in unit.replicated:
                v = as_dtensor(rp.local, rp.tp_spec).full_tensor() if rp.tp_spec is not None else rp.local
                if keep:
                    full[id(rp.sharded)] = full[id(rp.full)] = v.detach().cpu().clone()
        if not keep:
            return {}
        out = {}
        for name, t in self.root.state_dict(keep_vars=True).items():
            v = full.get(id(t))
            out[name] = v if v is not None else local(t).detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Dict[str, Tensor], strict: bool = True) -> None:
        """Copies this rank's rows of every full tensor into its shard; replicated ones and buffers whole."""
        by_id = {}
        for u in self.units:
            for p in (*u.params, *u.replicated):
                by_id[id(p.sharded)] = by_id[id(p.full)] = p
        own = self.root.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the module: missing {missing}, unexpected {unexpected}")
        for name, t in own.items():
            if name not in state:
                continue
            src = state[name].to(self.device)
            slot = by_id.get(id(t))
            if slot is not None:
                slot.copy_from_global(src)
            else:
                local(t).copy_(src)

    def restore_module(self) -> Dict[int, nn.Parameter]:
        """Removes the hooks and puts full, plain parameters (master dtype) back into the modules, unit by
        unit. Collective. Returns ``{id(DTensor parameter): plain parameter}`` for re-pointing optimizers."""
        self.remove_hooks()
        mapping: Dict[int, nn.Parameter] = {}
        scratch = Scratch(self.units)
        with torch.no_grad():
            for unit in self.units:
                unit.release(force=True)
                values = unit.gather_master(None, scratch) if unit.params else []
                for sp, v in zip(unit.params, values):
                    p = nn.Parameter(v, requires_grad=sp.requires_grad)
                    mapping[id(sp.sharded)] = p
                    for ref in sp.refs:
                        ref.module._parameters[ref.attr] = p
                for rp in unit.replicated:
                    p = nn.Parameter(rp.local, requires_grad=rp.requires_grad)
                    mapping[id(rp.sharded)] = p
                    for ref in rp.refs:
                        ref.module._parameters[ref.attr] = p
        return mapping

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.activations is not None:
            self.activations.remove()
        for unit in self.units:
            unit.on_accumulated = unit.on_replicated = None  # (they close over the engine: no cycle left)
            for h in unit.hook_handles.values():
                h.remove()
            unit.hook_handles.clear()

    def reset(self) -> None:
        """After an exception: every unit back to SHARDED locally, no collective (peers may be gone)."""
        self._pending_reduces.clear()
        self._sync_cursor = 0
        self._callback_queued = False
        self.reducer.reset()
        for unit in self.units:
            unit.drop()
        for rp in self.replicated:
            rp.full.grad = None

    # -- accounting ---------------------------------------------------------------------------------------
    def model_state_bytes(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (no transient buffers),
        counted from storages: each storage once, whatever views alias it."""
        seen: set = set()

        def nbytes(t: Optional[Tensor]) -> int:
            if t is None:
                return 0
            t = local(t)
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key in seen or st.nbytes() == 0:
                return 0
            seen.add(key)
            return st.nbytes()

        params = sum(nbytes(u.shard_flat) for u in self.units) + sum(nbytes(rp.local) for rp in self.replicated)
        params += sum(nbytes(u.full_flat) for u in self.units if u.pinned)  # whole on every rank, kept
        grads = 0
        for u in self.units:
            grads += nbytes(u.accum)
            grads += sum(nbytes(p.sharded.grad) for p in (*u.params, *u.replicated))
            grads += sum(nbytes(rp.full.grad) for rp in u.replicated)
        opt = 0
        for o in optimizers:
            for st in o.state.values():
                opt += sum(nbytes(v) for v in st.values() if isinstance(v, Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
