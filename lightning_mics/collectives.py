"""Stateless collectives: each takes the tensors and the group it runs on, and returns what it made.

Nothing here knows about units or modules, so each function can be tested alone. The copy-in / copy-out
layout (many tensors <-> one communication buffer, rank-major) is done by ``triton_kernels``
([Note: rank-major layout]).

[Note: rank-major layout]
Every sharded parameter of shape (d0, *rest) is cut on dim 0 into s chunks of c = ceil(d0 / s) rows,
zero-padded. Rank j keeps chunk j of every parameter of a unit, concatenated: its flat shard of S elements.
The all-gather output is then (s, S) with row j = rank j's flat shard, which is exactly
``triton_kernels.chunk_cat(full_params, s)``: ``chunk_split`` turns it back into full parameters, and the
reduce-scatter input for gradients is ``chunk_cat(full_grads, s)``, whose row j reduces onto rank j.
"""

from __future__ import annotations

import time
from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

import triton_kernels
from lightning_mics.telemetry import CommLog


class AllGatherResult(NamedTuple):
    output: Tensor  # (s, S)
    work: Optional[dist.Work]


class ReduceScatterResult(NamedTuple):
    output: Tensor  # (S,)
    work: Optional[dist.Work]


def _record(log: Optional[CommLog], op: str, group_name: str, nbytes: int) -> None:
    if log is not None:
        log.record(op, group_name, nbytes)


def all_gather_flat(
    shard: Tensor,
    group: dist.ProcessGroup,
    group_size: int,
    *,
    dtype: Optional[torch.dtype] = None,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    group_name: str = "shard",
    kernels: str = "auto",
) -> AllGatherResult:
    """All-gathers a 1-D flat shard (cast to ``dtype`` first) into an ``(group_size, S)`` buffer."""
    dtype = dtype or shard.dtype
    send = shard if shard.dtype == dtype else triton_kernels.flatten([shard], dtype=dtype, backend=kernels)
    out = torch.empty(group_size * send.numel(), dtype=dtype, device=send.device)
    work = dist.all_gather_single(out, send, group=group, async_op=async_op)
    _record(log, "all_gather", group_name, out.numel() * out.element_size())
    return AllGatherResult(out.view(group_size, -1), work if async_op else None)


def reduce_scatter_grads(
    grads: Sequence[Tensor],
    group: dist.ProcessGroup,
    group_size: int,
    *,
    dtype: torch.dtype,
    scale: float = 1.0,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    group_name: str = "shard",
    kernels: str = "auto",
) -> ReduceScatterResult:
    """Lays full gradients out rank-major (cast to ``dtype``), pre-scales, and reduce-scatters (sum).

    With ``group_size == 1`` there is nobody to reduce with: the flattened, scaled buffer is returned.
    """
    buf = triton_kernels.chunk_cat(list(grads), group_size, dtype=dtype, backend=kernels)
    if scale != 1.0:
        buf.mul_(scale)
    if group_size == 1:
        return ReduceScatterResult(buf.view(-1), None)
    out = torch.empty(buf.size(1), dtype=dtype, device=buf.device)
    work = dist.reduce_scatter_single(out, buf.view(-1), group=group, async_op=async_op)
    _record(log, "reduce_scatter", group_name, buf.numel() * buf.element_size())
    return ReduceScatterResult(out, work if async_op else None)


def all_reduce_sum(
    tensor: Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    group_name: str = "replicate",
) -> Optional[dist.Work]:
    """In-place sum over ``group``."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    _record(log, "all_reduce", group_name, tensor.numel() * tensor.element_size())
    return work if async_op else None


def wait(work: Optional[dist.Work], log: Optional[CommLog] = None) -> None:
    """Waits for an async collective; the time blocked is what telemetry calls waiting on communication."""
    if work is None:
        return
    t0 = time.perf_counter()
    work.wait()
    if log is not None:
        log.waited(time.perf_counter() - t0)


def gather_flat(shard: Tensor, group: dist.ProcessGroup, group_size: int, dst: int) -> Optional[Tensor]:
    """Gathers equal-size 1-D shards onto global rank ``dst`` as ``(group_size, S)``; None on the others."""
    if group_size == 1:
        return shard.view(1, -1)
    if dist.get_rank() == dst:
        out = torch.empty(group_size, shard.numel(), dtype=shard.dtype, device=shard.device)
        dist.gather(shard, list(out.unbind(0)), dst=dst, group=group)
        return out
    dist.gather(shard, None, dst=dst, group=group)
    return None


def copy_out(gathered: Tensor, fulls: List[Tensor], group_size: int, kernels: str = "auto") -> None:
    """Writes an ``(s, S)`` all-gather output into unpadded full tensors (inverse of ``chunk_cat``)."""
    triton_kernels.chunk_split(gathered, fulls, group_size, backend=kernels)
