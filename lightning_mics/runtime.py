"""Forward/backward hooks that gather and release units, reduce gradients, and sync replicas.

[Note: one optimizer step]
forward, unit by unit:  pre-hook gathers the unit (all-gather of its flat shard in the shard group, copy-out
                        into full parameters, which are swapped into the modules); post-hook releases them
                        (swap the shards back, free the storage) and hooks the outputs for backward.
backward, reverse:      a hook on the unit's outputs gathers it again; an autograd function on its inputs
                        fires once the unit's backward is done: gradients are laid out rank-major in buckets,
                        reduce-scattered in the shard group and added to the unit's fp32 shard accumulator;
                        the full gradients and parameters are freed.
end of backward:        a callback queued on the autograd engine reduces any unit whose inputs needed no
                        gradient, then, only at an accumulation boundary (Lightning's block_backward_sync marks
                        the others), all-reduces the accumulators across the replica group (MiCS 2-hop sync)
                        and the replicated small parameters' gradients across the world, and hands the
                        shard gradients to the optimizer as ``param.grad``.

[Note: version counters]
Autograd saves the full parameters for backward. Between forward and backward their storage is freed and
then refilled by the re-gather, an in-place write that would bump the version counter and make autograd
refuse the saved tensors; the refill restores the counter, as FSDP2 does, because the values are the same.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_mics import collectives as C
from lightning_mics.sharding import ParamPlan, UnitPlan, plan_sharding, resolve_classes
from lightning_mics.telemetry import CommLog
from lightning_mics.topology import Topology


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only the local flat shard exists
    GATHERED = "gathered"  # full parameters are swapped into the modules


class _Bucket:
    """A run of a unit's trainable parameters whose gradients are reduced in one collective."""

    def __init__(self, first: int, last: int, offset: int, numel: int) -> None:
        self.first, self.last = first, last  # parameter slots [first, last)
        self.offset, self.numel = offset, numel  # region of the unit's flat shard


class Unit:
    """One gather/release unit: its flat shard, its full parameters, its gradient accumulator."""

    def __init__(self, plan: UnitPlan, topo: Topology, param_dtype: Optional[torch.dtype],
                 reduce_dtype: torch.dtype, bucket_size: int, kernels: str, log: CommLog,
                 device: torch.device) -> None:
        self.path = plan.path or "<root>"
        self.module = plan.module
        self.topo, self.kernels, self.log = topo, kernels, log
        s, rank = topo.layout.shard_size, topo.shard_rank
        self.s = s
        # Trainable parameters first so that the gradient region is one contiguous prefix.
        plans: List[ParamPlan] = sorted(plan.params, key=lambda pp: not pp.param.requires_grad)
        dtypes = {pp.param.dtype for pp in plans} or {torch.get_default_dtype()}  # the root may own nothing
        if len(dtypes) != 1:
            raise ValueError(f"unit {self.path!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "MiCSStrategy needs one dtype per unit (see the shard_units option)")
        self.dtype = dtypes.pop()
        self.param_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype
        self.refs = [pp.refs for pp in plans]
        self.shapes = [pp.param.shape for pp in plans]
        self.rows = [shape[0] for shape in self.shapes]
        self.shard_rows = [math.ceil(d0 / s) for d0 in self.rows]
        self.shard_numels = [c * pp.param[0].numel() if d0 else 0 for c, d0, pp in
                             zip(self.shard_rows, self.rows, plans)]
        self.n_trainable = sum(pp.param.requires_grad for pp in plans)
        self.fqns = [pp.fqn for pp in plans]

        offsets = [0]
        for n in self.shard_numels:
            offsets.append(offsets[-1] + n)
        self.shard_rank = rank
        self.shard_flat = torch.zeros(offsets[-1], dtype=self.dtype, device=device)
        self.sharded: List[nn.Parameter] = []
        for i, pp in enumerate(plans):
            view = self.shard_flat[offsets[i]:offsets[i + 1]].view(self.shard_rows[i], *self.shapes[i][1:])
            self.copy_local_rows_(i, pp.param.detach(), view)
            self.sharded.append(nn.Parameter(view, requires_grad=pp.param.requires_grad))

        # Full parameters: nn.Parameters aliasing one flat buffer whose storage is freed while sharded.
        full_numels = [math.prod(shape) for shape in self.shapes]
        self.full_numel = sum(full_numels)
        self.full_flat = torch.empty(self.full_numel, dtype=self.param_dtype, device=device)
        self._full_nbytes = self.full_flat.untyped_storage().nbytes()
        self.full_views: List[Tensor] = []
        start = 0
        for n, shape in zip(full_numels, self.shapes):
            self.full_views.append(self.full_flat[start:start + n].view(shape))
            start += n
        self.full: List[nn.Parameter] = [
            nn.Parameter(v, requires_grad=pp.param.requires_grad) for v, pp in zip(self.full_views, plans)
        ]
        self.full_flat.untyped_storage().resize_(0)

        # Buckets over the trainable prefix, by full (unsharded) elements, at least one parameter each.
        self.buckets: List[_Bucket] = []
        first = 0
        while first < self.n_trainable:
            last, elems = first, 0
            while last < self.n_trainable and (last == first or elems + full_numels[last] <= bucket_size):
                elems += full_numels[last]
                last += 1
            self.buckets.append(_Bucket(first, last, offsets[first], offsets[last] - offsets[first]))
            first = last
        n_grad = offsets[self.n_trainable]
        self.accum = torch.zeros(n_grad, dtype=reduce_dtype, device=device)
        self.grad_buf = self.accum if reduce_dtype == self.dtype else torch.zeros(n_grad, dtype=self.dtype,
                                                                                  device=device)
        self.grad_views = [self.grad_buf[offsets[i]:offsets[i + 1]].view_as(self.sharded[i])
                           for i in range(self.n_trainable)]
        self.got_grad = torch.zeros(self.n_trainable, dtype=torch.bool)
        self.accum_fresh = True  # the next reduction overwrites the accumulator (new accumulation window)

        self.state = ShardState.SHARDED
        self.pending_post_backward = 0  # forward calls whose post-backward has not fired yet
        self.needs_reduce = False  # gathered for backward since the last reduction
        self._swap(self.sharded)

    @torch.no_grad()
    def copy_local_rows_(self, i: int, full: Tensor, local: Tensor) -> Tensor:
        """Writes this rank's rows of ``full`` (parameter ``i``'s full shape) into ``local`` (the shard's
        shape), zero-padding the rows past the end ([Note: rank-major layout] in collectives.py)."""
        c, d0 = self.shard_rows[i], self.rows[i]
        lo, hi = min(self.shard_rank * c, d0), min((self.shard_rank + 1) * c, d0)
        local.zero_()
        local[: hi - lo].copy_(full[lo:hi])
        return local

    # -- state transitions -------------------------------------------------------------------------
    def _swap(self, params: Sequence[nn.Parameter]) -> None:
        for refs, p in zip(self.refs, params):
            for ref in refs:
                ref.module._parameters[ref.attr] = p

    def gather(self) -> None:
        if self.state is ShardState.GATHERED:
            return
        if self.full_numel == 0:  # a root that owns no sharded parameter: nothing to gather
            self.state = ShardState.GATHERED
            return
        storage = self.full_flat.untyped_storage()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full_flat):
            storage.resize_(self._full_nbytes)
            if self.s == 1:
                C.copy_out(self.shard_flat.view(1, -1), self.full_views, 1, self.kernels)
            else:
                res = C.all_gather_flat(self.shard_flat, self.topo.shard_group, self.s, dtype=self.param_dtype,
                                        log=self.log, kernels=self.kernels)
                C.copy_out(res.output, self.full_views, self.s, self.kernels)
        self._swap(self.full)
        self.state = ShardState.GATHERED
        self.log.live(self.full_numel)

    def release(self) -> None:
        if self.state is ShardState.SHARDED:
            return
        self._swap(self.sharded)
        self.full_flat.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED
        self.log.live(-self.full_numel)

    # -- gradients ---------------------------------------------------------------------------------
    def reduce_grads(self, world_size: int) -> None:
        """Reduce-scatters the full gradients (bucket by bucket) into the shard accumulator; frees them."""
        grads: List[Tensor] = []
        for i in range(self.n_trainable):
            g = self.full[i].grad
            if g is None:
                g = torch.zeros(self.shapes[i], dtype=self.param_dtype, device=self.shard_flat.device)
            else:
                self.got_grad[i] = True
            grads.append(g)
        for b in self.buckets:
            res = C.reduce_scatter_grads(grads[b.first:b.last], self.topo.shard_group, self.s,
                                         dtype=self.reduce_dtype, scale=1.0 / world_size, log=self.log,
                                         kernels=self.kernels)
            region = self.accum[b.offset:b.offset + b.numel]
            if self.accum_fresh:
                region.copy_(res.output)
            else:
                region.add_(res.output)
        self.accum_fresh = False
        for p in self.full[: self.n_trainable]:
            p.grad = None
        self.needs_reduce = False

    def sync_replicas(self) -> None:
        """Accumulation boundary: all-reduce each bucket's accumulated shard across the replica group."""
        if self.accum_fresh:  # no gradient reached this unit in the whole window
            self.accum.zero_()
        if self.topo.layout.replicas > 1:
            for b in self.buckets:
                C.all_reduce_sum(self.accum[b.offset:b.offset + b.numel], self.topo.replica_group,
                                 log=self.log, group_name="replicate")
        if self.grad_buf is not self.accum:
            self.grad_buf.copy_(self.accum)

    def publish_grads(self, got_any: Tensor) -> None:
        """Sets ``param.grad`` of the shards: a view of the gradient buffer, or None where no rank had one."""
        for i in range(self.n_trainable):
            self.sharded[i].grad = self.grad_views[i] if got_any[i] else None
        self.got_grad.zero_()
        self.accum_fresh = True


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
    """Shards a module in place and drives the hooks of all its units."""

    def __init__(self, root: nn.Module, topo: Topology, *, shard_units: Optional[Sequence],
                 persistence_threshold: int, bucket_size: int, param_dtype: Optional[torch.dtype],
                 reduce_dtype: torch.dtype, kernels: str, device: torch.device) -> None:
        self.root, self.topo, self.kernels = root, topo, kernels
        self.world_size = topo.layout.world_size
        self.log = CommLog()
        classes = resolve_classes(shard_units, "shard_units")
        plan = plan_sharding(root, classes, persistence_threshold, topo.layout.shard_size)
        self.units = [Unit(up, topo, param_dtype, reduce_dtype, bucket_size, kernels, self.log, device)
                      for up in plan.units]
        self.replicated: List[nn.Parameter] = [pp.param for pp in plan.replicated]
        self.replicated_names = [pp.fqn for pp in plan.replicated]
        self.sync_replicas = True  # False inside Lightning's block_backward_sync (not a boundary)
        self._in_backward = False
        self._handles: List[Any] = []
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(
                self._make_pre_forward(unit), with_kwargs=True, prepend=True))
            self._handles.append(unit.module.register_forward_hook(
                self._make_post_forward(unit), with_kwargs=True))

    # -- parameters as the optimizer sees them ----------------------------------------------------
    def sharded_params(self) -> List[nn.Parameter]:
        return [p for u in self.units for p in u.sharded]

    # -- hooks --------------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
            unit.gather()
            if not torch.is_grad_enabled() or self._in_backward:
                return args, kwargs
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
            if idx:
                unit.pending_post_backward += 1
                outs = _PostBackward.apply(lambda: self._post_backward(unit), *(flat[i] for i in idx))
                for i, t in zip(idx, outs):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
            return args, kwargs
        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: nn.Module, args: Tuple, kwargs: Dict, output: Any) -> Any:
            if not self._in_backward:  # a recompute inside backward (checkpointing) keeps the unit gathered
                unit.release()
            if not torch.is_grad_enabled():
                return output
            flat, spec = tree_flatten(output)
            for t in flat:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(self._make_pre_backward(unit))
            return output
        return hook

    def _make_pre_backward(self, unit: Unit):
        def hook(grad: Tensor) -> Tensor:
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            unit.gather()
            unit.needs_reduce = True
            return grad
        return hook

    def _post_backward(self, unit: Unit) -> None:
        unit.pending_post_backward -= 1
        if unit.pending_post_backward <= 0 and unit.needs_reduce:
            unit.reduce_grads(self.world_size)
            unit.release()

    def _end_of_backward(self) -> None:
        for unit in reversed(self.units):  # same order on every rank
            if unit.needs_reduce:
                unit.reduce_grads(self.world_size)
            unit.release()
            unit.pending_post_backward = 0
        self._in_backward = False
        if self.sync_replicas:
            self.sync()

    # -- accumulation boundary ----------------------------------------------------------------------
    def sync(self) -> None:
        """MiCS 2-hop sync: replica all-reduce of shard gradients, world all-reduce of replicated ones.

        The world all-reduce also carries one flag per trainable parameter (did any rank get a gradient?)
        so that a parameter no rank used keeps ``grad=None``, as in a plain single-process run.
        """
        for unit in self.units:
            unit.sync_replicas()
        rep = [p for p in self.replicated if p.requires_grad]
        flags = torch.cat([u.got_grad for u in self.units] + [
            torch.tensor([p.grad is not None for p in rep], dtype=torch.bool)]).to(torch.float32)
        device = self.units[0].shard_flat.device if self.units else (rep[0].device if rep else torch.device("cpu"))
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32)
                 for p in rep]
        buf = torch.cat(parts + [flags.to(device)]) if parts else flags.to(device)
        if self.world_size > 1:
            if rep:
                buf[: buf.numel() - flags.numel()].mul_(1.0 / self.world_size)
            C.all_reduce_sum(buf, self.topo.world_group, log=self.log, group_name="world")
        got = buf[buf.numel() - flags.numel():].cpu() > 0
        start = 0
        for unit in self.units:
            unit.publish_grads(got[start:start + unit.n_trainable])
            start += unit.n_trainable
        offset = 0
        for k, p in enumerate(rep):
            n = p.numel()
            if got[start + k]:
                p.grad = buf[offset:offset + n].view_as(p).to(p.dtype)
            else:
                p.grad = None
            offset += n

    # -- whole-model views ---------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, module: nn.Module, prefix_to_strip: str = "") -> Dict[str, Tensor]:
        """Gathers unit by unit; returns the module's own state dict with full tensors on CPU (every rank)."""
        full: Dict[int, Tensor] = {}
        for unit in self.units:
            unit.gather()
            for shard, p in zip(unit.sharded, unit.full):
                full[id(shard)] = p.detach().to(unit.dtype).cpu().clone()
            unit.release()
        out = {}
        for name, t in module.state_dict(keep_vars=True).items():
            out[name] = full.get(id(t), None)
            if out[name] is None:
                out[name] = t.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Dict[str, Tensor], module: nn.Module, strict: bool = True) -> None:
        """Copies this rank's rows of every full tensor into its shard; replicated ones are copied whole."""
        named = dict(module.named_parameters(remove_duplicate=False))
        shard_ids = {id(p): (u, i) for u in self.units for i, p in enumerate(u.sharded)}
        missing = []
        for name, p in named.items():
            if name not in state:
                missing.append(name)
                continue
            src = state[name]
            if id(p) in shard_ids:
                u, i = shard_ids[id(p)]
                u.copy_local_rows_(i, src, p)
            else:
                p.copy_(src)
        buffers = dict(module.named_buffers())
        for name, b in buffers.items():
            if name in state:
                b.copy_(state[name])
        if strict and missing:
            raise KeyError(f"missing keys in state dict: {missing}")

    def restore_module(self) -> Dict[int, nn.Parameter]:
        """Removes the hooks and puts full, ordinary parameters back into the modules (after fit).

        Returns ``{id(shard): full parameter}`` so optimizers can be re-pointed at the full parameters."""
        mapping: Dict[int, nn.Parameter] = {}
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with torch.no_grad():
            for unit in self.units:
                unit.gather()
                restored = [nn.Parameter(p.detach().to(unit.dtype).clone(), requires_grad=p.requires_grad)
                            for p in unit.full]
                unit.release()
                unit._swap(restored)
                unit.full_flat = torch.empty(0)
                mapping.update({id(sh): p for sh, p in zip(unit.sharded, restored)})
        return mapping

    # -- accounting ----------------------------------------------------------------------------------
    def model_state_bytes(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (no transient buffers)."""
        def nbytes(t: Tensor) -> int:
            return t.numel() * t.element_size()
        params = sum(nbytes(u.shard_flat) for u in self.units) + sum(nbytes(p) for p in self.replicated)
        grads = sum(nbytes(u.accum) + (nbytes(u.grad_buf) if u.grad_buf is not u.accum else 0) for u in self.units)
        grads += sum(nbytes(p) for p in self.replicated if p.requires_grad)
        opt = 0
        for o in optimizers:
            for st in o.state.values():
                opt += sum(nbytes(v) for v in st.values() if isinstance(v, Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
