"""A gradient's path, from the post-backward of a unit to ``.grad`` of the optimizer's shard: buckets,
reduce-scatter issue and finish, the window's accumulator, the replica all-reduce at the boundary, publishing.

[Note: optimizer-state-only sharding]
``shard_optimizer_state=True`` with s = 1 (SageMaker's optimizer state sharding, ZeRO stage 1) is the same machinery
with the placement spread over the whole data-parallel group: the layout's shard group is all W ranks, and one unit (the
root) owns every parameter and is *pinned*: gathered at setup (``MiCSEngine.pin``) and kept, so parameters and gradients
stay whole on every rank and no forward or backward gathers anything. Its full gradients accumulate locally over the
micro-batches of a window (moved into reduce_dtype accumulators at the end of each backward when param_dtype is lower,
so bf16 gradients are summed in fp32 as the per-micro-batch reduce-scatter sums them otherwise); at the boundary they
are reduce-scattered once over the W ranks, each rank's optimizer steps its 1/W rows (the DTensor shards, with 1/W of
the optimizer state), and the post-step hook's refresh is the one all-gather that makes the parameters whole again. A
save or a state dict keeps it pinned and takes what user code wrote first ([Note: writes between steps] in user_code/write_back.py); a
load releases it and the front end gathers it again from the loaded masters; only the end of a run unpins it.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics.comm import collectives
from lightning_mics.comm import quantized
from lightning_mics.layout.placement import ReplicatedParam, local, local_grad
from lightning_mics.engine.replicated import ReplicatedReducer
from lightning_mics.engine.unit import ShardedState, TrainingState, Unit


class _Bucket(NamedTuple):
    slots: Tuple[int, ...]  # indices into Unit.params
    lo: int  # region of the flat shard when the slots are consecutive, else -1
    hi: int


class _PendingReduce(NamedTuple):
    grads: "UnitGrads"
    bucket: _Bucket
    result: collectives.ReduceScatterResult  # its input may lie in the unit's full storage ([Note: staging in place])


class UnitGrads:
    """One unit's gradients: its buckets, this window's accumulator (and ZeRO-1's local one), which parameters got one. It
    reads the unit's layout and writes only the full parameters' ``.grad`` and the DTensors' ``.grad``."""

    def __init__(self, unit: Unit, bucket_size: int, quantize: Optional[quantized.QuantizeSpec] = None,
                 apart: bool = False) -> None:
        self.unit, self.params, self.topo, self.log = unit, unit.params, unit.topo, unit.log
        self.quantize = quantize or quantized.QuantizeSpec()  # [Note: quantized replica sync]
        self._residuals: Dict[Tuple[int, ...], quantized.Residual] = {}  # error feedback, per bucket
        self.s, self.kernels, self.device = unit.s, unit.kernels, unit.device
        self.param_dtype, self.reduce_dtype = unit.param_dtype, unit.reduce_dtype
        self.shard_numel = unit.shard_flat.numel()
        # gradients average over the data-parallel ranks (W / t); replica groups ``apart`` (DiLoCo): over the s ranks
        self.dp_size, self.replicas = (unit.s, 1) if apart else (unit.topo.layout.dp_size, unit.topo.layout.replicas)
        self.bucket_size = bucket_size
        self.needs_reduce = False
        self.accum: Optional[Tensor] = None  # this window's reduced shard gradients (reduce_dtype), lazily
        self.replica_issued = False  # the accumulator's all-reduce is in flight ([Note: replica sync overlap])
        self.accum_after_issue: Optional[Tensor] = None  # reductions finished after that issue go here
        self.rows = unit.optimizer_rows  # [Note: optimizer rows over replicas] in optimizer_rows.py
        self.reduced: Optional[Tensor] = None  # with them: this replica's rows of the synced gradients
        self._replica_work: List[Tuple[Optional[dist.Work], Optional[Tensor], List[Tensor]]] = []
        self.local_accum: List[Optional[Tensor]] = [None] * len(self.params)  # [Note: optimizer-state-only sharding]
        self.got_grad = torch.zeros(len(self.params), dtype=torch.bool)
        self._buckets: Dict[Tuple[int, ...], List[_Bucket]] = {}

    def trainable(self) -> Tuple[int, ...]:
        return self.unit.trainable()

    def drop(self, keep_feedback: bool = False) -> None:
        """Local reset after a failure: no collective, no wait (a peer may be gone)."""
        self.needs_reduce = self.replica_issued = False
        self.accum = self.accum_after_issue = self.reduced = None
        collectives.abandon(*(work for work, _, _ in self._replica_work))  # [Note: chained collectives] in collectives.py
        self._replica_work.clear()
        if not keep_feedback:  # a failed step may have left a residual half-used
            self._residuals.clear()
            if self.rows is not None:
                self.rows.residual = None
        self.local_accum = [None] * len(self.params)
        self.got_grad.zero_()

    # -- gradients --------------------------------------------------------------------------------------
    def buckets(self, slots: Tuple[int, ...]) -> List[_Bucket]:
        """Runs of ``slots`` of at most ``bucket_size`` full elements (at least one parameter each)."""
        cached = self._buckets.get(slots)
        if cached is not None:
            return cached
        runs = collectives.bucket_runs([math.prod(self.params[i].shape) for i in slots], self.bucket_size)
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
        the unit is released right after, so its full storage can hold the input ([Note: staging in place] in
        full_storage.py)."""
        self.needs_reduce = False
        slots = self.trainable()
        pending: List[_PendingReduce] = []
        in_full = releasing and self.unit.storage.stages and self.unit.state is ShardedState.GATHERED
        at = 0  # next free element (of reduce_dtype) of the full storage
        if slots:
            for bucket in self.buckets(slots):
                grads = []
                for i in bucket.slots:
                    g = local_grad(self.params[i])
                    local, self.local_accum[i] = self.local_accum[i], None
                    if local is not None:
                        g = local if g is None else local.add_(g)
                    if g is None:
                        g = torch.zeros(self.params[i].shape, dtype=self.param_dtype, device=self.device)
                    else:
                        self.got_grad[i] = True
                    grads.append(g)
                staging = None
                if in_full:
                    n = self.s * sum(self.params[i].rows.padded_numel for i in bucket.slots)
                    staging = self.unit.storage.staging(at, self.s, n // self.s)
                    at += n
                res = collectives.reduce_scatter_grads(grads, self.topo.shard_group, self.s, dtype=self.reduce_dtype,
                                             scale=1.0 / self.dp_size, async_op=True, log=self.log,
                                             kernels=self.kernels, staging=staging)
                if in_full:
                    self.unit.storage.reading(res.work)
                pending.append(_PendingReduce(self, bucket, res))
        for sp in self.params:
            sp.full.grad = None
        return pending

    def accumulate_locally(self) -> None:
        """Inside an accumulation window with optimizer-state-only sharding: the full gradients (param_dtype)
        move into reduce_dtype accumulators, so that the window sums in reduce_dtype, as the reduce-scatter
        of every micro-batch does otherwise."""
        for i, sp in enumerate(self.params):
            g = local_grad(sp)
            if g is None:
                continue
            if self.local_accum[i] is None:
                self.local_accum[i] = g.to(self.reduce_dtype, copy=True)
            else:
                self.local_accum[i].add_(g)
            sp.full.grad = None

    def finish_reduce(self, p: _PendingReduce) -> None:
        collectives.wait(p.result.work, self.log)
        self._accumulate(p.bucket, p.result.output)
        self.unit.storage.done_reading(p.result.work)  # [Note: staging in place]: the last reader frees it

    def _accumulate(self, bucket: _Bucket, out: Tensor) -> None:
        """Adds a bucket's reduced shard gradients to the window's accumulator (to ``accum_after_issue`` once the replica
        all-reduce of the accumulator is in flight: [Note: replica sync overlap])."""
        if self.accum is None:
            if bucket.lo == 0 and bucket.hi == self.shard_numel:
                self.accum = out  # the window's first reduction of the whole unit: its output is the accumulator
                return
            self.accum = torch.zeros(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        target = self.accum
        if self.replica_issued:
            if self.accum_after_issue is None:
                self.accum_after_issue = torch.zeros_like(self.accum)
            target = self.accum_after_issue
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
            self.accum = torch.zeros(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        if self.replicas == 1:
            return
        if self.rows is not None:  # the all-reduce's first half: the rows this replica steps
            res = self.rows.reduce_scatter(self.accum, async_op=True)
            self.reduced = res.output
            self._replica_work.append((res.work, None, []))
            return
        for bucket in self.buckets(slots):
            self._replica_work.append(self._all_reduce_bucket(bucket, self.accum, async_op=True))

    def _all_reduce_bucket(self, bucket: _Bucket, target: Tensor, async_op: bool
                           ) -> Tuple[Optional[dist.Work], Optional[Tensor], List[Tensor]]:
        if bucket.lo >= 0:
            work = self._replica_all_reduce(target[bucket.lo:bucket.hi], bucket, async_op)
            return work, None, []
        regions = self._regions(bucket, target)
        buf = torch.cat(regions)
        work = self._replica_all_reduce(buf, bucket, async_op)
        if not async_op:
            torch._foreach_copy_(regions, list(buf.split([r.numel() for r in regions])))
            return None, None, []
        return work, buf, regions

    def _replica_all_reduce(self, flat: Tensor, bucket: _Bucket, async_op: bool) -> Any:
        """In-place sum over the replica group: an all-reduce in reduce_dtype, or int8 blocks with
        ``quantize_gradients`` ([Note: quantized replica sync]). Returns the Work (``collectives.wait`` takes both)."""
        group, B = self.topo.replica_group, self.quantize.block_size
        if not self.quantize.gradients:
            return collectives.all_reduce_sum(flat, group, async_op=async_op, log=self.log, group_name="replicate")
        residual = None
        if self.quantize.gradients == "error_feedback":
            residual = self._residuals.get(bucket.slots)
            if residual is None:
                residual = self._residuals[bucket.slots] = quantized.feedback_buffers(
                    flat.numel(), self.topo.layout.replicas, B, flat.dtype, flat.device)
        res = quantized.quantized_all_reduce(flat, group, B, residual=residual, async_op=async_op, log=self.log,
                                     group_name="replicate", kernels=self.kernels)
        return res if async_op else None

    def start_replica_gathers(self) -> None:
        """Int8 replica all-reduces not advanced yet wait for their all-to-all and issue their all-gather."""
        for work in (w for w, _, _ in self._replica_work if isinstance(w, quantized.QuantizedReduce)):
            work.advance()  # one advanced already (at its issue, on NCCL) does nothing

    def residuals(self) -> List[Tensor]:
        """The error-feedback state this rank keeps (model-state accounting)."""
        return [t for res in self.residual_state().values() for t in res]

    def residual_state(self) -> Dict[Tuple[int, ...], quantized.Residual]:
        """This rank's error-feedback residuals by bucket ([Note: residuals in checkpoints] in checkpoint/feedback.py);
        the optimizer rows' one under all the unit's parameters ([Note: quantized optimizer rows])."""
        if self.rows is not None:
            return {tuple(range(len(self.params))): self.rows.residual} if self.rows.residual is not None else {}
        return dict(self._residuals)

    def residual_numel(self, slots: Tuple[int, ...]) -> int:
        """Elements of the contribution half of the residual of ``slots``' bucket (of the optimizer rows)."""
        return self.rows.residual_numel() if self.rows is not None else \
            sum(self.params[k].rows.padded_numel for k in slots)

    def restore_residuals(self, state: Dict[Tuple[int, ...], quantized.Residual]) -> None:
        """Takes ``state`` (``residual_state`` of a run with this layout, checked by the caller) as this rank's."""
        if self.rows is not None:
            self.rows.residual = state.get(tuple(range(len(self.params))))
        else:
            self._residuals = dict(state)

    def finish_replica_sync(self) -> None:
        """Waits for the replica all-reduce (issuing it first if nothing did); a contribution reduced after it
        was issued (``accum_after_issue``) is all-reduced now and added: AR(a) + AR(b) = AR(a + b)."""
        self.issue_replica_sync()
        for work, buf, regions in self._replica_work:
            collectives.wait(work, self.log)
            if buf is not None:
                torch._foreach_copy_(regions, list(buf.split([r.numel() for r in regions])))
        self._replica_work.clear()
        self.replica_issued = False
        after, self.accum_after_issue = self.accum_after_issue, None
        if after is None:
            return
        if self.rows is not None:
            self.reduced.add_(self.rows.reduce_scatter(after, async_op=False).output)
            return
        if self.replicas > 1:
            for bucket in self.buckets(self.trainable()):
                self._all_reduce_bucket(bucket, after, async_op=False)
        self.accum.add_(after)

    def publish(self, got_any: Tensor) -> None:
        """Adds the synced shard gradients to the DTensor parameters' ``.grad`` (sets it where it is None).
        ``got_any[k]``: did any rank produce a gradient for the k-th trainable parameter in the window."""
        slots = self.trainable()
        for k, i in enumerate(slots):
            if not bool(got_any[k]):
                continue
            sp = self.params[i]
            if self.rows is not None:
                new = self.rows.rows_of(self.reduced, i)
            else:
                region = self.accum[sp.offset:sp.offset + sp.rows.padded_numel]
                new = region.view(sp.rows.chunk, *sp.shape[1:])[: sp.rows.local_rows]
            if new.dtype != sp.local.dtype:
                new = new.to(sp.local.dtype)
            if sp.sharded.grad is None:
                sp.sharded.grad = sp.wrap(new)  # a view: the accumulator's memory becomes the gradient's
            else:
                local(sp.sharded.grad).add_(new)
        self.accum = self.reduced = None  # the next window allocates its own (the old one lives on as the gradients)
        self.got_grad.zero_()


# [Note: replica sync overlap]
# In the boundary micro-batch a unit's replica all-reduce starts as soon as its last reduce-scatter of the backward
# has finished, while the backward of the units before it still runs (as DDP and FSDP2's HSDP do per bucket); the
# end of backward waits for all of them before the optimizer step. Collectives on one group must be issued in the
# same order on every rank, whatever the timing: the all-reduces go in the fixed order ``reversed(units)`` (the
# usual backward order), a unit only after every unit before it, and what the backward did not issue goes at the
# end in the same order. A
# reduce-scatter otherwise stays in flight through the next unit's backward, but the first unit's is finished at
# once and its all-reduce issued, so the replica link does not wait (``_link_waits_for``): the program alone decides
# the moment of an issue, never whether a collective has completed. A unit reduced again after its all-reduce was
# issued (a gradient accumulated after its post-backward) adds the late part to a second buffer all-reduced at the
# end: AR(a) + AR(b) = AR(a + b). The world all-reduce of the used-flags (the replicated parameters' last bucket)
# is issued at the end of backward before anything is waited for, so its round trip over the slow link overlaps
# the replica all-reduces' transfer instead of following it.
#
# [Note: quantized replica sync]
# With ``quantize_gradients`` each bucket's replica all-reduce is two collectives on the replica group with local
# work between them ([Note: quantized all-reduce] in quantized.py): an all-to-all of int8 chunks, then, after the
# fp32 sum and requantization, an all-gather. The all-to-all goes when the unit's all-reduce is issued; its
# all-gather at once on NCCL (from a side stream: [Note: chained collectives] in collectives.py), else (the host
# waits) when the next unit's is or at the end of backward, so both overlap the backward that remains, and
# every rank issues one sequence on the group: all-to-all(u0), all-gather(u0), all-to-all(u1), ... . A late part
# is reduced the same way (two quantizations, each within its bound). ``"error_feedback"`` keeps one residual per
# bucket (``UnitGrads._residuals``, in the accumulator's dtype), dropped after a failure; a sharded checkpoint
# carries them ([Note: residuals in checkpoints] in checkpoint/feedback.py).
class GradientPath:
    """The gradient path of every unit: the reduce queue, the replica all-reduce's order, the 2-hop sync at the
    boundary, and the replicated parameters' reducer ([Note: replicated gradients] in replicated.py)."""

    def __init__(self, units: List[Unit], reducer: ReplicatedReducer, bucket_size: int,
                 optimizer_state_only: bool, quantize: Optional[quantized.QuantizeSpec] = None,
                 apart: bool = False) -> None:
        """``apart``: the replica groups train apart ([Note: DiLoCo across replica groups] in options.py)."""
        self.all = [UnitGrads(u, bucket_size, quantize, apart) for u in units]
        self._of = {id(g.unit): g for g in self.all}
        self.reducer = reducer
        self.optimizer_state_only = optimizer_state_only
        self.sync_replicas = True  # False inside Lightning's block_backward_sync (not a boundary)
        self._pending_reduces: List[_PendingReduce] = []
        self._sync_order = list(reversed(self.all))  # [Note: replica sync overlap]
        self._sync_cursor = 0

    def of(self, unit: Unit) -> UnitGrads:
        return self._of[id(unit)]

    def mark(self, unit: Unit) -> None:
        """A gradient reached the unit in this backward."""
        self.of(unit).needs_reduce = True

    def needs_reduce(self, unit: Unit) -> bool:
        return self.of(unit).needs_reduce

    def replicated_ready(self, rp: ReplicatedParam) -> None:
        if self.sync_replicas:
            self.reducer.on_ready(rp)

    def reduce_now(self) -> bool:
        """Reduce-scatter every micro-batch, except with optimizer-state-only sharding: there the full
        gradients accumulate locally and are reduce-scattered once, at the accumulation boundary."""
        return self.sync_replicas or not self.optimizer_state_only

    def reduce(self, unit: Unit, releasing: bool) -> None:
        """The unit's gradients are complete: reduce-scatter them (``releasing``: the unit is released right
        after, [Note: staging in place])."""
        g = self.of(unit)
        self._pending_reduces.extend(g.issue_reduce(releasing=releasing))
        # one reduce-scatter in flight while the next one is built, unless the replica link would idle waiting
        # for this one ([Note: replica sync overlap])
        in_flight = 0 if self._link_waits_for(g) else 1
        while len(self._pending_reduces) > in_flight:
            p = self._pending_reduces.pop(0)
            p.grads.finish_reduce(p)
        self._advance_replica_sync()

    def end_of_backward(self, unit: Unit, releasing: bool) -> None:
        """The end-of-backward callback, unit by unit in reverse: what is left is reduced (or local)."""
        g = self.of(unit)
        if g.needs_reduce and self.reduce_now():
            self.reduce(unit, releasing)
        elif g.needs_reduce and g.param_dtype != g.reduce_dtype:
            g.accumulate_locally()  # [Note: optimizer-state-only sharding]: the window sums in reduce_dtype

    def drain(self) -> None:
        while self._pending_reduces:
            p = self._pending_reduces.pop(0)
            p.grads.finish_reduce(p)
        self._advance_replica_sync()

    def _link_waits_for(self, g: UnitGrads) -> bool:
        """In the boundary micro-batch: ``g``'s replica all-reduce is the first of the backward, so nothing
        crosses the replica link until ``g``'s reduce-scatter is finished. Only the first: whether an earlier
        all-reduce has completed is timing, and the moment of an issue must not depend on it (two engines may
        share the replica group: every rank must interleave their collectives alike)."""
        if not self.sync_replicas or self._sync_cursor != 0 or g.replica_issued or self._sync_order[0] is not g:
            return False
        return g.unit.training_state is TrainingState.POST_BACKWARD  # (else the end of backward: ``sync`` issues it)

    def _advance_replica_sync(self) -> None:
        """[Note: replica sync overlap]: in the boundary micro-batch, issues the replica all-reduce of each unit
        whose gradients are complete, in the fixed order ``reversed(units)``, as far as that order allows."""
        if not self.sync_replicas:
            return
        order = self._sync_order
        while self._sync_cursor < len(order):
            g = order[self._sync_cursor]
            done = (g.unit.training_state is TrainingState.POST_BACKWARD and not g.needs_reduce
                    and all(p.grads is not g for p in self._pending_reduces))
            if not done:
                return
            self._issue_next_replica_sync()

    def _issue_next_replica_sync(self) -> None:
        """The next unit's replica all-reduce in ``_sync_order``; int8 ones already issued first start their
        all-gather, so the sequence on the replica group is the same on every rank
        ([Note: quantized replica sync])."""
        for g in self._sync_order[:self._sync_cursor]:
            g.start_replica_gathers()
        self._sync_order[self._sync_cursor].issue_replica_sync()
        self._sync_cursor += 1

    # -- accumulation boundary ------------------------------------------------------------------------------
    def sync(self) -> None:
        """MiCS 2-hop sync: replica all-reduce of shard gradients, world all-reduce of replicated ones
        ([Note: replicated gradients] in replicated.py, whose last bucket carries the sharded parameters'
        flags: did any rank get a gradient?, so that a parameter no rank used keeps ``grad=None``)."""
        while self._sync_cursor < len(self._sync_order):  # what the backward did not issue, in the same order
            self._issue_next_replica_sync()
        flags = [g.got_grad[list(g.trainable())] for g in self.all]  # final: every reduction of the window is in
        self.reducer.launch_rest(torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool))
        for g in self._sync_order:
            g.finish_replica_sync()
        self._sync_cursor = 0
        got = self.reducer.finish()
        start = 0
        for g in self.all:
            n = len(g.trainable())
            g.publish(got[start:start + n])
            start += n

    def reset(self, keep_feedback: bool = False) -> None:
        """After an exception: nothing pending, every unit's gradient state dropped (no collective).
        ``keep_feedback``: the error-feedback residuals stay (the last step completed: they are whole)."""
        self._pending_reduces.clear()
        self._sync_cursor = 0
        self.reducer.reset()
        for g in self.all:
            g.drop(keep_feedback)
