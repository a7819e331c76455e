"""MiCSStrategy for Lightning Fabric: glue only, over the engine and ``frontends/shared.py`` (shared with the Trainer
strategy in ``frontends/trainer.py``), with the same options (:class:`lightning_mics.options.MiCSConfig`).

``import lightning_mics`` registers it as ``"mics"`` in Fabric's strategy registry, so
``L.Fabric(strategy="mics")`` works, as does ``L.Fabric(strategy=lightning_mics.fabric.MiCSStrategy(...))``.

[Note: Fabric's loop]
- ``fabric.setup(model, optimizer)`` shards the module (an engine per module, all on one mesh) and moves the
  optimizer, built over the plain parameters, onto the shards; so do ``setup_module`` and then ``setup_optimizers``
  of an optimizer over ``model.parameters()``. One built before ``setup_module`` and set up after it is refused (its
  parameters are no longer the module's). Under ``init_module(empty_init=True)`` setup materializes only this
  rank's shards ([Note: sharded initialization] in materialize.py).
- ``fabric.no_backward_sync(model, enabled=is_accumulating)`` around ``fabric.backward``: every backward
  reduce-scatters in the shard group into the sharded accumulator, and the replica all-reduce (MiCS's 2-hop sync)
  runs only at a backward outside the context or with ``enabled=False``; without the context every backward pays
  it, with the same sums. Gradients stay sharded throughout.
- ``fabric.clip_gradients`` clips by norm over the unsharded model's gradients (clip.py) or by value on the shards;
  the module called anywhere (evaluation, sampling) gathers its units as in training: full parameters.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Dict, Generator, List, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mics.frontends import fabric_checkpoint
from lightning_mics.frontends import shared
from lightning_mics.frontends.precision import sharded_scaler
from lightning_mics.frontends import reliability
from lightning_mics.frontends.fault_tolerance.groups import FaultTolerance, check_environment
from lightning_mics.frontends.keywords import config_from, with_options_signature
from lightning_mics.options import MiCSOptions
from lightning_mics.layout.materialize import has_meta
from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.layout.sharding import resolve_classes

_log = logging.getLogger("lightning.fabric.strategies.mics")
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
POSITION = "fault_tolerance"  # [Note: the job's position in Fabric checkpoints] in fault_tolerance/groups.py


def _fail(option: str, value: Any, allowed: str) -> None:
    raise ValueError(f"MiCSStrategy option {option}={value!r} is invalid under Fabric: allowed is {allowed}.")


class MiCSStrategy(shared.ProcessLayout, ParallelStrategy):
    """MiCS sharded data parallelism for Fabric: model state sharded over s ranks, replicated r = world / s
    times; the options of :class:`lightning_mics.options.MiCSConfig`."""

    strategy_name = "mics"

    @with_options_signature
    def __init__(self, *, accelerator: Optional[Any] = None, parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        self.options: MiCSOptions = config_from(options).freeze()  # [Note: one option list] in options.py
        shared.check_checkpoint_io(self.options, checkpoint_io)
        if self.options.tensor_parallel_degree != 1:
            _fail("tensor_parallel_degree", self.options.tensor_parallel_degree,
                  "1 (a tensor-parallel plan is applied by the Trainer strategy's configure_model)")
        resolve_classes(self.options.shard_units, "shard_units")
        resolve_classes(self.options.activation_checkpointing, "activation_checkpointing")
        self._process_group_backend = process_group_backend
        self._engines: List[MiCSEngine] = []
        self._step_hooks: List[Any] = []
        self._optimizers: List[Optimizer] = []  # set up, for teardown's plain switch
        self._steps = 0
        self._losses = reliability.Losses()  # stop_on_nonfinite
        self._backward_sync_control = _MiCSBackwardSync()
        self.comm_stats: Dict[str, float] = {}
        # [Note: fault-tolerant replica groups] in options.py: the managed group, once the optimizer is set up
        self.fault_tolerance: Optional[FaultTolerance] = None

    @ParallelStrategy.checkpoint_io.setter  # type: ignore[attr-defined]
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:  # L.Fabric(plugins=[io]) sets it here
        shared.check_checkpoint_io(self.options, io)
        self._checkpoint_io = io

    # -- layout -----------------------------------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        if self.options.fault_tolerance:  # this group's part of the data
            return FaultTolerance.sampler_part(self.num_nodes * self.num_processes, self.global_rank)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _check(self) -> int:
        """Every check that needs the world or the precision, before any process or collective."""
        precision = getattr(self.precision, "precision", None)
        if type(self.precision) not in (Precision, MixedPrecision, HalfPrecision) or precision not in _PRECISIONS:
            raise ValueError(f"Fabric precision plugin {type(self.precision).__name__} (precision={precision!r}) "
                             f"is not supported by MiCSStrategy: allowed precision is one of {_PRECISIONS}.")
        shared.check_before_launch(self.options, precision, self.root_device.type)
        if self.options.fault_tolerance:
            check_environment()
        return self.options.validate_world(self.num_nodes * self.num_processes, self._ranks_per_node())

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._check()
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._check()
        reset_seed()
        self.connect_and_mesh(_log)
        if self.precision.precision == "16-mixed":  # a step that overflows on any rank's shard is skipped on all
            self.precision.scaler = sharded_scaler(self.precision.scaler, self.root_device.type)

    # -- modules and optimizers -------------------------------------------------------------------------------
    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: List[Optimizer],
                                    scheduler: Optional[Any] = None) -> Any:
        """The module sharded and each optimizer moved onto its shards with its state (collective)."""
        module = self._shard(module, [shared.unwrap(o) for o in optimizers])
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._shard(module, [])

    def _shard(self, module: nn.Module, optimizers: List[Optimizer]) -> nn.Module:
        if self.fault_tolerance is not None:
            raise ValueError("MiCSStrategy(fault_tolerance=True) under Fabric: allowed is one module and one "
                             "optimizer; a second module was set up after the optimizer.")
        if any(e.root is module for e in self._engines):
            raise ValueError("MiCSStrategy: this module is already set up; allowed is one fabric.setup or "
                             "fabric.setup_module per module.")
        options = self.options.resolved(self.precision.precision, shared.hierarchical(self.options, self.topology))
        engine = shared.shard(module, self.topology, options, self.root_device, optimizers)
        self._engines.append(engine)
        shared.log_model_state(engine, self.global_rank, _log)
        engine.pin()  # ZeRO-1: plain parameters from setup on; an optimizer built from them is pointed at the shards
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer over a set-up module's shards: built after ``fabric.setup_module(model)`` from
        ``model.parameters()``, or passed with the model to ``fabric.setup``."""
        if not self._engines:
            raise ValueError("MiCSStrategy: fabric.setup_optimizers(optimizer) before any module was set up: set up "
                             "the module first (model = fabric.setup_module(model)), then build the optimizer from "
                             "model.parameters(), or pass both to fabric.setup(model, optimizer).")
        shared.point_at_shards(optimizer)
        engine = shared.engine_holding(optimizer)
        where = ("Set up the module first (model = fabric.setup_module(model)), then build the optimizer from "
                 "model.parameters() and call fabric.setup_optimizers(optimizer), or pass both to "
                 "fabric.setup(model, optimizer)")
        shared.check_optimizer(engine or self._engines[-1], optimizer, where)
        if engine is not None:
            self._step_hooks.extend(engine.user_code.watch(optimizer))
        self._optimizers.append(optimizer)
        if self.options.fault_tolerance:  # [Note: joining at the current step] in fault_tolerance/groups.py
            self._start_fault_tolerance(engine)
        return optimizer

    def _start_fault_tolerance(self, engine: Optional[MiCSEngine]) -> None:
        """One module and one optimizer; the first quorum now, before the loop's first forward."""
        if engine is None or len(self._engines) != 1 or self.fault_tolerance is not None:
            raise ValueError("MiCSStrategy(fault_tolerance=True) under Fabric: allowed is one module and one optimizer "
                             "over its parameters (one commit decision per step of the job).")
        self.fault_tolerance = FaultTolerance(self.root_device, self.options.timeout,
                                                 self.options.reduce_bucket_size)
        self.fault_tolerance.attach(engine, self._optimizers)
        self.fault_tolerance.quorum(now=True)  # under DiLoCo too: a joining group waits here for its peers' sync

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        if self.options.stop_on_nonfinite:
            self._losses.add(tensor)
        if self.fault_tolerance is not None and self._engines[0].sync_replicas:  # [Note: the cross-group average]
            self.fault_tolerance.average_gradients(self._engines[0])

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta(module):  # meta tensors are materialized as shards at setup
            module.to(self.root_device)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: on the meta device; each rank materializes only its shards."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    # -- the step ---------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.options.stop_on_nonfinite:
            reliability.checked(lambda: None, shared.unwrap(optimizer), lambda: self._steps, self.root_device,
                                self._losses)()
        engine = shared.engine_holding(shared.unwrap(optimizer))
        step = nullcontext()
        # [Note: evaluations inside a step] in user_code/boundary.py
        if engine is not None and kwargs.get("closure") is not None:
            kwargs["closure"], step = engine.user_code.evaluations(kwargs["closure"]), engine.user_code.closure_step()
        with step:
            ft = self.fault_tolerance
            if ft is not None and ft.outer is not None:  # [Note: DiLoCo across fault-tolerant groups]: the sync's
                out = super().optimizer_step(optimizer, **kwargs)  # decision is in the step; the quorum is formed
                ft.stepped()  # only when the next step is a sync step
                ft.quorum()
            elif ft is not None:  # [Note: a step not taken] in fault_tolerance/groups.py; the next quorum now
                out = super().optimizer_step(optimizer, **kwargs) if ft.commit() else None
                ft.quorum()
            else:
                out = super().optimizer_step(optimizer, **kwargs)
        self._steps += 1
        if engine is not None:
            self.comm_stats = engine.log.step_summary()
        return out

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """The norm of the unsharded model's gradients, reduced over the shard group (the same on every rank)."""
        self.precision.unscale_gradients(optimizer)
        total = shared.clip_norm(optimizer, float(max_norm), self.topology, float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients is non-finite, so it cannot "
                               "be clipped (fabric.clip_gradients(..., error_if_nonfinite=False) clips anyway).")
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        shared.clip_value([p for g in optimizer.param_groups for p in g["params"]], float(clip_val))

    # -- collectives for the loop -----------------------------------------------------------------------------
    @override
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None,
                   reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- state: [Note: Fabric checkpoints] in fabric_checkpoint.py --------------------------------------------
    @override
    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Any]] = None) -> None:
        if self.fault_tolerance is not None:  # [Note: the job's position in Fabric checkpoints]
            if POSITION in state:
                raise ValueError(f"MiCSStrategy(fault_tolerance=True): fabric.save got a state with the key "
                                 f"{POSITION!r}: allowed are other keys (it holds the job's position).")
            state = {**state, POSITION: self.fault_tolerance.position()}
        fabric_checkpoint.save(self, path, state, storage_options, filter)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        remainder = fabric_checkpoint.load(self, path, state, strict, weights_only)
        if self.fault_tolerance is not None and isinstance(state, dict) and POSITION in remainder:
            self.fault_tolerance.restore_position(remainder.pop(POSITION), path)
        for engine in self._engines:  # a load released ZeRO-1's pinned units: gathered again from the loaded masters
            engine.pin()
        return remainder

    @override
    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """The full state dict (fp32 masters) on rank 0, {} elsewhere. Collective."""
        engine = shared.engine_of(module)
        if engine is None:
            return super().get_module_state_dict(module)
        return engine.full_state_dict(dst=0)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        fabric_checkpoint._load_module(module, state_dict, strict)
        engine = shared.engine_of(module)
        if engine is not None:
            engine.pin()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """``fabric_optimizer.state_dict()``: the optimizer's own state dict on every rank, its state the DTensor
        shards, without a collective: as ``fabric_model.state_dict()`` and as under Lightning's ModelParallel
        (FSDP2) strategy, so torch's ``get_optimizer_state_dict(model, optimizer)`` works on the Fabric wrapper and a
        call on one rank alone cannot hang. The full state: ``fabric.save`` with ``state_dict_type="full"``, or
        torch's API with ``StateDictOptions(full_state_dict=True)``."""
        return shared.unwrap(optimizer).state_dict()

    def model_state_bytes(self, module: nn.Module, optimizers: List[Optimizer] = ()) -> Dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds for ``module``."""
        return shared.engine_of(module).model_state_bytes([shared.unwrap(o) for o in optimizers])

    @override
    def teardown(self) -> None:
        """Every module whose parameters fit in ``max_live_parameters`` plain again, its optimizers re-pointed
        ([Note: after fit] in frontends/shared.py). Collective; Fabric itself never calls it."""
        for h in self._step_hooks:
            h.remove()
        self._step_hooks.clear()
        for engine in self._engines:
            optimizers = [o for o in self._optimizers if shared.engine_holding(o) is engine]
            shared.finish(engine, self.options, optimizers, failed=False)
        self._engines.clear()
        self._optimizers.clear()
        self._topology = shared.release_unused(self._topology)
        if self.fault_tolerance is not None:
            self.fault_tolerance.shutdown()
            self.fault_tolerance = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("mics", cls, description="MiCS sharded data parallelism")


class _MiCSBackwardSync(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """Inside (``enabled``): reduce-scatter in the sharding group only, the replica all-reduce deferred to
        the first backward outside ([Note: Fabric's loop])."""
        return _deferred(module, enabled)


@contextmanager
def _deferred(module: nn.Module, enabled: bool) -> Generator[None, None, None]:
    engine = shared.engine_of(module)
    if engine is None:
        raise ValueError("MiCSStrategy: fabric.no_backward_sync(model) needs a model set up by this strategy "
                         "(fabric.setup or fabric.setup_module).")
    if not enabled:
        yield
        return
    engine.sync_replicas = False
    try:
        yield
    finally:
        engine.sync_replicas = True
