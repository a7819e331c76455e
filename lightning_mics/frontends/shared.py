"""What both front ends need, below both: the Trainer strategy (``frontends/trainer.py``) and the Fabric strategy
(``fabric.py``) are glue over these functions and the engine.

- layout: the ranks, their devices and the mesh (``ProcessLayout``, mixed into both strategies), the sharding
  degree checked against the world before any process or group;
- engine construction: a module sharded (or its shards reused), optimizers moved onto the shards;
- the plain<->sharded switches ([Note: optimizers follow the module]);
- clipping by norm (reduced over the shard group: clip.py) and by value (elementwise: on the shards as they are);
- teardown: plain again when the model fits, otherwise left sharded ([Note: after fit]).

Every module that has been sharded is found through ``engine_of`` ([Note: engines beside their modules]). A front
end may hold several (Fabric: a GAN's generator and discriminator), all on one ``Topology``.

[Note: engines beside their modules]
``ENGINES`` maps a sharded module to a weak reference to its engine, as FSDP2's ``_module_state_mapping`` does, and
the module keeps the engine alive through its hooks (``Hooks.owner``). An engine refers to its module in many
places (``root``, the root unit, parameters' owners), so a strong value would keep the key alive for good: every
module ever sharded, with its shards, gradients and buffers, held to the end of the process, whatever the user
dropped (a Fabric loop set up again in a notebook, a model kept sharded after ``fit``, a ``fit`` that failed).
With the weak value, a module dropped by the user and by the front ends goes with its engine, while a module
left sharded after ``fit`` still finds its engine in the next one (it holds it). The parameters' gradient hooks
call their unit through weak references (``unit._weak_hook``): autograd keeps them from C++, where Python's gc
cannot see them, so a strong one would hold the unit, and through it everything, as a root. Nothing of the
engine is inside the module but its hooks: a plain module (after ``make_plain``) is picklable again.

[Note: after fit]
A model whose parameters fit in ``max_live_parameters`` (elements), without tensor parallelism, is made plain
again at the end of every ``fit`` / ``validate`` / ``test`` / ``predict``: full parameters (gathered unit by
unit from the fp32 masters) back in the modules, and the optimizer re-pointed at them with its consolidated
state, exactly what DDP leaves. A larger model stays sharded, as FSDP2 leaves its module: the parameters stay
DTensors, calling the module gathers unit by unit (a collective: every rank calls it),
``trainer.strategy.lightning_module_state_dict()`` and checkpoints work as during fit, and the next
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

import gc
import logging
import weakref
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning_mics_kernels import triton_unusable

from lightning_mics.checkpoint import state as ckpt
from lightning_mics.checkpoint import steps as steps
from lightning_mics.frontends.clip import clip_grad_norm_
from lightning_mics.options import MiCSOptions, optimizer_state_only
from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.engine.user_code.optimizer_watch import held_optimizers
from lightning_mics.frontends.optimizer_support import step_refusal
from lightning_mics.frontends.threads import set_threads_per_rank
from lightning_mics.layout.topology import Topology, build_topology, plan_layout, release_groups_at_exit
from lightning_mics.layout.topology import release as release_topology

ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[MiCSEngine]]" = weakref.WeakKeyDictionary()


def engine_of(module: nn.Module) -> Optional[MiCSEngine]:
    """The engine of a sharded module, None for a plain one ([Note: engines beside their modules])."""
    ref = ENGINES.get(module)
    return None if ref is None else ref()


def live_engines() -> List[MiCSEngine]:
    """The engines of the modules still sharded."""
    return [e for e in (ref() for ref in list(ENGINES.values())) if e is not None]


# -- layout ---------------------------------------------------------------------------------------------------
class ProcessLayout:
    """The ranks, their devices and the mesh, as both strategies expose them: mixed in before Lightning's
    ``ParallelStrategy`` (the Trainer's or Fabric's), whose launcher and connector read these. The front end sets
    ``options``; ``connect_and_mesh`` (in its ``setup_environment``) makes the process group and the mesh."""

    options: MiCSOptions
    _num_nodes: int = 1
    _process_group_backend: Optional[str] = None
    _topology: Optional[Topology] = None

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("MiCSStrategy.topology exists once the process group is set up (Trainer: in and "
                               "after LightningModule.setup / configure_model; Fabric: after fabric.launch()).")
        return self._topology

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh with axes ("replicate", "shard") or, with tensor_parallel_degree > 1,
        ("replicate", "shard", "tp"): ``self.device_mesh["tp"]`` is what a ``configure_model`` parallelizes on
        (as under Lightning's ModelParallelStrategy)."""
        return self.topology.mesh

    def _ranks_per_node(self) -> int:
        return self.options.ranks_per_node or max(self.num_processes, 1)

    def set_world_ranks(self) -> None:
        from lightning.fabric.utilities.rank_zero import rank_zero_only  # the Trainer's and utilities' too

        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def connect_and_mesh(self, log: logging.Logger) -> Topology:
        """This rank's place, the default process group and the mesh. Collective."""
        self.set_world_ranks()
        self._process_group_backend = connect(self.cluster_environment, self._process_group_backend,
                                              self.root_device, self.options.timeout)
        set_threads_per_rank(self.root_device, self.num_processes, self.global_rank, log)  # [Note: threads per rank]
        self._topology = build_mesh(self.options, self.world_size, self._ranks_per_node(), self.root_device.type)
        log.info(f"[rank {self.global_rank}] {self._topology.describe()}")
        # Rank 0 hosts the store; a rank that leaves new_group's store handshake first and then refuses the model
        # at setup would take the store from a peer still polling it (a TCPStore error there, not its refusal).
        torch.distributed.barrier()
        return self._topology

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return steps.broadcast(obj, src)


def connect(cluster_environment: Any, backend: Optional[str], device: torch.device, timeout: float) -> str:
    """The default process group (gloo on CPU, NCCL on CUDA unless ``backend`` says otherwise), with the
    ``timeout`` option; returns the backend."""
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
    )

    backend = backend or _get_default_process_group_backend_for_device(device)
    kwargs: Dict[str, Any] = {"timeout": timedelta(seconds=timeout)}
    if device.type != "cpu" and "nccl" in backend:  # NCCL's eager init; gloo's subgroups cannot be split from
        kwargs["device_id"] = device             # a bound group (torch 2.11 fails to copy its options)
    _init_dist_connection(cluster_environment, backend, **kwargs)
    return backend


def check_before_launch(options: MiCSOptions, precision: Optional[str], device_type: str) -> None:
    """Options that the precision or the device rules out, refused before any process starts (both front ends):
    ``kernels="triton"`` where its kernels cannot run would fail at the first forward's bucket copy otherwise."""
    if options.stop_on_nonfinite and precision == "16-mixed":
        raise ValueError("MiCSStrategy option stop_on_nonfinite=True is invalid with precision='16-mixed': "
                         "allowed is False there (the loss scaler skips a step with inf/NaN gradients on every "
                         "rank and lowers the scale); True with any other precision.")
    why = triton_unusable(device_type) if options.kernels == "triton" else None
    if why is not None:
        raise ValueError(f"MiCSStrategy option kernels='triton' is invalid here: {why}; allowed is 'auto' (Triton "
                         "where it runs, torch elsewhere) or 'torch'.")


def check_checkpoint_io(options: MiCSOptions, io: Any) -> None:
    """A ``CheckpointIO`` plugin writes and reads the one file of ``state_dict_type="full"``; the sharded form is
    written by every rank through torch.distributed.checkpoint, where a plugin would be ignored: refused there
    (both front ends, when the plugin is given: before any process starts). Lightning's default is allowed."""
    if steps.users_plugin(io) and options.state_dict_type == "sharded":
        raise ValueError(f"MiCSStrategy got checkpoint_io={type(io).__name__} with state_dict_type='sharded': "
                         "allowed is a CheckpointIO plugin only with state_dict_type='full' (one file, written "
                         "through the plugin by rank 0); sharded checkpoints are written by every rank through "
                         "torch.distributed.checkpoint, which the plugin would not see.")


def build_mesh(options: MiCSOptions, world_size: int, ranks_per_node: int, device_type: str) -> Topology:
    """The (replicate, shard[, tp]) mesh for this world. Collective: call after the process group exists.
    With ``shard_optimizer_state`` and s = 1 the shards go over all W ranks
    ([Note: optimizer-state-only sharding])."""
    s = options.validate_world(world_size, ranks_per_node)
    release_groups_at_exit()  # [Note: groups at exit] in topology.py
    zero1 = optimizer_state_only(options)  # else: [Note: optimizer rows over replicas] in optimizer_rows.py
    layout = plan_layout(world_size, world_size if zero1 else s, ranks_per_node,
                         options.tensor_parallel_degree)
    topology = build_topology(layout, device_type)
    for group in topology.groups():  # [Note: the timeout of every group]
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=options.timeout), group)
    return topology


# [Note: the timeout of every group]
# ``timeout`` bounds a collective on every group the engine uses, not only on the default group: DeviceMesh
# creates its sub-groups with torch's default (30 minutes on gloo; 10 on NCCL unless split from a bound default
# group), so a peer lost while the others wait in a shard or replica collective would hold them that long. Each
# sub-group of the topology gets the option's value once it exists.


def hierarchical(options: MiCSOptions, topology: Topology) -> bool:
    """Two hops whenever a shard group spans whole nodes, unless turned off (asked for where it cannot apply:
    refused by ``MiCSConfig.validate_world``)."""
    return topology.layout.hierarchical_possible and options.hierarchical_allgather is not False


# -- sharded <-> plain ----------------------------------------------------------------------------------------
def shard(module: nn.Module, topology: Topology, options: MiCSOptions, device: torch.device,
          optimizers: Sequence[torch.optim.Optimizer] = ()) -> MiCSEngine:
    """The engine of ``module`` for these options: the existing one if the module is still sharded alike (after a
    failed fit, or a model kept sharded), otherwise a new one (a module sharded otherwise is made plain first).
    Each of ``optimizers`` (holding the module's plain parameters) is moved onto the shards with its state cut to
    this rank's rows. Runs with inference mode off (a user's ``inference_mode`` must not make shards inference
    tensors). Collective."""
    previous = engine_of(module)
    if previous is not None and previous.topo is topology and previous.options == options \
            and previous.device == device:
        previous.reset(keep_feedback=True)  # a failed run dropped them already
        return previous
    with torch.inference_mode(False):
        if previous is not None:
            make_plain(previous, optimizers)
        names = {id(p): n for n, p in module.named_parameters()}
        states = [opt.state_dict() for opt in optimizers]
        engine = MiCSEngine(module, topology, options, device)
        ENGINES[module] = weakref.ref(engine)  # the module's hooks hold the engine
        shards = dict(module.named_parameters())
        for opt, state in zip(optimizers, states):
            for group in opt.param_groups:
                group["params"][:] = [shards[names[id(p)]] for p in group["params"]]
            opt.state.clear()
            ckpt.load_full_optimizer_state(engine, opt, state)
    return engine


def make_plain(engine: MiCSEngine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Full parameters back in the module, and each optimizer re-pointed at them with its consolidated
    (full-shape) state, so module and optimizer are plain and consistent, as after DDP. Collective."""
    with torch.inference_mode(False):
        full_states = [ckpt.full_optimizer_state(engine, o, dst=None) for o in optimizers]
        mapping = engine.restore_module()
        for opt, state in zip(optimizers, full_states):
            for group in opt.param_groups:
                group["params"][:] = [mapping.get(id(p), p) for p in group["params"]]
            opt.state.clear()
            opt.load_state_dict(state)
    for module, ref in list(ENGINES.items()):
        if ref() is engine:
            ENGINES.pop(module, None)


def optimizers_of(module: nn.Module, optimizers: Iterable[Any]) -> List[torch.optim.Optimizer]:
    """Those of ``optimizers`` (unwrapped) that hold only ``module``'s parameters."""
    own = {id(p) for p in module.parameters()}
    plain = [unwrap(o) for o in optimizers]
    return [o for o in plain if all(id(p) in own for g in o.param_groups for p in g["params"])]


def unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's or Fabric's wrapper."""
    while hasattr(optimizer, "_optimizer"):
        optimizer = optimizer._optimizer
    return optimizer


def engine_holding(optimizer: torch.optim.Optimizer) -> Optional[MiCSEngine]:
    """The engine whose shards the optimizer holds (None: a plain optimizer). ValueError if it holds shards of
    several modules (its state could not be keyed by one module's parameter names) or a mix."""
    owners = {}
    for e in live_engines():
        ours = {id(p) for p in e.sharded_params()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in ours:
                    owners[id(p)] = e
    params = [p for g in optimizer.param_groups for p in g["params"]]
    engines = {id(e): e for e in owners.values()}
    if not engines:
        return None
    if len(engines) > 1 or len(owners) != len(params):
        raise ValueError("MiCSStrategy: an optimizer holds the parameters of several modules, or sharded and "
                         "plain parameters together: allowed is one optimizer per set-up module (a GAN: one for "
                         "the generator, one for the discriminator).")
    return next(iter(engines.values()))


def point_at_shards(optimizer: torch.optim.Optimizer) -> None:
    """A unit kept gathered (by a forward with grad and no backward yet, or ZeRO-1's pinned one) lends the module
    its plain parameters, so an optimizer built from ``model.parameters()`` then holds them: one with no state yet
    is pointed at their shards, as if built while the unit was released; so are the optimizers it holds (SAM's
    ``base_optimizer``)."""
    shards = {id(p.full): p.sharded for e in live_engines() for u in e.units for p in u.all_params()}
    for opt in held_optimizers(optimizer):
        if not opt.state:
            for group in opt.param_groups:
                group["params"][:] = [shards.get(id(p), p) for p in group["params"]]  # in place: LBFGS holds it


def check_optimizer(engine: MiCSEngine, optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuses an optimizer built over parameters that are not the sharded module's (built too early), and one
    whose step DTensor cannot run ([Note: optimizers over DTensors]). Alike on every rank (the same optimizer;
    [Note: optimizer probes] in optimizer_support.py), before any step."""
    ours = {id(p) for p in engine.sharded_params()}
    for group in optimizer.param_groups:  # (one it holds may step other parameters: watched, not refused)
        for p in group["params"]:
            if id(p) not in ours:
                raise ValueError(
                    "MiCSStrategy: an optimizer holds a parameter that is not one of the module's own "
                    f"(shape {tuple(p.shape)}). {where}; parameters captured earlier (e.g. in __init__, or before "
                    "the module was set up) are no longer the module's.")
    for opt in held_optimizers(optimizer):  # SAM's base optimizer steps the shards too
        reason = step_refusal(opt)
        if reason is not None:
            raise ValueError(reason)


def log_model_state(engine: MiCSEngine, rank: int, log: logging.Logger) -> None:
    """At start: the model-state bytes this rank will hold, against one unsharded copy."""
    held = engine.model_state_bytes()["params"]
    whole = sum(p.numel() * p.element_size() for p in engine.sharded_params())  # DTensor: global
    mib = 2.0 ** 20
    log.info(f"[rank {rank}] MiCS model state on this rank: parameters {held / mib:.2f} MiB "
             f"({held / max(whole, 1):.2f}x of {whole / mib:.2f} MiB unsharded); gradients as much again "
             "in the master dtype, and the optimizer's state k times that (AdamW: k = 2)")
    unsharded = nothing_sharded(engine)
    if rank == 0 and unsharded is not None:
        log.warning(f"MiCSStrategy: no parameter is sharded: {unsharded[0]}, so every rank holds the whole model "
                    f"(1.00x), as with DDP. {unsharded[1]}")


def nothing_sharded(engine: MiCSEngine) -> Optional[Tuple[str, str]]:
    """(why, what to give) when the layout shards no parameter although the user runs MiCS where it could: a
    sharding group of one rank over several nodes, or every parameter under ``param_persistence_threshold``."""
    layout, options = engine.topo.layout, engine.options
    nodes = layout.world_size // layout.ranks_per_node
    if layout.shard_size == 1 and layout.tp_size == 1 and nodes > 1:
        why = "given" if options.sharded_data_parallel_degree == 1 else \
            f"None: the ranks per node, {layout.ranks_per_node}"
        divisors = [d for d in range(2, layout.world_size + 1) if layout.world_size % d == 0]
        fit = nodes if nodes in divisors else divisors[0]
        return (f"sharded_data_parallel_degree=1 ({why}) on {nodes} nodes of {layout.ranks_per_node} "
                f"rank{'s' * (layout.ranks_per_node != 1)}",
                f"Give sharded_data_parallel_degree={fit} (allowed: a divisor of the world size {layout.world_size}, "
                f"{divisors}) to shard it over that many ranks; a sharding group larger than a node spans nodes.")
    if layout.shard_size > 1 and engine.replicated and not any(u.params for u in engine.units):
        largest = max(rp.global_shape.numel() for rp in engine.replicated)
        return (f"all {len(engine.replicated)} have fewer elements than param_persistence_threshold="
                f"{options.param_persistence_threshold} (the largest has {largest})",
                f"Give param_persistence_threshold <= {largest} to shard the largest.")
    return None


# -- clipping -------------------------------------------------------------------------------------------------
def clip_norm(optimizer: Any, max_norm: float, topology: Topology, norm_type: float = 2.0) -> torch.Tensor:
    """The total norm over the unsharded model's gradients, as ``torch.nn.utils.clip_grad_norm_`` gives it;
    gradients scaled in place. Collective over the shard group."""
    params = [p for g in unwrap(optimizer).param_groups for p in g["params"]]
    return clip_grad_norm_(params, max_norm, topology.mesh, norm_type)


@torch.no_grad()
def clip_value(parameters: Iterable[torch.Tensor], clip_val: float) -> None:
    """Elementwise: each rank clamps the gradient rows it holds (no collective)."""
    from lightning_mics.layout.placement import local

    grads = [local(p.grad) for p in parameters if p.grad is not None]
    for g in grads:
        g.clamp_(-clip_val, clip_val)


# -- teardown -------------------------------------------------------------------------------------------------
def fits_whole(engine: MiCSEngine, options: MiCSOptions) -> bool:
    numel = sum(p.numel() for p in engine.sharded_params())  # DTensor: the global count
    return numel <= options.max_live_parameters and engine.topo.layout.tp_size == 1


def finish(engine: MiCSEngine, options: MiCSOptions, optimizers: Sequence[torch.optim.Optimizer],
           failed: bool) -> bool:
    """End of a run: a model that fits is made plain again (collective); a larger one, one with tensor
    parallelism, or any after a failure (no collective: a peer may be gone) stays sharded with every unit
    released. Returns True when it stays sharded (the engine stays, for checkpoints and state dicts)."""
    if not failed and engine.outer is not None:
        engine.outer.settle()  # a DiLoCo fragment in flight lands ([Note: streaming fragments] in engine/fragments.py)
    if failed or not fits_whole(engine, options):
        if not failed:
            engine.release_idle()  # the last step's optimizer rows land ([Note: rows when a run ends])
        engine.reset(keep_feedback=not failed)
        return True
    make_plain(engine, optimizers)
    return False


def release_unused(topology: Optional[Topology]) -> Optional[Topology]:
    """Releases the mesh's groups if no engine uses it any more ([Note: one topology per layout]); returns the
    topology still in use, or None. Every rank must decide alike: releasing destroys groups, and the next fit
    then creates them collectively. An engine of a module the user dropped is held by a reference cycle (the
    engine and its units) until the garbage collector runs, and when it runs depends on each rank's own
    allocations (rank 0 logs and saves). So an engine found alive is confirmed after a collection: the ranks
    decide on what the program still holds, the same on each."""
    if topology is None:
        return None
    if any(e.topo is topology for e in live_engines()):
        gc.collect()
        if any(e.topo is topology for e in live_engines()):
            return topology
    release_topology(topology)
    return None
