"""The module and autograd hooks: they tell the schedule, the units and the gradient path what happens, and
decide nothing themselves (FSDP2's ``FSDPState`` role).

[Note: one optimizer step]
forward, unit by unit:  the outermost entry into a unit (for the root: any module holding a root parameter) waits
                        for its all-gather (prefetched, or issued now), swaps the full parameters in and prefetches
                        the next units ([Note: prefetch] in schedule.py); the last nested return releases the unit
                        (or keeps it for backward) and hooks its outputs.
backward, reverse:      a hook on those outputs gathers it again; when an autograd function on its inputs fires
                        (inputs needing no gradient: when every trainable parameter's gradient has accumulated),
                        its gradients are reduce-scattered (async, shard group) into its accumulator and the unit
                        is released (gradients.py).
end of backward:        a callback reduces the rest; at an accumulation boundary only (block_backward_sync marks the
                        others) it all-reduces the accumulators over the replicas (MiCS's 2-hop sync) and replicated
                        gradients over the world, and adds the sums into the DTensors' ``.grad`` (unzeroed ones accumulate).
optimizer step:         the user's optimizer steps the DTensor shards ([Note: placement] in placement.py); after it
                        ([Note: steps the engine hears of] in user_code/optimizer_watch.py) a unit still gathered
                        (a manual step inside the root's forward) is refreshed and stale prefetches are dropped
                        (``Schedule.after_optimizer_step``). User code between these events reaches the engine
                        through [Note: the user-code boundary] in user_code/boundary.py.

[Note: hooks under torch.compile]
Dynamo would trace into the forward hooks (they wait on collectives, resize storages, swap module attributes and wrap
inputs in an autograd Function) and fail there. They are ``torch.compiler.disable``d, as FSDP2 has dynamo skip its own
hooks: a compiled model breaks its graph at each unit's entry and exit, runs the hook eagerly and compiles what lies
between. The backward hooks (tensor hooks, post-accumulate-grad hooks, the end-of-backward callback) run in the autograd
engine, outside dynamo. Compiled autograd would trace them: the first backward hook refuses it with a RuntimeError on
every rank (traced, they fail inside dynamo at ``queue_callback`` without ``fullgraph``, and hang with it).

[Note: calls outside the precision's context]
Under a mixed precision (``param_dtype`` narrower than the masters' dtype) the units lend ``param_dtype`` copies,
and the forwards run under the precision's autocast: Lightning's step contexts, Fabric's module. A call from
outside them (a callback that calls a submodule on an fp32 tensor, ``fabric_model.module(x)``) would meet bf16
weights without autocast and fail (``mat1 and mat2 must have the same dtype``), where DDP's fp32 weights compute
it. So an outermost entry into a unit while autocast is off runs that call under autocast in ``param_dtype``, as
the training forward runs: the layers autocast keeps in fp32 (a LayerNorm, its weights possibly replicated fp32)
stay so, fp32 inputs are cast where a matmul meets the copies, and the output is what a training forward's is.
The context is left when that call returns or raises (the post-forward hook runs on both). Inside the
precision's context nothing changes.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch._dynamo import compiled_autograd
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_mics.engine.gradients import GradientPath
from lightning_mics.layout.placement import ReplicatedParam
from lightning_mics.engine.schedule import Schedule
from lightning_mics.engine.unit import ShardedState, Unit, in_backward
from lightning_mics.engine.user_code.boundary import UserCodeBoundary


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


class Hooks:
    """Registers the hooks of every unit on its entry modules ([Note: one optimizer step]) and removes them."""

    def __init__(self, units: List[Unit], entries: Sequence[List[nn.Module]], schedule: Schedule,
                 grads: GradientPath, user_code: UserCodeBoundary, owner: Any = None) -> None:
        self.units, self.root = units, units[0]
        self.user_code = user_code  # [Note: the user-code boundary] in user_code/boundary.py
        self.owner = owner  # held by the hooks, so by the modules: [Note: engines beside their modules] (frontends/shared.py)
        self.schedule, self.grads = schedule, grads
        self._callback_queued = False
        self._handles: List[Any] = []
        self._autocast: Dict[int, Any] = {}  # [Note: calls outside the precision's context]
        for unit, modules in zip(units, entries):
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(
                    self._make_pre_forward(unit), with_kwargs=True, prepend=True))
                self._handles.append(module.register_forward_hook(
                    self._make_post_forward(unit), with_kwargs=True, always_call=True))
            unit.on_accumulated = self._make_accumulated(unit)
            unit.on_replicated = self._replicated_ready

    # -- forward ----------------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit) -> Callable:
        @torch.compiler.disable  # [Note: hooks under torch.compile]
        def hook(module: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
            if in_backward():  # recomputation inside backward (activation checkpointing): gather if released
                self.schedule.gather_for_recompute(unit)
                return args, kwargs
            if not unit.enter_forward():  # a nested call (manual optimization's forward inside the root's)
                self.user_code.forward_entered(unit, outermost=False)
                return args, kwargs
            self._enter_precision(unit)
            if unit is self.root:
                self._begin_iteration()
            self.schedule.on_forward(unit)
            was_gathered = unit.state is ShardedState.GATHERED
            unit.finish_gather()
            unit.begin_forward()
            self.user_code.forward_entered(unit, outermost=True, was_gathered=was_gathered)
            if not torch.is_grad_enabled():
                return args, kwargs
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
            if idx:
                unit.expect_post_backward()
                outs = _PostBackward.apply(lambda: self._post_backward(unit), *(flat[i] for i in idx))
                for i, t in zip(idx, outs):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
            return args, kwargs
        return hook

    def _make_post_forward(self, unit: Unit) -> Callable:
        @torch.compiler.disable
        def hook(module: nn.Module, args: Tuple, kwargs: Dict, output: Any) -> Any:
            if in_backward() or not unit.exit_forward():
                return output
            self._leave_precision(unit)
            grad = torch.is_grad_enabled()
            self.schedule.after_forward(unit, grad)
            if unit.state is ShardedState.GATHERED:
                self.user_code.unit_kept(unit, window_ended=False)
            if grad and output is not None:
                flat, _ = tree_flatten(output)
                for t in flat:
                    if isinstance(t, Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
            return output
        return hook

    def _enter_precision(self, unit: Unit) -> None:
        """[Note: calls outside the precision's context]"""
        device = unit.device.type
        if unit.param_dtype.itemsize >= unit.dtype.itemsize or torch.is_autocast_enabled(device):
            return
        ctx = torch.autocast(device, dtype=unit.param_dtype)
        ctx.__enter__()
        self._autocast[id(unit)] = ctx

    def _leave_precision(self, unit: Unit) -> None:
        ctx = self._autocast.pop(id(unit), None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _begin_iteration(self) -> None:
        """The root is entered from outside any forward: forget what a forward without backward left."""
        for unit in self.units:
            unit.clear_counters()
        self.user_code.iteration_begins()
        self.schedule.begin_iteration()

    # -- backward ---------------------------------------------------------------------------------------
    def _make_pre_backward(self, unit: Unit) -> Callable:
        def hook(grad: Tensor) -> Tensor:
            self._queue_end_of_backward()
            if unit.begin_backward():
                self.user_code.backward_started(unit)
                self.schedule.on_backward(unit)
            unit.finish_gather()
            self.grads.mark(unit)
            return grad
        return hook

    def _make_accumulated(self, unit: Unit) -> Callable:
        def hook(param: Tensor) -> None:
            self._queue_end_of_backward()
            self.grads.mark(unit)
            # a unit whose inputs needed no gradient has no post-backward: ``Unit.grad_accumulated``
            if unit.grad_accumulated() and self.grads.reduce_now():
                self._backward_done(unit)
        return hook

    def _replicated_ready(self, rp: ReplicatedParam) -> None:
        self._queue_end_of_backward()
        self.grads.replicated_ready(rp)

    def _post_backward(self, unit: Unit) -> None:
        if unit.post_backward_fired():
            self._backward_done(unit)

    def _backward_done(self, unit: Unit) -> None:
        """The unit's backward is complete: its gradients are reduced, then it is released if the schedule
        says so."""
        boundary = self.grads.sync_replicas
        self.user_code.grads_read()
        unit.finish_backward()  # first: the reduction may start the unit's replica all-reduce right away
        if self.grads.needs_reduce(unit) and self.grads.reduce_now():
            self.grads.reduce(unit, releasing=self.schedule.releases_after_backward(unit, boundary))
        self._after_backward(unit, boundary)

    def _after_backward(self, unit: Unit, boundary: bool) -> None:
        self.schedule.after_backward(unit, boundary)
        if unit.state is ShardedState.GATHERED:
            self.user_code.unit_kept(unit, window_ended=boundary)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            if compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region:
                raise RuntimeError("MiCSStrategy cannot run under compiled autograd: its backward hooks wait on "
                                   "collectives and queue an end-of-backward callback, which compiled autograd "
                                   "does not trace. Allowed: torch.compile of the model with an eager backward "
                                   "(no torch._dynamo.compiled_autograd._enable around backward, "
                                   "torch._dynamo.config.compiled_autograd=False).")
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        boundary = self.grads.sync_replicas
        self.user_code.grads_read()
        for unit in reversed(self.units):  # same order on every rank
            self.grads.end_of_backward(unit, releasing=self.schedule.releases_after_backward(unit, boundary))
            self._after_backward(unit, boundary)
            unit.end_backward()
        self.grads.drain()
        self.schedule.end_backward()
        if boundary:
            self.grads.sync()
            self.user_code.boundary_published()

    # -- teardown ---------------------------------------------------------------------------------------
    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for unit in self.units:
            unit.remove_hooks()
        self.user_code.remove()

    def reset(self) -> None:
        """After an exception: no end-of-backward callback is pending any more."""
        self._callback_queued = False
