"""One unit: its memory (the flat shard and the full parameters), its gather/release state machine, swapping its
parameters into the modules, and its own training state (as FSDP2's ``FSDPParamGroup``).
"""

from __future__ import annotations

import enum
import inspect
import math
import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

import torch
from torch import Tensor

from lightning_mics.comm import collectives
from lightning_mics.comm import quantized
from lightning_mics.engine.full_storage import FullStorage
from lightning_mics.engine.optimizer_rows import OptimizerRows
from lightning_mics.layout.placement import ReplicatedParam, Rows, ShardedParam, local
from lightning_mics.layout.sharding import UnitPlan
from lightning_mics.comm.telemetry import CommLog
from lightning_mics.layout.topology import Topology

AnyParam = Union[ShardedParam, ReplicatedParam]


class Lending(Protocol):
    """What a unit tells the user-code boundary of its own transitions (user_code/boundary.py)."""

    def filled(self, unit: "Unit") -> None: ...  # its plain parameters were just filled from the masters

    def releasing(self, unit: "Unit", stale: bool) -> None: ...  # it goes back to its shard (``stale``: after a step)

    def dropped(self, unit: "Unit") -> None: ...  # reset after a failure, no collective


def _weak_hook(fn: Callable, arg: Any = None) -> Callable[[Tensor], None]:
    """A post-accumulate-grad hook that calls ``fn(tensor)`` (or ``fn(arg)``) through weak references. Autograd
    keeps a tensor's hooks from C++, where Python's gc cannot see them: a hook holding its unit (and through it
    the hooks, the engine and the module) would keep all of them alive to the end of the process
    ([Note: engines beside their modules] in frontends/shared.py). The unit holds ``fn``, and the module's hooks hold
    the unit."""
    fn_ref = weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn)
    arg_ref = None if arg is None else weakref.ref(arg)

    def hook(t: Tensor) -> None:
        f, a = fn_ref(), t if arg_ref is None else arg_ref()
        if f is not None and a is not None:
            f(a)
    return hook


# [Note: unit lifecycle]
# ``ShardedState``: SHARDED -> GATHERING (all-gather issued) -> GATHERED (copied out, full parameters in the
# modules) -> SHARDED. ``TrainingState``: IDLE -> FORWARD -> (IDLE) -> PRE_BACKWARD -> POST_BACKWARD -> IDLE.
# ``depth`` counts nested forward calls into the unit; only the outermost one gathers, hooks the backward and
# releases. Whether autograd is running comes from autograd itself (``_current_graph_task_id``): a forward that
# runs inside backward (activation checkpointing's recomputation) finds its unit gathered by the pre-backward
# hook and neither counts nor releases. Manual optimization runs backward and ``optimizer.step`` inside the
# root's forward: the end-of-backward callback reduces the root without releasing it (depth > 0), and the
# post-step hook refreshes it. Which unit is gathered, kept or released when is decided in schedule.py; the
# unit only carries the transitions out.
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


class Unit:
    """One gather/release unit: its flat shard, full parameters, replicated parameters and training state."""

    def __init__(self, plan: UnitPlan, topo: Topology, *, param_dtype: Optional[torch.dtype],
                 reduce_dtype: torch.dtype, kernels: str, log: CommLog, device: torch.device,
                 nodes: Optional[collectives.NodeGroups] = None, pinned: bool = False,
                 quantize: Optional[quantized.QuantizeSpec] = None, optimizer_over_replicas: bool = False
                 ) -> None:
        self.path = plan.path or "<root>"
        self.quantize = quantize or quantized.QuantizeSpec()  # quantize_allgather: the two-hop gather's first hop in int8
        self.module = plan.module
        self.topo, self.kernels, self.log = topo, kernels, log
        log.bind(device)  # its waits stall this device ([Note: time waiting on communication] in telemetry.py)
        self.s = topo.layout.shard_size
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
        # [Note: optimizer rows over replicas] in optimizer_rows.py: the optimizer steps this replica's rows
        reps, j = (topo.layout.replicas, topo.replica_rank) if optimizer_over_replicas else (1, 0)
        rows = [Rows(t.shape[0], t[0].numel() if t.shape[0] else 0, self.s, topo.shard_rank, reps, j)
                for t in tp_locals]
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
        self.optimizer_rows = OptimizerRows(self.params, topo, log, kernels, self.quantize, reduce_dtype) \
            if reps > 1 and self.params else None

        # Full parameters: Parameters aliasing one buffer in param_dtype whose storage is freed while sharded.
        numels = [math.prod(sp.shape) for sp in self.params]
        self.full_numel = sum(numels)
        # [Note: staging in place] in full_storage.py: room for the reduce-scatter input of the whole unit
        self.storage = FullStorage(self.full_numel, self.param_dtype, device,
                                   self.s * self.shard_flat.numel() if self.s > 1 else 0, reduce_dtype)
        self.full_flat = self.storage.flat
        self.full_views: List[Tensor] = []
        start = 0
        for sp, n in zip(self.params, numels):
            view = self.full_flat[start:start + n].view(sp.shape)
            self.full_views.append(view)
            sp.full = sp.make_full(view)
            start += n
        self.storage.release()
        self._live = 0  # elements this unit holds gathered ([Note: live cap] in schedule.py)
        # told of fills and releases: the user-code boundary ([Note: the user-code boundary] in user_code/boundary.py)
        self.lending: Optional[Lending] = None

        self.replicated: List[ReplicatedParam] = [
            ReplicatedParam(i, pp.refs, pp.param, topo.mesh, device) for i, pp in enumerate(plan.replicated)]

        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.is_prefetched = False  # issued by the schedule, not yet run
        self.pinned = pinned  # gathered once and kept ([Note: optimizer-state-only sharding] in gradients.py)
        self.depth = 0  # nested forward calls in progress
        self.pending_post_backward = 0  # forward calls whose post-backward has not fired
        self.registered_post_backward = 0  # forward calls (this iteration) that hooked their inputs
        self.accumulated = 0  # trainable full parameters whose gradient autograd accumulated this backward
        self._gather: Optional[collectives.AllGatherResult] = None
        self.on_accumulated: Optional[Any] = None  # the hooks' post-accumulate-grad hooks, sharded params
        self.on_replicated: Optional[Any] = None  # and replicated ones (called with the ReplicatedParam)
        self.hook_handles: Dict[int, Any] = {}  # registered lazily: only a tensor that requires grad takes one
        self._swap_sharded()

    # -- properties -----------------------------------------------------------------------------------
    @property
    def is_live(self) -> bool:
        return self.state is not ShardedState.SHARDED

    @property
    def gather_numel(self) -> int:
        """Elements of the buffers of this unit's gather in flight ([Note: live cap] in schedule.py)."""
        if not self.params:
            return 0
        row_bytes = quantized.wire_bytes(self.shard_flat.numel(), 1, self.quantize.block_size) if self._int8_gather else 0
        return collectives.gather_numel(self.shard_flat.numel(), self.s, self.nodes, row_bytes, self.param_dtype.itemsize)

    @property
    def stored_numel(self) -> int:
        """Elements of the full storage of this unit gathered (with room for staging: [Note: staging in place])."""
        return -(-self.storage.nbytes(self.pinned) // self.param_dtype.itemsize) if self.params else 0

    @property
    def live_numel(self) -> int:
        return self._live

    def _set_live(self, numel: int) -> None:
        gathered = self.full_numel if numel else 0  # the full parameters, from the gather's issue to the release
        self.log.live(numel - self._live, gathered - (self.full_numel if self._live else 0))
        self._live = numel

    @property
    def in_use(self) -> bool:
        return self.depth > 0 or self.training_state is TrainingState.PRE_BACKWARD

    def all_params(self) -> Tuple[AnyParam, ...]:
        """Every parameter of the unit: the sharded ones, then the replicated ones."""
        return (*self.params, *self.replicated)

    def trainable(self) -> Tuple[int, ...]:
        """Sharded parameters that take part in gradient reduction: ``requires_grad`` of the DTensor, which
        the user sets alike on every rank, so every rank issues the same collectives."""
        return tuple(i for i, sp in enumerate(self.params) if sp.requires_grad)

    # -- training state ([Note: unit lifecycle]) ---------------------------------------------------------
    def enter_forward(self) -> bool:
        """A forward call into the unit starts; True for the outermost one."""
        self.depth += 1
        return self.depth == 1

    def begin_forward(self) -> None:
        self.training_state = TrainingState.FORWARD

    def exit_forward(self) -> bool:
        """A forward call returns; True when it was the outermost one (the unit is idle again)."""
        self.depth = max(self.depth - 1, 0)
        if self.depth > 0:
            return False
        self.training_state = TrainingState.IDLE
        return True

    def expect_post_backward(self) -> None:
        """This forward hooked its inputs: one more post-backward to come."""
        self.pending_post_backward += 1
        self.registered_post_backward += 1

    def post_backward_fired(self) -> bool:
        """One post-backward ran; True when it was the last one pending."""
        self.pending_post_backward -= 1
        return self.pending_post_backward <= 0

    def begin_backward(self) -> bool:
        """A pre-backward hook fired; True for the first one of this backward pass."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False
        self.training_state = TrainingState.PRE_BACKWARD
        return True

    def grad_accumulated(self) -> bool:
        """Autograd accumulated a sharded parameter's gradient. True when the unit has no post-backward and the
        gradient of *every* sharded parameter is in: then every op that uses one has run its backward (an op
        computes its weight's and its input's gradients in one node), so the unit can be reduced and go. With a
        frozen sharded parameter an op of the unit may still need it: the end of backward reduces it then."""
        self.accumulated += 1
        return (self.registered_post_backward == 0 and self.accumulated == len(self.params)
                and self.depth == 0 and self.state is ShardedState.GATHERED)

    def finish_backward(self) -> None:
        self.training_state = TrainingState.POST_BACKWARD

    def clear_counters(self) -> None:
        self.pending_post_backward = self.registered_post_backward = self.accumulated = 0

    def end_backward(self) -> None:
        self.clear_counters()
        self.training_state = TrainingState.IDLE

    # -- swapping -------------------------------------------------------------------------------------
    def _swap_sharded(self) -> None:
        for p in self.all_params():
            for ref in p.refs:
                ref.module._parameters[ref.attr] = p.sharded

    def _swap_full(self) -> None:
        for p in self.all_params():
            if p.full.requires_grad != p.sharded.requires_grad:
                p.full.requires_grad_(p.sharded.requires_grad)
            if p.full.requires_grad and id(p) not in self.hook_handles:
                if isinstance(p, ShardedParam) and self.on_accumulated is not None:
                    self.hook_handles[id(p)] = p.full.register_post_accumulate_grad_hook(
                        _weak_hook(self.on_accumulated))
                elif isinstance(p, ReplicatedParam) and self.on_replicated is not None:
                    self.hook_handles[id(p)] = p.full.register_post_accumulate_grad_hook(
                        _weak_hook(self.on_replicated, p))
            for ref in p.refs:
                ref.module._parameters[ref.attr] = p.full

    def remove_hooks(self) -> None:
        self.on_accumulated = self.on_replicated = None
        for h in self.hook_handles.values():
            h.remove()
        self.hook_handles.clear()

    # [Note: version counters]
    # Autograd saves the full parameters for backward. Between forward and backward their storage is freed and then
    # refilled by the re-gather, an in-place write that would bump the version counter and make autograd refuse the
    # saved tensors; the refill restores the counter, as FSDP2 does, because the values are the same. The refresh
    # after an optimizer step does bump it: the values changed, and a graph built before the step must fail as it
    # would in plain PyTorch.
    # -- gather / release -----------------------------------------------------------------------------
    def issue_gather(self, prefetched: bool = False) -> None:
        """SHARDED -> GATHERING: the all-gather of the flat shard (cast to param_dtype) is issued, async."""
        if self.state is not ShardedState.SHARDED:
            return
        self.settle_rows()
        if self.lending is not None:
            self.lending.filled(self)
        self._set_live(self.gather_numel)  # before its buffers exist ([Note: live cap] in schedule.py)
        if self.params:
            self._gather = self._all_gather(async_op=True)
        self.state = ShardedState.GATHERING
        self.is_prefetched = prefetched

    def finish_gather(self) -> None:
        """-> GATHERED: waits for the all-gather, copies out into the full parameters, swaps them in."""
        if self.state is ShardedState.GATHERED:
            return
        if self.state is ShardedState.SHARDED:
            self.issue_gather()
        if self.params:
            res, self._gather = self._gather, None
            out = collectives.gathered(res, self.log)
            self._set_live(self._live + self.stored_numel)  # both, for the copy-out
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full_flat):
                self.storage.fill(self.pinned, self.log)
                collectives.copy_out(out, self.full_views, self.s, self.kernels)
            del res, out  # the gather's buffers go
        self._set_live(self.stored_numel)
        self._swap_full()
        self.state = ShardedState.GATHERED
        self.is_prefetched = False

    @property
    def _int8_gather(self) -> bool:
        """Whether the gather's first hop carries int8 blocks ([Note: quantized traffic] in options.py)."""
        return self.nodes is not None and self.quantize.allgather

    def _all_gather(self, async_op: bool) -> collectives.AllGatherResult:
        if self._int8_gather:
            return quantized.quantized_all_gather_two_hop(self.shard_flat, self.nodes, self.quantize.block_size,
                                                  dtype=self.param_dtype, async_op=async_op, log=self.log,
                                                  kernels=self.kernels)
        if self.nodes is not None:
            return collectives.all_gather_two_hop(self.shard_flat, self.nodes, dtype=self.param_dtype, async_op=async_op,
                                        log=self.log, kernels=self.kernels)
        return collectives.all_gather_flat(self.shard_flat, self.topo.shard_group, self.s, dtype=self.param_dtype,
                                 async_op=async_op, log=self.log, kernels=self.kernels)

    def release(self, force: bool = False, stale: bool = False) -> None:
        """-> SHARDED: the DTensors go back into the modules and the full storage is freed. A pinned unit
        stays gathered unless ``force``. ``stale``: the masters moved since the gather (an optimizer step)."""
        if self.state is ShardedState.SHARDED or (self.pinned and not force):
            return
        if self.lending is not None:  # plain parameters that user code could write, into the masters
            self.lending.releasing(self, stale)
        if self._gather is not None:  # a prefetch never used, both hops issued ([Note: chained collectives])
            collectives.wait(self._gather.work, self.log)  # waited for alike on every rank: the same events decide it
            self._gather = None
        self._swap_sharded()
        self.storage.release()  # or the last reduce-scatter reading it frees it ([Note: staging in place])
        self.state = ShardedState.SHARDED
        self.is_prefetched = False
        self._set_live(0)

    def refresh(self) -> None:
        """After an optimizer step, a unit still in use gets the new values ([Note: version counters]); also a unit
        whose masters user code moved ([Note: masters moved outside a step] in user_code/write_back.py)."""
        if not self.params or self.state is not ShardedState.GATHERED:
            return
        self.settle_rows()
        if self.lending is not None:
            self.lending.filled(self)
        self._set_live(self.stored_numel + self.gather_numel)
        out = collectives.gathered(self._all_gather(async_op=False), self.log)
        self.storage.settle(self.log)
        with torch.no_grad():  # an in-place write: it bumps the version counter, as an optimizer step does
            collectives.copy_out(out, self.full_views, self.s, self.kernels)
        self._set_live(self.stored_numel)

    def delivered(self, shard: Tensor) -> Tensor:
        """``shard`` as its gather delivers it, up to the cast to param_dtype: itself, or the int8 round trip of
        the whole shard (its blocks span parameters)."""
        return quantized.round_trip(shard, self.quantize.block_size, self.param_dtype, self.kernels) \
            if self._int8_gather else shard

    # -- the optimizer's rows over replicas ([Note: optimizer rows over replicas] in optimizer_rows.py) ----------
    def rows_written(self) -> None:
        """Every replica's chunks were written alike (built, or loaded): [Note: rows between steps]."""
        if self.optimizer_rows is not None:
            self.optimizer_rows.agree()

    def rows_stepped(self) -> None:
        """After an optimizer step: this replica's rows are to cross the replicas before the chunks are read."""
        if self.optimizer_rows is not None:
            self.optimizer_rows.stale = True

    def settle_rows(self) -> None:
        """Before the flat shard is read: the other replicas' rows are in (a stale unit exchanges them first)."""
        if self.optimizer_rows is not None:
            self.optimizer_rows.settle()

    def drop(self, rows_deadline: float = 0.0) -> None:
        """Local reset after a failure: no collective, no wait (a peer may be gone) but for the optimizer rows in
        flight, until ``rows_deadline`` ([Note: rows when a run ends] in optimizer_rows.py)."""
        if self._gather is not None:
            collectives.abandon(self._gather.work)  # [Note: chained collectives] in collectives.py
        self._gather = None
        if self.optimizer_rows is not None:
            self.optimizer_rows.drop(rows_deadline)
        for sp in self.params:
            sp.full.grad = None
        self._swap_sharded()
        self.storage.drop()
        self._set_live(0)
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.is_prefetched = False
        if self.lending is not None:
            self.lending.dropped(self)
        self.depth = 0
        self.clear_counters()
