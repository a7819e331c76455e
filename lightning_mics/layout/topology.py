"""Process layout: shard groups, replica groups, and the node sub-groups of a shard group.

[Note: MiCS layout]
With world size W, sharding degree s and r = W / s replicas, ranks lie on a (replicate, shard) grid: shard groups
are *contiguous* ranks ``[g*s, (g+1)*s)``, so on a cluster they sit on as few nodes as possible and their frequent
all-gathers use the fast intra-node links; replica groups are *strided*, ``{j, j+s, j+2s, ...}`` holding the same
shard j of the model state. A shard group spanning nodes (``ranks_per_node`` = p < s) splits further into an
``inter`` axis (same local rank, s/p nodes) and an ``intra`` axis (p ranks of one node) for the two-hop
all-gather. Only those two groups are created for it (the mesh's shard axis unflattened: the replicate axis keeps
its group), and with one rank per node none: the inter axis is the shard group and there is no second hop. Each
group created is used (with NCCL each is a communicator, built eagerly when the default group is bound to a device).

[Note: tensor-parallel ranks]
With a tensor-parallel degree t (the seed's "sharded data parallelism with tensor parallelism", Example 2),
rank = (g*s + j)*t + k: tensor-parallel groups are t *contiguous* ranks (the most frequent traffic, on the fastest
links), and each tensor-parallel rank k has its own (replicate, shard) grid over the ranks with that k: the mesh is
``arange(W).view(r, s, t)`` with axes ("replicate", "shard", "tp"). Data-parallel ranks number W / t; every
data-parallel collective (gradient reduction, the replicated parameters' all-reduce) runs among the ranks of one k.

``plan_layout`` is pure (no processes), so the groups of any world size can be checked in a unit test;
``build_mesh`` turns a layout into a DeviceMesh whose named axes carry the process groups.
"""

from __future__ import annotations

import atexit
import gc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_mics.comm.collectives import NodeGroups


@dataclass(frozen=True)
class Layout:
    world_size: int
    shard_size: int  # s
    ranks_per_node: int  # p
    tp_size: int = 1  # t

    @property
    def replicas(self) -> int:  # r
        return self.world_size // (self.shard_size * self.tp_size)

    @property
    def dp_size(self) -> int:  # data-parallel ranks: W / t
        return self.world_size // self.tp_size

    def _grid(self) -> List[List[List[int]]]:  # [g][j][k] -> rank
        s, t = self.shard_size, self.tp_size
        return [[[(g * s + j) * t + k for k in range(t)] for j in range(s)] for g in range(self.replicas)]

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(replica g, shard rank j, tensor-parallel rank k) of a global rank."""
        s, t = self.shard_size, self.tp_size
        return rank // (s * t), (rank // t) % s, rank % t

    @property
    def spans_nodes(self) -> bool:
        return self.shard_size > self.ranks_per_node

    @property
    def hierarchical_possible(self) -> bool:
        """Two hops need whole nodes inside a shard group (and no tensor-parallel axis interleaved)."""
        return self.tp_size == 1 and self.spans_nodes and self.shard_size % self.ranks_per_node == 0

    def shard_groups(self) -> List[List[int]]:
        grid = self._grid()
        return [[grid[g][j][k] for j in range(self.shard_size)] for g in range(self.replicas)
                for k in range(self.tp_size)]

    def replica_groups(self) -> List[List[int]]:
        grid = self._grid()
        return [[grid[g][j][k] for g in range(self.replicas)] for j in range(self.shard_size)
                for k in range(self.tp_size)]

    def tp_groups(self) -> List[List[int]]:
        grid = self._grid()
        return [grid[g][j] for g in range(self.replicas) for j in range(self.shard_size)]

    def dp_group_of(self, rank: int) -> List[int]:
        """The data-parallel ranks of ``rank``'s tensor-parallel rank (all W ranks when t = 1)."""
        return list(range(rank % self.tp_size, self.world_size, self.tp_size))

    def shard_group_of(self, rank: int) -> List[int]:
        return next(grp for grp in self.shard_groups() if rank in grp)

    def replica_group_of(self, rank: int) -> List[int]:
        return next(grp for grp in self.replica_groups() if rank in grp)

    def tp_group_of(self, rank: int) -> List[int]:
        return next(grp for grp in self.tp_groups() if rank in grp)

    def intra_groups(self) -> List[List[int]]:
        """Ranks of one shard group on one node (the second hop of the hierarchical all-gather)."""
        p = self.ranks_per_node
        return [list(range(n * p, (n + 1) * p)) for n in range(self.world_size // p)]

    def inter_groups(self) -> List[List[int]]:
        """Ranks of one shard group with the same local rank, one per node (the first hop)."""
        s, p = self.shard_size, self.ranks_per_node
        return [list(range(g * s + l, (g + 1) * s, p)) for g in range(self.replicas) for l in range(p)]


def plan_layout(world_size: int, shard_size: int, ranks_per_node: Optional[int] = None, tp_size: int = 1) -> Layout:
    if world_size % tp_size != 0:
        raise ValueError(
            f"MiCSStrategy option tensor_parallel_degree={tp_size} is invalid: allowed is a divisor of the world "
            f"size {world_size}."
        )
    if (world_size // tp_size) % shard_size != 0:
        raise ValueError(
            f"MiCSStrategy option sharded_data_parallel_degree={shard_size} is invalid: allowed is a divisor of "
            + (f"the world size {world_size}." if tp_size == 1 else
               f"the data-parallel size {world_size // tp_size} (world {world_size} / tensor_parallel_degree "
               f"{tp_size}).")
        )
    p = ranks_per_node or world_size
    if world_size % p != 0:
        raise ValueError(
            f"MiCSStrategy option ranks_per_node={p} is invalid: allowed is a divisor of the world size {world_size}."
        )
    return Layout(world_size, shard_size, p, tp_size)


@dataclass
class Topology:
    """The live groups of this rank; built collectively on every rank, in the same order."""

    layout: Layout
    mesh: DeviceMesh  # ("replicate", "shard"), or ("replicate", "shard", "tp") with a tensor-parallel degree
    node_mesh: Optional[DeviceMesh]  # ("replicate", "inter", "intra") when a shard group spans whole nodes of p > 1
    rank: int
    world: Any = None  # the default group these were split from ([Note: one topology per layout])
    dp_mesh: Optional[DeviceMesh] = None  # ("dp",): this tensor-parallel rank's data-parallel ranks (t > 1)

    def groups(self) -> List[dist.ProcessGroup]:
        """This rank's sub-groups (never the default group), each once."""
        out: List[dist.ProcessGroup] = []
        meshes = [m for m in (self.mesh, self.node_mesh, self.dp_mesh) if m is not None]
        for mesh in meshes:
            for name in mesh.mesh_dim_names or ():
                pg = mesh.get_group(name)
                if pg is not dist.group.WORLD and all(pg is not g for g in out):
                    out.append(pg)
        return out

    def node_groups(self) -> NodeGroups:
        """The two-hop all-gather's groups ([Note: two-hop all-gather] in collectives.py)."""
        if not self.layout.hierarchical_possible:
            raise RuntimeError(f"no two-hop groups: a shard group of {self.layout.shard_size} ranks does not span "
                               f"whole nodes of {self.layout.ranks_per_node}")
        p = self.layout.ranks_per_node
        if self.node_mesh is None:  # one rank per node: one hop, over the shard group
            return NodeGroups(self.shard_group, None, self.layout.shard_size, 1)
        return NodeGroups(self.node_mesh.get_group("inter"), self.node_mesh.get_group("intra"),
                          self.layout.shard_size // p, p)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("shard")

    @property
    def replica_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("replicate")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Where data-parallel averages run: the world, or with t > 1 the ranks of this tensor-parallel rank."""
        return self.dp_mesh.get_group("dp") if self.dp_mesh is not None else dist.group.WORLD

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return self.mesh["tp"] if self.layout.tp_size > 1 else None

    @property
    def shard_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def replica_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    def describe(self) -> str:
        lay = self.layout
        tp = f" t={lay.tp_size}" if lay.tp_size > 1 else ""
        tp_group = f", tensor-parallel group {lay.tp_group_of(self.rank)}" if lay.tp_size > 1 else ""
        return (
            f"MiCS layout: world={lay.world_size} s={lay.shard_size} r={lay.replicas}{tp} "
            f"ranks_per_node={lay.ranks_per_node}, mesh {tuple(self.mesh.mesh.shape)} {self.mesh.mesh_dim_names}; "
            f"rank {self.rank}: shard group {lay.shard_group_of(self.rank)}, "
            f"replica group {lay.replica_group_of(self.rank)}{tp_group}"
        )


# [Note: one topology per layout]
# Sub-groups are created once per layout and reused while anything uses that layout (a strategy between its
# setup and teardown, a module left sharded after fit). When nothing does, ``release`` destroys them, so fits
# with other layouts in the same process do not pile groups up. Destroying needs care: DeviceMesh equality
# ignores the process groups, so DTensor's sharding-propagation caches would hand a later, equal mesh the
# output specs of the old one, whose groups no longer resolve ("Could not resolve the process group registered
# under the name 3"); ``release`` clears those caches first, and keeps the groups where this torch does not
# offer the means to clear them.
_TOPOLOGIES: Dict[Tuple, Topology] = {}


def build_topology(layout: Layout, device_type: str) -> Topology:
    """The live groups for ``layout``: created collectively on every rank the first time, reused after."""
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks, layout expects {layout.world_size}")
    world = dist.distributed_c10d._get_default_group()
    key = (layout, device_type)
    cached = _TOPOLOGIES.get(key)
    if cached is not None and cached.world is world:
        return cached
    dp_mesh = None
    if layout.tp_size > 1:
        mesh = init_device_mesh(device_type, (layout.replicas, layout.shard_size, layout.tp_size),
                                mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]._flatten("dp")
    else:
        mesh = init_device_mesh(
            device_type, (layout.replicas, layout.shard_size), mesh_dim_names=("replicate", "shard")
        )
    node_mesh = None
    if layout.hierarchical_possible and layout.ranks_per_node > 1:  # [Note: MiCS layout]: only inter and intra
        p = layout.ranks_per_node
        node_mesh = mesh._unflatten("shard", (layout.shard_size // p, p), ("inter", "intra"))
    topo = Topology(layout, mesh, node_mesh, rank, world, dp_mesh)
    _TOPOLOGIES[key] = topo
    return topo


def _clear_dtensor_caches() -> bool:
    """Empties DTensor's caches of sharding decisions (keyed on mesh equality); False if this torch lacks one
    of the hooks, in which case nothing is cleared and groups must not be destroyed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    prop = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    clears = [getattr(getattr(prop, "propagate_op_sharding", None), "cache_clear", None),
              getattr(ShardingPropagator._propagate_tensor_meta_cached, "cache_clear", None),
              getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
              getattr(_redistribute._gen_transform_infos, "cache_clear", None),
              getattr(_redistribute, "clear_redistribute_planner_cache", None)]
    if not all(callable(c) for c in clears):
        return False
    for clear in clears:
        clear()
    return True


def _drop_meshes(topo: Topology) -> None:
    for mesh in (topo.mesh, topo.node_mesh, topo.dp_mesh):
        while mesh is not None:  # a mesh keeps its groups alive: a gloo group's threads join when it goes
            mesh._pg_registry.clear()
            mesh = mesh._root_mesh


def release(topo: Topology) -> None:
    """Destroys the sub-groups of a topology nothing uses any more ([Note: one topology per layout])."""
    key = (topo.layout, topo.mesh.device_type)
    if _TOPOLOGIES.get(key) is not topo or not dist.is_initialized() or not _clear_dtensor_caches():
        return
    del _TOPOLOGIES[key]
    for pg in topo.groups():
        dist.destroy_process_group(pg)
    _drop_meshes(topo)
    topo.world = None


# [Note: groups at exit]
# A gloo group runs its collectives on worker threads (pt_gloo_runloop); after a collective completes, the worker
# still holds the Work until the end of its loop iteration, and releasing it needs the GIL (its tensors' Python
# objects, its ThreadLocalState). If the interpreter has begun finalizing by then, CPython (< 3.14) ends the thread
# with pthread_exit, the forced unwind meets a noexcept frame in ProcessGroupGloo::runLoop, and std::terminate aborts
# a fit that succeeded ("terminate called without an active exception", status -6). Any group alive at exit is
# exposed, the default group included; destroy_process_group() alone does not stop its threads: only destructing
# the ProcessGroupGloo joins them, and a DeviceMesh keeps its groups in ``_pg_registry``. So at exit, before
# finalization: destroy every group, drop our topologies, empty their meshes' registries and collect garbage (an
# engine and its units form a cycle that may hold a group), so the last references go and each group's threads join
# while they can still take the GIL.
_RELEASE_AT_EXIT_REGISTERED = False


def release_all_groups() -> None:
    """Destroys every process group and drops this module's references to them ([Note: groups at exit])."""
    topologies = list(_TOPOLOGIES.values())
    _TOPOLOGIES.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for topo in topologies:
        _drop_meshes(topo)
        topo.world = None
    gc.collect()  # a group held only by a reference cycle (an engine and its units) goes now, not at finalization


def release_groups_at_exit() -> None:
    """Registers :func:`release_all_groups` with atexit (once per process)."""
    global _RELEASE_AT_EXIT_REGISTERED
    if not _RELEASE_AT_EXIT_REGISTERED:
        atexit.register(release_all_groups)
        _RELEASE_AT_EXIT_REGISTERED = True
