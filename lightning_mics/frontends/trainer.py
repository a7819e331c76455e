"""MiCSStrategy for the Trainer: Lightning glue only. The sharding lives in the engine (ARCHITECTURE.md).

Lifecycle (same order as Lightning's DDP/ModelParallel strategies):
``__init__`` validates the options (scalars only) -> ``_configure_launcher`` checks the sharding degree
against the world before any process is launched -> ``setup_environment`` creates the process group and
the device mesh (once per strategy) -> ``setup`` shards the LightningModule, then lets its
``configure_optimizers`` build the optimizer over the DTensor shards -> the loops run through the hooks ->
``teardown``: see [Note: after fit] in frontends/shared.py. What the Fabric strategy (``fabric.py``) shares with this one
(layout, engine construction, the plain<->sharded switches, clipping, teardown) lives in ``frontends/shared.py``; the
checkpoint hooks are functions in ``frontends/trainer_checkpoint.py``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Generator, List, Mapping, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning_mics.comm import collectives
from lightning_mics.frontends import shared
from lightning_mics.frontends import layer_sync
from lightning_mics.frontends import reliability
from lightning_mics.frontends import trainer_checkpoint
from lightning_mics.frontends import weight_averaging
from lightning_mics.frontends.fault_tolerance.groups import FaultTolerance, check_environment
from lightning_mics.frontends.fault_tolerance import trainer_quorum
from lightning_mics.frontends.keywords import config_from, with_options_signature
from lightning_mics.options import MiCSOptions
from lightning_mics.frontends.precision import to_mics_precision
from lightning_mics.layout.materialize import has_meta
from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.layout.sharding import resolve_classes

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
# callbacks that copy or re-register the module's parameters behind the engine: refused at setup
_UNSUPPORTED_CALLBACKS = (
    (ModelPruning, "it replaces each pruned parameter with a '_orig' parameter and a mask, behind the engine that "
                   "holds the parameters, and ranks the weights over whole tensors the ranks hold in shards"),
)
_log = logging.getLogger("lightning.pytorch.strategies.mics")  # shown the way Lightning's own INFO lines are
# Checkpoint reads and writes go through DTensor and DCP, whose detach/copy refuse inference tensors: a user's
# ``with torch.inference_mode(): trainer.test(ckpt_path=...)`` runs them with inference mode off.
_outside_inference = torch.inference_mode(False)


class _MiCSModule(nn.Module):
    """Holds the LightningModule so that Lightning routes ``training_step`` & co. through ``forward``
    (its forward redirection), where the root unit's hooks gather and release the root's parameters."""

    def __init__(self, module: "pl.LightningModule") -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class MiCSStrategy(shared.ProcessLayout, ParallelStrategy):
    """MiCS sharded data parallelism: model state sharded over s ranks, replicated r = world / s times.

    Options are those of :class:`lightning_mics.options.MiCSConfig` (SageMaker's ``sdp_*`` knobs).
    """

    strategy_name = "mics"

    @with_options_signature
    def __init__(
        self,
        *,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
        **options: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.options: MiCSOptions = config_from(options).freeze()  # [Note: one option list] in options.py
        self._losses = reliability.Losses()  # stop_on_nonfinite
        shared.check_checkpoint_io(self.options, checkpoint_io)
        # class names resolve now, before any process or collective, with the option named in the error
        resolve_classes(self.options.shard_units, "shard_units")
        resolve_classes(self.options.activation_checkpointing, "activation_checkpointing")
        if start_method not in _START_METHODS:
            raise ValueError(f"MiCSStrategy option start_method={start_method!r} is invalid: allowed is one of "
                             f"{_START_METHODS}.")
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._engine: Optional[MiCSEngine] = None
        self._layer_sync: Optional[LayerSync] = None  # Trainer(sync_batchnorm=True) sets it: [Note: layer sync]
        self._shard_size: Optional[int] = None
        self._step_hooks: List[Any] = []
        self._failed = False
        self._loaded_from = "checkpoint"
        self.comm_stats: Dict[str, float] = {}
        # [Note: fault-tolerant replica groups] in options.py: the managed group, while a fit runs
        self.fault_tolerance: Optional[FaultTolerance] = None
        self.fault_tolerance_summary: Optional[Dict[str, Any]] = None  # the last fit's quorum, for reports

    config = property(lambda self: self.options, doc="The options (``self.options``), read-only.")

    @ParallelStrategy.checkpoint_io.setter  # type: ignore[attr-defined]
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:  # Trainer(plugins=[io]) sets it here
        shared.check_checkpoint_io(self.options, io)
        self._checkpoint_io = io

    # -- layout -------------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: inserts a DistributedSampler over all W ranks."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """One sampler shard per rank; with ``prescaled_batch`` one per tensor-parallel group (its t ranks read
        the same batch: the data-parallel rank and size)."""
        world = self.num_nodes * self.num_processes
        trainer = getattr(self.lightning_module, "_trainer", None)  # training data: this group's part; evaluation:
        if self.options.fault_tolerance and (trainer is None or trainer.training):  # over its ranks, as one job
            return FaultTolerance.sampler_part(world, self.global_rank)
        if self.options.prescaled_batch:
            t = self.options.tensor_parallel_degree
            return {"num_replicas": world // t, "rank": self.global_rank // t}
        return {"num_replicas": world, "rank": self.global_rank}

    @property
    def engine(self) -> MiCSEngine:
        if self._engine is None:
            raise RuntimeError("MiCSStrategy.engine exists once the strategy has set up the model.")
        return self._engine

    def _validate_layout(self) -> int:
        world = self.num_nodes * self.num_processes
        self._shard_size = self.options.validate_world(world, self._ranks_per_node())
        return self._shard_size

    # -- processes ----------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            # Lightning checks devices x num_nodes against the launcher's world only in its own launcher; under
            # torchrun (or srun) a mismatch would otherwise surface at setup as a misleading layout error
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._validate_layout()  # before any process is launched: every rank would raise alike anyway
        if self.options.fault_tolerance:
            check_environment()
        shared.check_before_launch(self.options, self.precision_plugin.precision, self.root_device.type)
        if not self.cluster_environment.creates_processes_externally:
            if self._start_method == "popen":
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                           self.num_nodes)
            else:
                self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._validate_layout()
        reset_seed()
        topology = self.connect_and_mesh(_log)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = topology.mesh  # LightningModule.device_mesh

    # -- model --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        refused = [f"{type(cb).__name__} ({why})" for cb in trainer.callbacks  # every rank alike, before any collective
                   for kinds, why in _UNSUPPORTED_CALLBACKS if isinstance(cb, kinds)]
        if refused:
            raise ValueError(f"MiCSStrategy: callbacks not supported: {'; '.join(refused)}. Allowed: none of these.")
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:  # [Note: layer sync] in layer_sync.py
            self.model = layer_sync.apply(self._layer_sync, self.model, shared.engine_of(self.lightning_module) is not None,
                                          self.root_device)
        self.precision_plugin = to_mics_precision(self.precision_plugin, self.root_device)
        self.precision_plugin._mics_clip = self.clip_grad_norm_
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._shard_model(fitting=fitting)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()  # wraps the optimizers in LightningOptimizers (again)
        if fitting:  # their zero_grad is torch's, run on the wrapper: not the hook on the optimizer
            self._step_hooks.extend(self.engine.user_code.follow_zero_grad(opt) for opt in self._lightning_optimizers)
        trainer_checkpoint.route(self, trainer)
        self.engine.pin()  # ZeRO-1: plain parameters from on_fit_start on, as under DDP
        if fitting:  # [Note: weight averaging over the shards] in weight_averaging.py
            self._step_hooks.extend(weight_averaging.shard_averages(trainer, self.lightning_module, self.engine.units))
        if fitting and self.options.fault_tolerance:  # [Note: joining at the current step] in fault_tolerance/groups.py
            self.fault_tolerance = trainer_quorum.start(
                trainer, self.engine, [shared.unwrap(o) for o in self.optimizers], self.root_device, self.options)

    def _engine_options(self) -> MiCSOptions:
        return self.options.resolved(self.precision_plugin.precision, shared.hierarchical(self.options, self.topology))

    def _shard_model(self, fitting: bool) -> None:
        """[Note: optimizers follow the module] in frontends/shared.py: a fit builds its optimizers afresh after this;
        validate/test/predict keep fit's, which follow the module onto the shards."""
        module = self.lightning_module
        optimizers = [] if fitting else shared.optimizers_of(module, self.optimizers)
        self._engine = shared.shard(module, self.topology, self._engine_options(), self.root_device, optimizers)
        self.model = _MiCSModule(module)
        shared.log_model_state(self._engine, self.global_rank, _log)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        engine = self.engine
        for opt in self.optimizers:
            shared.point_at_shards(shared.unwrap(opt))
            shared.check_optimizer(engine, shared.unwrap(opt), "Build optimizers in configure_optimizers from "
                              "self.parameters() (or named_parameters()), after the strategy has sharded the module")
            self._step_hooks.extend(engine.user_code.watch(shared.unwrap(opt)))
        self.precision_plugin._mics_engine = engine  # [Note: evaluations inside a step] in user_code/boundary.py

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not has_meta(self.model):  # meta tensors are materialized as shards ([Note: sharded initialization])
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: on the meta device, materialized as shards at setup."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """With tensor parallelism and without ``prescaled_batch``, each rank read its own batch: the t ranks
        of a tensor-parallel group must compute on the same one, so their batches are concatenated (SageMaker's
        behaviour; the global batch stays W x the per-rank batch)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        t = self.options.tensor_parallel_degree
        if t > 1 and not self.options.prescaled_batch:
            batch = collectives.all_gather_batch(batch, self.topology.mesh.get_group("tp"), t)
        return batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Counts the bytes autograd keeps for backward (telemetry: ``mem/saved_for_backward_bytes``); hooks the
        user installs inside the step take precedence, as saved-tensor hooks nest."""
        log = self._engine.log if self._engine is not None else None
        if log is None:
            return super().training_step(*args, **kwargs)

        def pack(t: Tensor) -> Tensor:
            log.saved(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return super().training_step(*args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches inside gradient accumulation: reduce-scatter in the shard group only; the replica
        all-reduce waits for the accumulation boundary (MiCS 2-hop sync)."""
        engine = self.engine
        engine.sync_replicas = False
        try:
            yield
        finally:
            engine.sync_replicas = True

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        if self.options.stop_on_nonfinite:
            closure = reliability.checked(closure, shared.unwrap(optimizer), lambda t=self.lightning_module.trainer:
                                          t.global_step, self.root_device, self._losses)
        if self.fault_tolerance is not None:  # [Note: a step not taken] in fault_tolerance/groups.py
            out = self.fault_tolerance.step(closure, lambda c: ParallelStrategy.optimizer_step(
                self, optimizer, c, model, **kwargs))
        else:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._publish_comm_stats()
        return out

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """The loss for stop_on_nonfinite; [Note: the cross-group average] in fault_tolerance/groups.py."""
        if self.options.stop_on_nonfinite:
            self._losses.add(closure_loss)
        if self.fault_tolerance is not None and self._engine is not None and self._engine.sync_replicas:
            self.fault_tolerance.average_gradients(self._engine)

    def _publish_comm_stats(self) -> None:
        """Per optimizer step: bytes and calls per collective and group (``comm/<op>/<group>/bytes``)
        and the gathered-elements peak; kept in ``self.comm_stats`` for callbacks and sent to the loggers."""
        self.comm_stats = self.engine.log.step_summary()
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is None or self.global_rank != 0 or not trainer.loggers:
            return
        step = trainer.global_step
        if step % max(trainer.log_every_n_steps, 1) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(self.comm_stats, step=step)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        return shared.clip_norm(optimizer, max_norm, self.topology, norm_type)

    def model_state_bytes(self) -> Dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this rank."""
        return self.engine.model_state_bytes([shared.unwrap(o) for o in self.optimizers])

    # -- collectives for the loops ------------------------------------------------------------------
    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- state: [Note: checkpoint state] in frontends/trainer_checkpoint.py ---------------------------------------
    def _sharded(self) -> bool:
        return self._engine is not None and shared.engine_of(self.lightning_module) is self._engine

    def _live_engine(self) -> Optional[MiCSEngine]:
        return self._engine if self._sharded() else None

    @_outside_inference
    def _checkpoint_model_state(self) -> Dict[str, Any]:
        return trainer_checkpoint.checkpoint_model_state(self)

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """The full state dict with the module's own keys, fp32 masters, on rank 0 ({} elsewhere). Built unit
        by unit; only rank 0's shard group takes part, and no other rank holds more than its shards."""
        if not self._sharded():
            return super().lightning_module_state_dict() if self.global_rank == 0 else {}
        return self.engine.full_state_dict(dst=0)

    @override
    @_outside_inference
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        trainer_checkpoint.load_model_state_dict(self, checkpoint, strict)
        if self._live_engine() is not None:
            self.engine.pin()  # the load released ZeRO-1's pinned unit: gathered again from the loaded masters

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return trainer_checkpoint.optimizer_state(self, optimizer)

    @override
    @_outside_inference
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        trainer_checkpoint.load_optimizer_state_dict(self, checkpoint)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states are loaded into the shards, which exist only after setup

    @override
    @_outside_inference
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        trainer_checkpoint.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    @_outside_inference
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        return trainer_checkpoint.load_checkpoint(self, checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        trainer_checkpoint.remove_checkpoint(self, filepath)

    # -- end ----------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """[Note: after fit] in frontends/shared.py."""
        for h in self._step_hooks:
            h.remove()
        self._step_hooks.clear()
        self.precision_plugin._mics_engine = None
        keep_sharded = False
        if self._engine is not None:
            optimizers = [shared.unwrap(o) for o in self.optimizers]
            keep_sharded = shared.finish(self._engine, self.options, optimizers, self._failed)
            if not keep_sharded:
                self._engine = None
        self._topology = shared.release_unused(self._topology)
        self._failed = False
        trainer_quorum.stop(self, wait=True)
        if self.lightning_module is not None:
            self.model = self.lightning_module
            if self._layer_sync is not None and shared.engine_of(self.lightning_module) is None:
                self.model = layer_sync.revert(self._layer_sync, self.model)  # [Note: layer sync]
        if keep_sharded:  # Lightning's teardown moves the module to CPU: not a sharded one (its mesh stays)
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no collective from here on: a peer may be gone
        engine = self._engine

        def reset(on_every_rank: bool) -> None:  # [Note: rows when a run ends] in optimizer_rows.py
            if engine is not None:
                engine.reset(rows_wait_s=reliability.GRACE_S if on_every_rank else 0.0)

        trainer_quorum.stop(self, wait=False)  # the other groups' traffic with this one fails at once
        reliability.on_failure(reset)  # [Note: a lone failure] in reliability.py

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("mics", cls, description="MiCS sharded data parallelism")
