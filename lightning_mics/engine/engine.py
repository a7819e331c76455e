"""MiCSEngine: the front that shards a module in place and offers the entry points the strategy uses.

It builds the parts and wires them; each holds one concept (ARCHITECTURE.md gives the data flow):
``unit.py`` (one unit's memory and state machine), ``schedule.py`` (which units are gathered, kept, released),
``gradients.py`` (a gradient's path to the optimizer's shard), ``hooks.py`` (the module and autograd hooks
that drive them, [Note: one optimizer step]), ``full_state.py`` (full tensors from the shards and back), and
``user_code/`` (what user code between steps needs reconciled: [Note: the user-code boundary] in user_code/boundary.py).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_mics.engine import full_state
from lightning_mics.comm import quantized
from lightning_mics.engine.activations import ActivationCheckpointing, plan_groups
from lightning_mics.options import MiCSOptions, optimizer_state_only as zero1
from lightning_mics.engine.hooks import Hooks
from lightning_mics.layout.materialize import has_meta, materialize
from lightning_mics.layout.placement import ReplicatedParam, local
from lightning_mics.engine.replicated import ReplicatedReducer
from lightning_mics.engine.gradients import GradientPath
from lightning_mics.engine.outer_sync import OuterSync
from lightning_mics.engine.schedule import Schedule
from lightning_mics.layout.sharding import UnitPlan, plan_sharding, resolve_classes
from lightning_mics.comm.telemetry import CommLog
from lightning_mics.layout.topology import Topology
from lightning_mics.engine.unit import Unit
from lightning_mics.engine.user_code.boundary import UserCodeBoundary


class MiCSEngine:
    """Shards a module in place and drives the hooks of all its units ([Note: one optimizer step] in hooks.py)."""

    def __init__(self, root: nn.Module, topo: Topology, options: MiCSOptions, device: torch.device,
                 keep_for_backward: bool = True) -> None:
        """``options``: resolved (``MiCSOptions.resolved``: dtypes and the gather's hops decided)."""
        self.root, self.topo, self.kernels, self.options = root, topo, options.kernels, options
        shard_units, persistence_threshold = options.shard_units, options.param_persistence_threshold
        bucket_size, param_dtype, reduce_dtype = options.reduce_bucket_size, options.param_dtype, options.reduce_dtype
        kernels, prefetch, max_live_parameters = options.kernels, options.prefetch, options.max_live_parameters
        hierarchical, activation_checkpointing = options.hierarchical_allgather, options.activation_checkpointing
        checkpoint_group_size, activation_offload = options.checkpoint_group_size, options.activation_offload
        reshard_after_forward = options.reshard_after_forward
        self.log = CommLog()
        # [Note: optimizer rows over replicas] in optimizer_rows.py (s > 1) or
        # [Note: optimizer-state-only sharding] in gradients.py (s = 1: the shard group is every rank)
        optimizer_state_only = zero1(options)
        over_replicas = options.shard_optimizer_state and not optimizer_state_only and topo.layout.replicas > 1
        self.optimizer_state_only = optimizer_state_only
        # [Note: optimizer-state-only sharding] in gradients.py: one unit (the root) holds every parameter
        classes = () if optimizer_state_only else resolve_classes(shard_units, "shard_units")
        groups = plan_groups(root, activation_checkpointing, checkpoint_group_size) \
            if activation_checkpointing else None  # validated before anything changes in the module
        plan = plan_sharding(root, classes, persistence_threshold, topo.layout.shard_size)
        on_meta = has_meta(root)  # before the units replace the parameters with their (allocated) shards
        nodes = topo.node_groups() if hierarchical else None
        quantize = quantized.QuantizeSpec(options.quantize_gradients, options.quantize_allgather,
                                  options.quantization_block_size)  # [Note: quantized traffic] in options.py
        self.units = [Unit(up, topo, param_dtype=param_dtype, reduce_dtype=reduce_dtype, kernels=kernels,
                           log=self.log, device=device, nodes=nodes, pinned=optimizer_state_only, quantize=quantize,
                           optimizer_over_replicas=over_replicas)
                      for up in plan.units]
        self.device = device
        by_param = {id(rp.full): rp for rp in self.replicated}
        order = [by_param[id(p)] for p in self._plain_parameters() if id(p) in by_param]
        # the default group as None, looked up per call: holding it would keep it alive after a lone failure
        # ([Note: a lone failure] in reliability.py); with t > 1 the data-parallel group, which the mesh holds
        dp_group = topo.dp_group if topo.layout.tp_size > 1 else None
        apart = options.replica_sync == "diloco"  # [Note: DiLoCo across replica groups] in options.py: in the shard group
        reducer = ReplicatedReducer(order, topo.shard_group, topo.layout.shard_size, bucket_size, device, self.log,
                                    group_name="shard") if apart else \
            ReplicatedReducer(order, dp_group, topo.layout.dp_size, bucket_size, device, self.log,
                              group_name="world" if topo.layout.tp_size == 1 else "dp")
        if on_meta:  # [Note: sharded initialization] in materialize.py
            materialize(root, {(id(r.module), r.attr): p for u in self.units for p in u.all_params()
                               for r in p.refs}, device)
        for unit in self.units:  # [Note: rows between steps] in optimizer_rows.py
            unit.rows_written()
        self.schedule = Schedule(self.units, prefetch, max_live_parameters, keep_for_backward,
                                 reshard_after_forward)
        self.grads = GradientPath(self.units, reducer, bucket_size, optimizer_state_only, quantize, apart)
        self.user_code = UserCodeBoundary(self.units, self.schedule)  # [Note: the user-code boundary]
        # [Note: the outer step on shards] in outer_sync.py: heard of at the optimizer steps
        self.outer = OuterSync(self.units, topo, options, self.log) if apart else None
        self.user_code.outer = self.outer
        self.hooks = Hooks(self.units, [self._entry_modules(u, up) for u, up in zip(self.units, plan.units)],
                           self.schedule, self.grads, self.user_code, owner=self)  # the module keeps its engine
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
        at = {(id(r.module), r.attr): p.full for u in self.units for p in u.all_params() for r in p.refs}
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
        return [p.sharded for u in self.units for p in u.all_params()]

    @property
    def replicated(self) -> List[ReplicatedParam]:
        return [rp for u in self.units for rp in u.replicated]

    @property
    def sync_replicas(self) -> bool:
        """Whether this backward ends an accumulation window (False inside Lightning's block_backward_sync)."""
        return self.grads.sync_replicas

    @sync_replicas.setter
    def sync_replicas(self, value: bool) -> None:
        self.grads.sync_replicas = value

    # -- entry points -----------------------------------------------------------------------------------
    def release_idle(self, pinned: bool = True) -> None:
        """[``Schedule.release_idle``]: every unit not running released (``pinned``: pinned ones too), the optimizer's
        rows settled first (collective)."""
        self.schedule.exchange_rows()
        self.schedule.release_idle(pinned)

    def pin(self) -> None:
        """The pinned units gathered now if released ([Note: optimizer-state-only sharding] in gradients.py): at
        setup and after a load, so that user code sees the plain parameters from setup to the end of the run, as
        under DDP, not DTensors until the first forward. Collective over the shard group."""
        for unit in self.units:
            if unit.pinned:
                unit.finish_gather()

    def settle_masters(self) -> None:
        """Every unit's masters as the module holds them ([Note: writes between steps] in user_code/write_back.py) and
        its chunks as the replicas agree on them ([Note: rows between steps] in optimizer_rows.py): before they are
        saved. Collective over the replica group."""
        self.user_code.refuse_rebinding()
        self.user_code.masters_read()
        self.schedule.exchange_rows()
        for unit in self.units:
            unit.settle_rows()

    def sync(self) -> None:
        """MiCS 2-hop sync at an accumulation boundary ([``GradientPath.sync``])."""
        self.grads.sync()

    def full_state_dict(self, dst: Optional[int] = 0) -> Dict[str, Tensor]:
        """The module's full state dict on global rank ``dst`` ({} elsewhere; ``None``: every rank). Collective.
        Read from the masters, a pinned unit stays gathered: what user code wrote is taken first, then the rows
        settle (``release_idle``'s exchange) and the units not running are released."""
        self.user_code.masters_read()
        self.release_idle(pinned=False)
        return full_state.full_state_dict(self.units, self.topo, self.root, dst)

    def load_full_state_dict(self, state: Dict[str, Tensor], strict: bool = True) -> None:
        # released (a unit kept gathered would go on with, and take back, what the load replaces), and what the load
        # leaves alone agrees across the replicas before all of it is taken so
        self.release_idle()
        full_state.load_full_state_dict(self.units, self.root, state, self.device, strict)
        if self.outer is not None:  # [Note: the outer step on shards]: the loaded masters are the last synced ones
            self.outer.forget()

    def restore_module(self) -> Dict[int, nn.Parameter]:
        """Removes the hooks and puts full, plain parameters (master dtype) back into the modules, unit by
        unit. Collective. Returns ``{id(DTensor parameter): plain parameter}`` for re-pointing optimizers."""
        self.remove_hooks()
        self.settle_masters()
        return full_state.restore_module(self.units)

    def remove_hooks(self) -> None:
        self.hooks.remove()
        if self.activations is not None:
            self.activations.remove()

    def reset(self, keep_feedback: bool = False, rows_wait_s: float = 0.0) -> None:
        """After an exception: every unit back to SHARDED locally, no collective (peers may be gone).
        ``keep_feedback``: after a run that ended well, the error-feedback residuals stay for the next one.
        ``rows_wait_s``: how long the optimizer rows in flight may still take to arrive
        ([Note: rows when a run ends] in optimizer_rows.py; 0: what has arrived is taken)."""
        self.grads.reset(keep_feedback)
        self.hooks.reset()
        self.user_code.reset()
        rows_deadline = time.monotonic() + rows_wait_s
        for unit in self.units:
            unit.drop(rows_deadline)
        for rp in self.replicated:
            rp.full.grad = None
        if self.outer is not None:
            self.outer.drop_unfinished()

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
        params += sum(nbytes(t) for u in self.units if u.optimizer_rows is not None
                      for t in u.optimizer_rows.buffers())  # [Note: rows between steps] in optimizer_rows.py
        params += sum(nbytes(u.full_flat) for u in self.units if u.pinned)  # whole on every rank, kept
        params += sum(nbytes(self.user_code.write_back_of(u).snapshot) for u in self.units
                      if u.pinned and u.params)  # [Note: masters moved outside a step] in user_code/write_back.py
        grads = 0
        for u in self.units:
            grads += nbytes(self.grads.of(u).accum)
            grads += sum(nbytes(t) for t in self.grads.of(u).residuals())  # error feedback
            grads += sum(nbytes(p.sharded.grad) for p in u.all_params())
            grads += sum(nbytes(rp.full.grad) for rp in u.replicated)
        opt = 0
        for o in optimizers:
            for st in o.state.values():
                opt += sum(nbytes(v) for v in st.values() if isinstance(v, Tensor) and v.dim() > 0)
        if self.outer is not None:  # the outer optimizer's: the anchors and their momentum
            opt += sum(nbytes(t) for t in self.outer.buffers())
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
