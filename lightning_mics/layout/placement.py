"""Explicit placement: every parameter the optimizer sees is a DTensor on the (replicate, shard) mesh.

[Note: placement]
A *sharded* parameter of shape (d0, *rest) is cut on dim 0 into s chunks of c = ceil(d0 / s) rows (torch.chunk's
rows, the last chunks shorter or empty); rank j of a shard group keeps chunk j, zero-padded to c rows, in its
unit's flat shard ([Note: rank-major layout] in collectives.py). The optimizer sees a DTensor placed (Replicate(),
Shard(0)) whose local tensor is the chunk's *unpadded* rows, a view into the flat shard: a step writes the flat
shard in place, and the next all-gather reads it. Its gradient has the same spec. This is FSDP2's ``FSDPParam``
layout, and DTensor's own uneven Shard(0) rule gives exactly these rows, so DCP, ``full_tensor()`` and
redistribution agree with it. A *replicated* parameter (small, or s == 1) is a DTensor placed (Replicate(),
Replicate()) holding the whole parameter; its plain twin (a Parameter over the same storage) is what the modules
hold while their unit runs and what autograd accumulates the local gradient into. While a unit runs, its modules
hold plain *full* parameters: views into its gathered buffer (storage freed while sharded), or the plain twins.
Consumers (clipping, checkpoints, the full state dict, the optimizer-state gather) read placement from the
DTensor, never from shapes or ids.

[Note: tensor-parallel placement]
With a "tp" mesh axis the user's plan has already made some parameters DTensors on it (ColwiseParallel:
Shard(0), RowwiseParallel: Shard(1), ...). Sharding works on each rank's *tensor-parallel local* tensor: its
rows are cut over the shard group exactly as above, and the full parameter the modules hold while the unit
runs is again a DTensor on the tp mesh with the user's placement (its local tensor a view of the gathered
buffer). The optimizer's DTensor lives on the (replicate, shard, tp) mesh with placements (Replicate(),
Shard(0), <tp placement>); when the tp placement is Shard(0) too, rows are split by tp first and then by the
shard group, which DTensor spells ``_StridedShard(0, split_factor=t)`` on the shard axis (as FSDP2 does). A
plain parameter (not parallelized) is Replicate() on the tp axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_mics.layout.sharding import ParamRef


def _contiguous_stride(shape: torch.Size) -> tuple:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


def tp_placement(orig: Tensor) -> Optional[Placement]:
    """The user's tensor-parallel placement of a parameter (None: a plain tensor)."""
    if isinstance(orig, DTensor):
        if orig.device_mesh.ndim != 1:
            raise ValueError(f"MiCSStrategy: a parameter is a DTensor on a {orig.device_mesh.ndim}-D mesh; "
                             "parallelize on the strategy's self.device_mesh['tp'] (a 1-D mesh) only")
        return orig.placements[0]
    return None


def make_spec(mesh: DeviceMesh, sharded: bool, shape: torch.Size, dtype: torch.dtype,
              tp: Optional[Placement] = None, over_replicas: bool = False) -> DTensorSpec:
    """([Note: placement], [Note: tensor-parallel placement], [Note: optimizer rows over replicas]) ``shape``
    is the global shape; ``over_replicas``: this rank's rows of its shard group's chunk, cut again over the
    replicas."""
    dp: Placement = Shard(0) if sharded else Replicate()
    placements: tuple = (Replicate(), dp)
    if over_replicas:
        if mesh.ndim != 2:
            raise ValueError("MiCSStrategy: optimizer rows over replicas need the 2-D (replicate, shard) mesh")
        placements = (_StridedShard(0, split_factor=mesh.size(1)), dp)
    if mesh.ndim == 3:
        tp = tp if tp is not None else Replicate()
        if sharded and isinstance(tp, Shard) and tp.dim == 0:
            dp = _StridedShard(0, split_factor=mesh.size(2))
        placements = (Replicate(), dp, tp)
    elif tp is not None:
        raise ValueError("MiCSStrategy: a DTensor parameter needs tensor_parallel_degree > 1")
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype))


def tp_spec_of(orig: Tensor) -> Optional[DTensorSpec]:
    """The spec of the user's tensor-parallel DTensor parameter (None for a plain one)."""
    return orig._spec if isinstance(orig, DTensor) else None


def as_dtensor(local: Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over ``local`` without autograd or checks (FSDP2's ``_from_local_no_grad``)."""
    if spec.tensor_meta is not None and spec.tensor_meta.dtype != local.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements,
                           tensor_meta=TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _cuts(p: Placement) -> bool:
    return p.is_shard() or isinstance(p, _StridedShard)


def is_sharded(t: Tensor) -> bool:
    """True for a DTensor with a Shard placement (its local tensor is a slice of the whole)."""
    return isinstance(t, DTensor) and any(_cuts(p) for p in t.placements)


def sharded_mesh_dims(t: Tensor) -> tuple:
    """The mesh dimensions over which a DTensor's local tensor is a slice (() for a plain tensor)."""
    return tuple(i for i, p in enumerate(t.placements) if _cuts(p)) if isinstance(t, DTensor) else ()


def local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def local_grad(p: "_Placed") -> Optional[Tensor]:
    """The full parameter's gradient as a plain tensor: with tensor parallelism a DTensor in the parameter's
    own placement (redistributed if autograd produced another one, e.g. a pending sum)."""
    g = p.full.grad
    if isinstance(g, DTensor):
        if g.placements != p.full.placements:
            g = g.redistribute(g.device_mesh, p.full.placements)
        return g._local_tensor
    return g


def tp_part(full: Tensor, tp_spec: Optional[DTensorSpec]) -> Tensor:
    """This rank's tensor-parallel part of a global tensor (a view; the tensor itself without tensor
    parallelism): what a full checkpoint holds, cut as the user's placement cuts the parameter."""
    if tp_spec is None:
        return full
    shape, offset = compute_local_shape_and_global_offset(full.shape, tp_spec.mesh, tp_spec.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


@dataclass(frozen=True)
class Rows:
    """Where rank ``rank`` of ``s`` finds its chunk of a (d0, *rest) parameter; with ``replicas`` > 1 also
    which rows of that chunk replica ``replica`` steps ([Note: optimizer rows over replicas])."""

    d0: int
    rest: int  # elements per row
    s: int
    rank: int
    replicas: int = 1
    replica: int = 0

    @property
    def chunk(self) -> int:  # c: padded rows per rank
        return math.ceil(self.d0 / self.s)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.rest

    @property
    def lo(self) -> int:
        return min(self.rank * self.chunk, self.d0)

    @property
    def hi(self) -> int:
        return min((self.rank + 1) * self.chunk, self.d0)

    @property
    def local_rows(self) -> int:
        return self.hi - self.lo

    @property
    def sub_chunk(self) -> int:  # padded rows per replica: torch.chunk's of the chunk's unpadded rows
        return math.ceil(self.local_rows / self.replicas)

    def sub_rows(self, replica: int) -> Tuple[int, int]:
        """The rows of the chunk that replica ``replica`` steps, relative to the chunk: [lo, hi)."""
        return min(replica * self.sub_chunk, self.local_rows), min((replica + 1) * self.sub_chunk, self.local_rows)

    @property
    def sub_lo(self) -> int:  # this replica's rows (the optimizer's), relative to the chunk
        return self.sub_rows(self.replica)[0]

    @property
    def sub_hi(self) -> int:
        return self.sub_rows(self.replica)[1]


class _Placed:
    """What a sharded and a replicated parameter share: the DTensor the optimizer steps (``sharded``, over
    ``local``), its ``spec``, and this rank's part of a global tensor (``local_rows_of``)."""

    sharded: nn.Parameter
    local: Tensor
    spec: DTensorSpec

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad

    def local_rows_of(self, full: Tensor) -> Tensor:
        raise NotImplementedError

    def copy_from_global(self, full: Tensor) -> None:
        """This rank's part of a global tensor (e.g. from a full checkpoint) into the parameter."""
        with torch.no_grad():
            self.local.copy_(self.local_rows_of(full))

    def wrap(self, local_tensor: Tensor) -> DTensor:
        """A gradient or optimizer-state tensor of the local shape as a DTensor of this parameter's spec."""
        return as_dtensor(local_tensor, self.spec)

    def _watch_rebinding(self) -> None:
        self._alias = self.sharded.data  # shares the wrapper's own storage, which ``p.data = x`` replaces

    def rebound(self) -> bool:
        """Whether user code ran ``p.data = x`` on the DTensor, which torch leaves without effect: its local tensor
        (the masters) stays as it was (pytorch#157391). The wrapper then no longer aliases what it did."""
        return not torch._C._is_alias_of(self.sharded, self._alias)


class ShardedParam(_Placed):
    """One sharded parameter: its padded region of the unit's flat shard, the DTensor the optimizer steps,
    and the full plain Parameter the modules hold while the unit is gathered."""

    def __init__(self, index: int, refs: List[ParamRef], orig: nn.Parameter, mesh: DeviceMesh, rows: Rows,
                 flat_shard: Tensor, offset: int) -> None:
        self.index, self.refs = index, refs
        self.fqn = refs[0].fqn
        self.tp_spec = tp_spec_of(orig)  # [Note: tensor-parallel placement]
        self.shape = local(orig).shape  # of the full parameter on this rank (its tensor-parallel local part)
        self.global_shape = orig.shape  # with tensor parallelism, of all tensor-parallel parts together
        self.rows = rows
        self.offset = offset  # start of the padded region in the unit's flat shard
        over_replicas = rows.replicas > 1  # [Note: optimizer rows over replicas]
        self.spec = make_spec(mesh, True, orig.shape, flat_shard.dtype, tp_placement(orig), over_replicas)
        region = flat_shard[offset:offset + rows.padded_numel].view(rows.chunk, *self.shape[1:])
        self.padded = region  # (c, *rest); rows past local_rows stay zero
        self.local = region[: rows.local_rows]  # the chunk this rank holds (and gathers from)
        self.optimizer_local = self.local[rows.sub_lo:rows.sub_hi] if over_replicas else self.local  # the optimizer's rows
        self.sharded = nn.Parameter(as_dtensor(self.optimizer_local, self.spec), requires_grad=orig.requires_grad)
        self._watch_rebinding()
        # what a sharded checkpoint holds: the chunk, in the layout without optimizer rows over replicas
        self.checkpoint_view = as_dtensor(self.local, make_spec(mesh, True, orig.shape, flat_shard.dtype,
                                                     tp_placement(orig))) if over_replicas else self.sharded
        self.full: Optional[nn.Parameter] = None  # set by the unit (a view of its gathered buffer): make_full
        self.meta = orig.is_meta  # values still to come ([Note: sharded initialization] in materialize.py)

    @torch.no_grad()
    def copy_rows_from_full(self, full: Tensor) -> None:
        """This rank's rows of a full tensor (of ``self.shape``: the tensor-parallel part) into the shard
        (padding stays zero)."""
        self.local.copy_(full[self.rows.lo:self.rows.hi])

    def local_rows_of(self, full: Tensor) -> Tensor:
        """The optimizer's rows of a global tensor (of ``self.global_shape``, e.g. optimizer state from a full
        checkpoint): the chunk's, or with optimizer rows over replicas this replica's part of it."""
        lo = self.rows.lo + (self.rows.sub_lo if self.rows.replicas > 1 else 0)
        hi = self.rows.lo + (self.rows.sub_hi if self.rows.replicas > 1 else self.rows.local_rows)
        return tp_part(full, self.tp_spec)[lo:hi]

    @torch.no_grad()
    def copy_from_global(self, full: Tensor) -> None:
        """This rank's chunk of a global parameter (e.g. from a full checkpoint) into the shard."""
        self.local.copy_(tp_part(full, self.tp_spec)[self.rows.lo:self.rows.hi])

    @torch.no_grad()
    def reattach(self, view: Tensor) -> None:
        """``p.data = x`` on the plain parameter (a rebinding, not a write in place) moved it off ``view``, the unit's
        storage: its values go into ``view`` and it views that again, so the write is taken as any other
        ([Note: writes between steps] in user_code/write_back.py). A DTensor's ``.data = x`` leaves its local tensor as it was
        (torch)."""
        if self.full is not None and self.tp_spec is None and self.full.data_ptr() != view.data_ptr():
            view.copy_(self.full.data)
            self.full.data = view

    def make_full(self, view: Tensor) -> nn.Parameter:
        """The Parameter the modules hold while the unit runs: ``view`` itself, or with tensor parallelism a
        DTensor over it with the user's placement."""
        data = as_dtensor(view, self.tp_spec) if self.tp_spec is not None else view
        return nn.Parameter(data, requires_grad=self.requires_grad)


class ReplicatedParam(_Placed):
    """One replicated parameter: a (Replicate, Replicate) DTensor and its plain twin over the same storage."""

    def __init__(self, index: int, refs: List[ParamRef], orig: nn.Parameter, mesh: DeviceMesh,
                 device: torch.device) -> None:
        self.index, self.refs = index, refs
        self.fqn = refs[0].fqn
        self.tp_spec = tp_spec_of(orig)
        self.meta = orig.is_meta  # values still to come ([Note: sharded initialization] in materialize.py)
        data = local(orig).detach()
        self.shape = data.shape
        self.global_shape = orig.shape
        if data.is_meta:
            data = torch.empty(data.shape, dtype=orig.dtype, device=device)
        elif data.device != device:
            data = data.to(device)
        self.spec = make_spec(mesh, False, orig.shape, data.dtype, tp_placement(orig))
        self.local = data
        self.sharded = nn.Parameter(as_dtensor(data, self.spec), requires_grad=orig.requires_grad)
        self._watch_rebinding()
        self.full = nn.Parameter(as_dtensor(data, self.tp_spec) if self.tp_spec is not None else data,
                                 requires_grad=orig.requires_grad)
        self.checkpoint_view = self.sharded  # what a sharded checkpoint holds (as ``ShardedParam.checkpoint_view``)

    def local_rows_of(self, full: Tensor) -> Tensor:
        """This rank's part of a global tensor: the tensor-parallel part, or the whole tensor."""
        return tp_part(full, self.tp_spec)
