"""MiCSStrategy: Lightning glue only. The sharding itself lives in ``runtime.py``.

Lifecycle (same order as Lightning's DDP/ModelParallel strategies):
``__init__`` validates the options (scalars only) -> ``_configure_launcher`` checks the sharding degree
against the world before any process is launched -> ``setup_environment`` creates the process group and
the device mesh (once per strategy) -> ``setup`` shards the LightningModule, then lets its
``configure_optimizers`` build the optimizer over the DTensor shards -> the loops run through the hooks ->
``teardown``: see [Note: after fit].

[Note: after fit]
A model whose parameters fit in ``max_live_parameters`` (elements), without tensor parallelism, is made plain again at the end of every
``fit`` / ``validate`` / ``test`` / ``predict``: full parameters (gathered unit by unit from the fp32 masters)
back in the modules, and the optimizer re-pointed at them with its consolidated state, exactly what DDP
leaves. A larger model stays sharded, as FSDP2 leaves its
module: the parameters stay DTensors, calling the module gathers unit by unit (a collective: every rank calls
it), ``trainer.strategy.lightning_module_state_dict()`` and checkpoints work as during fit, and the next
``fit``/``validate``/``test`` on the same layout reuses the shards. After a failed ``fit`` the module is left
sharded the same way (without any collective: a peer may be gone), and a second ``fit`` picks it up.
``lightning_module_state_dict()`` is the full state dict on rank 0 and {} elsewhere, plain or sharded, as
Lightning's sharded strategies return it; so is ``optimizer_state()`` with ``state_dict_type="full"``.

[Note: optimizers follow the module]
Lightning keeps fit's optimizers on the strategy through a later ``validate``/``test``/``predict`` (and saves
them with ``trainer.save_checkpoint``), so every switch between plain and sharded re-points them: sharding a
plain module moves each optimizer that holds its parameters onto the new shards with its state cut to this
rank's rows, and making it plain gives them back the full parameters with the consolidated state. Module and
optimizers never disagree about which parameters exist, whatever the order of the entry points. Both switches
run under ``inference_mode(False)``: a ``with torch.inference_mode(): trainer.test(...)`` must not leave
inference tensors as parameters or shards, which a later ``fit`` could not train.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Generator, List, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning_mics import checkpoint as ckpt
from lightning_mics import collectives as C
from lightning_mics import checkpoint_files as files
from lightning_mics import reliability
from lightning_mics.clip import clip_grad_norm_
from lightning_mics.config import MiCSConfig, parse_dtype
from lightning_mics.precision import default_dtypes, to_mics_precision
from lightning_mics.materialize import has_meta
from lightning_mics.engine import MiCSEngine
from lightning_mics.sharding import resolve_classes
from lightning_mics import topology as T
from lightning_mics.topology import Topology, build_topology, plan_layout

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_log = logging.getLogger("lightning.pytorch.strategies.mics")  # shown the way Lightning's own INFO lines are
# The engine that shards a module, kept beside it (never inside: the module stays picklable).
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, MiCSEngine]" = weakref.WeakKeyDictionary()
# Checkpoint reads and writes go through DTensor and DCP, whose detach/copy refuse inference tensors: a user's
# ``with torch.inference_mode(): trainer.test(ckpt_path=...)`` runs them with inference mode off.
_outside_inference = torch.inference_mode(False)


def _format(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """"full" | "sharded" for a checkpoint dict written by this strategy; None for another strategy's."""
    info = checkpoint.get(files.MARKER)
    return info.get("format") if isinstance(info, Mapping) else None


class _MiCSModule(nn.Module):
    """Holds the LightningModule so that Lightning routes ``training_step`` & co. through ``forward``
    (its forward redirection), where the root unit's hooks gather and release the root's parameters."""

    def __init__(self, module: "pl.LightningModule") -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class MiCSStrategy(ParallelStrategy):
    """MiCS sharded data parallelism: model state sharded over s ranks, replicated r = world / s times.

    Options are those of :class:`lightning_mics.config.MiCSConfig` (SageMaker's ``sdp_*`` knobs).
    """

    strategy_name = "mics"

    def __init__(
        self,
        sharded_data_parallel_degree: Optional[int] = None,
        hierarchical_allgather: Optional[bool] = None,
        ranks_per_node: Optional[int] = None,
        reduce_bucket_size: int = 500_000_000,
        param_persistence_threshold: int = 1_000_000,
        max_live_parameters: int = 1_000_000_000,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        shard_optimizer_state: bool = False,
        tensor_parallel_degree: int = 1,
        prescaled_batch: bool = False,
        shard_units: Optional[List[Any]] = None,
        activation_checkpointing: Optional[List[Any]] = None,
        checkpoint_group_size: int = 1,
        activation_offload: bool = False,
        param_dtype: Optional[Any] = None,
        reduce_dtype: Optional[Any] = None,
        kernels: str = "auto",
        state_dict_type: str = "sharded",
        timeout: float = 1800.0,
        stop_on_nonfinite: bool = False,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: str = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.config = MiCSConfig(
            sharded_data_parallel_degree=sharded_data_parallel_degree,
            hierarchical_allgather=hierarchical_allgather, ranks_per_node=ranks_per_node,
            reduce_bucket_size=reduce_bucket_size, param_persistence_threshold=param_persistence_threshold,
            max_live_parameters=max_live_parameters, prefetch=prefetch,
            reshard_after_forward=reshard_after_forward, shard_optimizer_state=shard_optimizer_state,
            tensor_parallel_degree=tensor_parallel_degree, prescaled_batch=prescaled_batch, shard_units=shard_units,
            activation_checkpointing=activation_checkpointing, checkpoint_group_size=checkpoint_group_size,
            activation_offload=activation_offload, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            kernels=kernels, state_dict_type=state_dict_type, timeout=timeout,
            stop_on_nonfinite=stop_on_nonfinite,
        )
        # class names resolve now, before any process or collective, with the option named in the error
        resolve_classes(self.config.shard_units, "shard_units")
        resolve_classes(self.config.activation_checkpointing, "activation_checkpointing")
        if start_method not in _START_METHODS:
            raise ValueError(f"MiCSStrategy option start_method={start_method!r} is invalid: allowed is one of "
                             f"{_START_METHODS}.")
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._topology: Optional[Topology] = None
        self._engine: Optional[MiCSEngine] = None
        self._shard_size: Optional[int] = None
        self._step_hooks: List[Any] = []
        self._failed = False
        self._loaded_from = "checkpoint"
        self._warned_flat = False
        self.comm_stats: Dict[str, float] = {}

    # -- layout -------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: inserts a DistributedSampler over all W ranks."""
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """One sampler shard per rank; with ``prescaled_batch`` one per tensor-parallel group (its t ranks read
        the same batch: the data-parallel rank and size)."""
        world = self.num_nodes * self.num_processes
        if self.config.prescaled_batch:
            t = self.config.tensor_parallel_degree
            return {"num_replicas": world // t, "rank": self.global_rank // t}
        return {"num_replicas": world, "rank": self.global_rank}

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh with axes ("replicate", "shard") or, with tensor_parallel_degree > 1,
        ("replicate", "shard", "tp"): ``self.device_mesh["tp"]`` is what a ``configure_model`` parallelizes on
        (as under Lightning's ModelParallelStrategy)."""
        return self.topology.mesh

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("MiCSStrategy.topology is available after the process group is set up "
                               "(in or after LightningModule.setup / configure_model).")
        return self._topology

    @property
    def engine(self) -> MiCSEngine:
        if self._engine is None:
            raise RuntimeError("MiCSStrategy.engine exists once the strategy has set up the model.")
        return self._engine

    def _ranks_per_node(self) -> int:
        return self.config.ranks_per_node or max(self.num_processes, 1)

    def _validate_layout(self) -> int:
        world = self.num_nodes * self.num_processes
        self._shard_size = self.config.validate_world(world, self._ranks_per_node())
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
        if self.config.stop_on_nonfinite and self.precision_plugin.precision == "16-mixed":
            raise ValueError("MiCSStrategy option stop_on_nonfinite=True is invalid with precision='16-mixed': "
                             "allowed is False there (the loss scaler skips a step with inf/NaN gradients on every "
                             "rank and lowers the scale); True with any other precision.")
        if not self.cluster_environment.creates_processes_externally:
            if self._start_method == "popen":
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                           self.num_nodes)
            else:
                self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        s = self._validate_layout()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (self._process_group_backend
                                       or _get_default_process_group_backend_for_device(self.root_device))
        assert self.cluster_environment is not None
        kwargs: Dict[str, Any] = {"timeout": timedelta(seconds=self.config.timeout)}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        T.release_groups_at_exit()  # [Note: groups at exit] in topology.py
        # optimizer-state-only sharding places the shards over all W ranks ([Note: optimizer-state-only sharding])
        layout = plan_layout(self.world_size, self.world_size if self.config.shard_optimizer_state else s,
                             self._ranks_per_node(), self.config.tensor_parallel_degree)
        self._topology = build_topology(layout, self.root_device.type)
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._topology.mesh  # LightningModule.device_mesh
        _log.info(f"[rank {self.global_rank}] {self._topology.describe()}")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # -- model --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin = to_mics_precision(self.precision_plugin, self.root_device)
        self.precision_plugin._mics_clip = self.clip_grad_norm_
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._shard_model(fitting=trainer.state.fn == TrainerFn.FITTING)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._route_checkpoint_state(trainer)

    def _engine_options(self) -> Dict[str, Any]:
        param_default, reduce_default = default_dtypes(self.precision_plugin.precision)
        cfg = self.config
        return dict(shard_units=cfg.shard_units, persistence_threshold=cfg.param_persistence_threshold,
                    bucket_size=cfg.reduce_bucket_size,
                    param_dtype=parse_dtype("param_dtype", cfg.param_dtype) or param_default,
                    reduce_dtype=parse_dtype("reduce_dtype", cfg.reduce_dtype) or reduce_default,
                    kernels=cfg.kernels, device=self.root_device, prefetch=cfg.prefetch,
                    max_live_parameters=cfg.max_live_parameters, hierarchical=self._hierarchical(),
                    activation_checkpointing=cfg.activation_checkpointing,
                    checkpoint_group_size=cfg.checkpoint_group_size, activation_offload=cfg.activation_offload,
                    reshard_after_forward=cfg.reshard_after_forward, optimizer_state_only=cfg.shard_optimizer_state)

    def _hierarchical(self) -> bool:
        """Two hops whenever a shard group spans whole nodes, unless turned off; asked for where it cannot
        apply, one warning and the flat gather."""
        layout = self.topology.layout
        wanted = self.config.hierarchical_allgather
        if wanted and not layout.hierarchical_possible and not self._warned_flat:
            self._warned_flat = True
            rank_zero_warn(
                f"MiCSStrategy(hierarchical_allgather=True): a sharding group of {layout.shard_size} ranks "
                + ("interleaves with tensor-parallel ranks" if layout.tp_size > 1 else
                   "sits inside one node" if not layout.spans_nodes else "does not span whole nodes")
                + f" of {layout.ranks_per_node} ranks; using the flat all-gather.")
        return layout.hierarchical_possible and wanted is not False

    def _shard_model(self, fitting: bool) -> None:
        """[Note: optimizers follow the module]."""
        module = self.lightning_module
        options = self._engine_options()
        previous = _ENGINES.get(module)
        if previous is not None and previous.topo is self.topology and previous.options == options:
            previous.reset()  # still sharded alike (a failed fit, or a model kept sharded): reuse the shards
            self._engine = previous
        else:
            # a fit builds its optimizers afresh after this; validate/test/predict keep fit's, which follow
            optimizers = [] if fitting else self._optimizers_of(module)
            with torch.inference_mode(False):  # a user's inference_mode must not make the shards inference tensors
                if previous is not None:  # sharded under another layout or options: plain first (collective)
                    self._make_plain(previous, optimizers)
                names = {id(p): n for n, p in module.named_parameters()}
                states = [opt.state_dict() for opt in optimizers]
                self._engine = MiCSEngine(module, self.topology, **options)
                _ENGINES[module] = self._engine
                shards = dict(module.named_parameters())
                for opt, state in zip(optimizers, states):
                    for group in opt.param_groups:
                        group["params"] = [shards[names[id(p)]] for p in group["params"]]
                    opt.state.clear()
                    ckpt.load_full_optimizer_state(self._engine, opt, state)
        self.model = _MiCSModule(module)
        self._log_model_state()

    def _optimizers_of(self, module: nn.Module) -> List[torch.optim.Optimizer]:
        """The strategy's optimizers that hold only ``module``'s parameters (Lightning's, from the last fit)."""
        own = {id(p) for p in module.parameters()}
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        return [o for o in optimizers if all(id(p) in own for g in o.param_groups for p in g["params"])]

    def _log_model_state(self) -> None:
        """At start: the model-state bytes this rank will hold, against one unsharded copy."""
        held = self.engine.model_state_bytes()["params"]
        whole = sum(p.numel() * p.element_size() for p in self.engine.sharded_params())  # DTensor: global
        mib = 2.0 ** 20
        _log.info(f"[rank {self.global_rank}] MiCS model state on this rank: parameters {held / mib:.2f} MiB "
                  f"({held / max(whole, 1):.2f}x of {whole / mib:.2f} MiB unsharded); gradients as much again "
                  "in the master dtype, and the optimizer's state k times that (AdamW: k = 2)")

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        engine = self.engine
        ours = {id(p) for p in engine.sharded_params()}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in ours:
                        raise ValueError(
                            "MiCSStrategy: an optimizer holds a parameter that is not one of the module's own "
                            f"(shape {tuple(p.shape)}). Build optimizers in configure_optimizers from "
                            "self.parameters() (or named_parameters()), after the strategy has sharded the module; "
                            "parameters captured earlier (e.g. in __init__) are no longer the module's.")
            self._step_hooks.append(opt.register_step_post_hook(lambda *_: engine.after_optimizer_step()))

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
        t = self.config.tensor_parallel_degree
        if t > 1 and not self.config.prescaled_batch:
            batch = C.all_gather_batch(batch, self.topology.mesh.get_group("tp"), t)
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
        if self.config.stop_on_nonfinite:
            closure = self._checked(closure, optimizer)
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._publish_comm_stats()
        return out

    def _checked(self, closure: Any, optimizer: Any) -> Any:
        """``stop_on_nonfinite``: after the closure (the boundary micro-batch's forward and backward, gradients
        reduced), before clipping and the optimizer step, one small all-reduce decides on every rank alike."""
        trainer = self.lightning_module.trainer
        params = [p for g in getattr(optimizer, "_optimizer", optimizer).param_groups for p in g["params"]]

        def run() -> Any:
            loss = closure()
            reliability.check_finite(loss, params, trainer.global_step, self.root_device)
            return loss

        return run

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
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return clip_grad_norm_(params, max_norm, self.topology.mesh, norm_type)

    def model_state_bytes(self) -> Dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this rank."""
        return self.engine.model_state_bytes([getattr(o, "_optimizer", o) for o in self.optimizers])

    # -- collectives for the loops ------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- state --------------------------------------------------------------------------------------
    # [Note: checkpoint state]
    # ``lightning_module_state_dict()`` is the full state dict on rank 0 whatever ``state_dict_type`` is (DESIGN's
    # public contract). A checkpoint takes its model state from ``_checkpoint_model_state`` instead: ``setup``
    # points Lightning's checkpoint connector at it, so with "sharded" a save gathers nothing (the DTensor shards
    # themselves go to DCP) and with "full" it is ``lightning_module_state_dict()``. ``optimizer_state()`` follows
    # ``state_dict_type``, as in Lightning's ModelParallelStrategy: by parameter name with the shards, or full.
    # Loading reads either format whatever ``state_dict_type`` is; see checkpoint.py and checkpoint_files.py.
    def _sharded(self) -> bool:
        return self._engine is not None and _ENGINES.get(self.lightning_module) is self._engine

    def _saves_sharded(self) -> bool:
        return self.config.state_dict_type == "sharded"

    def _live_engine(self) -> Optional[MiCSEngine]:
        return self._engine if self._sharded() else None

    def _route_checkpoint_state(self, trainer: "pl.Trainer") -> None:
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is not None and hasattr(connector, "_get_lightning_module_state_dict"):
            connector._get_lightning_module_state_dict = self._checkpoint_model_state

    @_outside_inference
    def _checkpoint_model_state(self) -> Dict[str, Any]:
        if self._saves_sharded():
            return ckpt.model_state(self.lightning_module, self._live_engine())
        return self.lightning_module_state_dict()

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
        if _format(checkpoint) == "sharded":  # read in place by load_checkpoint; this applies on_load_checkpoint edits
            set_model_state_dict(self.lightning_module, checkpoint["state_dict"],
                                 options=StateDictOptions(strict=strict))
            return
        if not self._sharded():
            return super().load_model_state_dict(checkpoint, strict)
        self.engine.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self._saves_sharded():
            return ckpt.optimizer_state_by_name(self.lightning_module, optimizer, self._live_engine())
        if self._engine is None or not any(id(p) in {id(q) for q in self._engine.sharded_params()}
                                           for g in optimizer.param_groups for p in g["params"]):
            # after fit the optimizer is plain again: full on rank 0, {} elsewhere (as the sharded case)
            return super().optimizer_state(optimizer) if self.global_rank == 0 else {}
        return ckpt.full_optimizer_state(self.engine, optimizer, dst=0)

    @override
    @_outside_inference
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if _format(checkpoint) == "sharded":
            for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
                ckpt.load_optimizer_by_name(self.lightning_module, optimizer, state, self._loaded_from,
                                            self._live_engine())
            return
        if not self._sharded():
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            ckpt.load_full_optimizer_state(self.engine, optimizer, state)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states are loaded into the shards, which exist only after setup

    @override
    @_outside_inference
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """"sharded": every rank writes its shards into a directory through DCP; "full": rank 0 writes one file.
        Either is written under a temporary name and published by one rename ([Note: crash-safe save] in
        checkpoint_files.py)."""
        path_str, token = self.broadcast((str(filepath), ckpt.new_token()))
        local = "://" not in path_str
        if self._saves_sharded():
            if not local or storage_options is not None:
                raise ValueError(f"MiCSStrategy(state_dict_type='sharded') writes a directory on a local or shared "
                                 f"filesystem through torch.distributed.checkpoint, without storage_options; got "
                                 f"{path_str!r}, storage_options={storage_options!r}. Use state_dict_type='full' for "
                                 "a CheckpointIO plugin.")
            checkpoint["state_dict"] = self._as_sharded_state(checkpoint.get("state_dict"))
            layout = {"world_size": self.world_size, "shard_size": self._shard_size}
            ckpt.save_sharded(checkpoint, Path(path_str), token, coordinator=self.is_global_zero, layout=layout)
            return
        checkpoint[files.MARKER] = files.marker("full")
        if not self.is_global_zero:
            return
        if not local:
            self.checkpoint_io.save_checkpoint(checkpoint, path_str, storage_options=storage_options)
            return
        path = Path(path_str)
        files.prepare(path, token)
        tmp = files.temporary(path, token)
        self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        files.publish(tmp, path, token)

    def _as_sharded_state(self, state_dict: Any) -> Dict[str, Any]:
        """The state dict Lightning's dump handed over if it is the sharded one (keys and DTensor-ness match the
        module on every rank, so every rank decides alike); otherwise (a dump that did not go through
        ``_checkpoint_model_state``) the module's shards, read afresh."""
        own = ckpt.model_state(self.lightning_module, self._live_engine())
        if isinstance(state_dict, Mapping) and state_dict.keys() == own.keys() and all(
                isinstance(state_dict[k], DTensor) == isinstance(v, DTensor) for k, v in own.items()):
            return dict(state_dict)
        return own

    @override
    @_outside_inference
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """A sharded directory (read into this rank's shards from any saved layout: [Note: resharding] in
        checkpoint.py) or a full file. Every rank checks the files first, and all agree on the verdict before any
        collective touches the checkpoint ([Note: checks before collectives] in checkpoint_files.py)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        error, full, meta, index = None, None, None, None
        try:
            path = files.resolve(path)
            if path.is_dir():
                meta, index = files.check_sharded(path, weights_only)
                error = self._check_optimizer_count(path, meta)
            else:
                io = self.checkpoint_io
                full = files.load_full(path, weights_only,
                                       loader=lambda p: io.load_checkpoint(p, weights_only=weights_only))
        except files.CheckpointError as err:
            error = str(err)
        self._agree(error)
        self._loaded_from = str(path)
        if full is not None:
            return full
        assert meta is not None and index is not None
        optimizers = self._optimizers_to_restore(meta)
        module = self.lightning_module
        state = ckpt.load_sharded(path, index, module, optimizers, strict=module.strict_loading,
                                  weights_only=weights_only, engine=self._live_engine())
        meta["state_dict"] = state["state_dict"]
        if meta[files.MARKER].get("optimizers") is not None:
            meta["optimizer_states"] = [state[f"optimizer_{i}"] for i in range(len(optimizers))]
        return meta

    def _optimizers_to_restore(self, meta: Mapping[str, Any]) -> List[torch.optim.Optimizer]:
        trainer = self.lightning_module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if not fitting or meta[files.MARKER].get("optimizers") is None:
            return []
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    def _check_optimizer_count(self, path: Path, meta: Mapping[str, Any]) -> Optional[str]:
        saved = meta[files.MARKER].get("optimizers")
        wanted = len(self._optimizers_to_restore(meta))
        if saved is not None and wanted and wanted != saved:
            return f"{path}: holds the state of {saved} optimizer(s); configure_optimizers returned {wanted}."
        return None

    def _agree(self, error: Optional[str]) -> None:
        """Every rank raises the same CheckpointError if any rank found one ([Note: checks before collectives])."""
        if _distributed_is_initialized() and dist.get_world_size() > 1:
            errors: List[Optional[str]] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            failed = [r for r, e in enumerate(errors) if e]
            if failed:
                error = errors[failed[0]] + ("" if len(failed) == len(errors) else f" (found on rank(s) {failed})")
        if error:
            raise files.CheckpointError(error)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 removes a checkpoint file or directory (and the temporaries of dead saves to it)."""
        if not self.is_global_zero:
            return
        if "://" in str(filepath):
            return super().remove_checkpoint(filepath)
        files.remove(Path(filepath))

    # -- end ----------------------------------------------------------------------------------------
    def _fits_whole(self) -> bool:
        numel = sum(p.numel() for p in self.engine.sharded_params())  # DTensor: the global count
        return numel <= self.config.max_live_parameters

    @override
    def teardown(self) -> None:
        """[Note: after fit]."""
        for h in self._step_hooks:
            h.remove()
        self._step_hooks.clear()
        keep_sharded = False
        if self._engine is not None:
            if self._failed or not self._fits_whole() or self.topology.layout.tp_size > 1:
                self._engine.reset()  # every unit released; the module stays sharded, hooks on
                keep_sharded = True  # and the engine stays, for checkpoints and state dicts after fit
            else:
                self._restore_plain_state()
                _ENGINES.pop(self.lightning_module, None)
                self._engine = None
        if self._topology is not None and not any(e.topo is self._topology for e in _ENGINES.values()):
            T.release(self._topology)  # [Note: one topology per layout]
            self._topology = None
        self._failed = False
        if self.lightning_module is not None:
            self.model = self.lightning_module
        if keep_sharded:  # Lightning's teardown moves the module to CPU: not a sharded one (its mesh stays)
            self.precision_plugin.teardown()
            assert self.accelerator is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    def _restore_plain_state(self) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        with torch.inference_mode(False):
            self._make_plain(self.engine, optimizers)

    @staticmethod
    def _make_plain(engine: MiCSEngine, optimizers: List[torch.optim.Optimizer]) -> None:
        """Full parameters back in the module, and each optimizer re-pointed at them with its consolidated
        (full-shape) state, so module and optimizer are plain and consistent, as after DDP. Collective."""
        full_states = [ckpt.full_optimizer_state(engine, o, dst=None) for o in optimizers]
        mapping = engine.restore_module()
        for opt, state in zip(optimizers, full_states):
            for group in opt.param_groups:
                group["params"] = [mapping.get(id(p), p) for p in group["params"]]
            opt.state.clear()
            opt.load_state_dict(state)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no collective from here on: a peer may be gone
        if self._engine is not None:
            self._engine.reset()
        reliability.on_failure()  # [Note: a lone failure] in reliability.py

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("mics", cls, description="MiCS sharded data parallelism")
