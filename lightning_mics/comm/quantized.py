"""Stateless quantized collectives for the slow hop: block-quantized int8 with one fp32 scale per block.

Beside ``collectives.py`` and shaped like it: plain functions that take the tensors and the group and return
NamedTuples. The int8 wire format, the scale rule, the non-finite rule and the per-block error bound are those of
``triton_kernels`` ([Note: quantized wire format] and [Note: quantized block rule] in triton_kernels/_quant_layout.py);
the kernels run in Triton on CUDA and in their bit-identical torch fallback elsewhere.

[Note: quantized all-reduce]
A sum over the r ranks of ``group`` of a flat of n elements, never summed in int8 (ZeRO++'s qgZ, one hop):
  1. each rank quantizes its contribution into r chunks (int8 + one fp32 scale per block, the scales on the same
     uint8 wire as their values);
  2. all-to-all: chunk j of every rank goes to rank j;
  3. rank j dequantizes the r copies of its chunk and sums them in fp32 (``dequantize_sum``, fixed row order);
  4. rank j requantizes its reduced chunk (one row) and all-gathers it: every rank receives the same r rows;
  5. every rank dequantizes those rows into the flat (any float dtype), so all replicas hold identical values.
Per rank the wire carries ~2 (r-1)/r x n (1 + 4/B) bytes, the fp32 ring all-reduce's 2 (r-1)/r x 4 n times
(1 + 4/B) / 4 (0.2505 at B = 2048), up to the chunk padding. Per element of block b (A_i,b: the block's absmax in
rank i's contribution) each rounding is at most A_i,b / 254 and the requantization at most sum_i A_i,b / 254, so
|out - sum_i x_i| <= 2 sum_i A_i,b / 254 plus fp32 rounding (a few ulps of sum_i A_i,b). A non-finite value makes
its block's scale NaN: that whole block is NaN in the sum on every rank, never finite. Gloo and NCCL both run
``all_to_all_single``.

[Note: error feedback]
With ``residual`` (``feedback_buffers``), each quantization adds its previous rounding error before rounding and
keeps the new one (in the flat's dtype): ``contribution`` for step 1 (n elements), ``reduced`` for step 4 (this
rank's chunk). Summed over T calls the outputs then differ from the summed inputs only by the residuals left after
the last call, sum_i e_i,T + g_T, bounded by the last call's block errors: the error no longer accumulates with T.
A non-finite block leaves NaN in its residual; that NaN has already reached the output of the call (the step is
visibly bad, a GradScaler skips it), so the residual is reset to 0 there rather than poisoning every later call.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_mics_kernels
from lightning_mics.comm.collectives import (AllGatherResult, Chain, FinishAfter, NodeGroups, ReduceScatterResult,
                                        all_gather_single, gathered, side_stream)
from lightning_mics.comm.telemetry import CommLog
from lightning_mics_kernels._quant_layout import quant_layout

DEFAULT_BLOCK_SIZE = 2048


class QuantizeSpec(NamedTuple):
    """What a unit sends in int8 ([Note: quantized traffic] in options.py)."""

    gradients: object = False  # False | True | "error_feedback": the replica all-reduce
    allgather: bool = False  # the cross-node hop of the two-hop gather
    block_size: int = DEFAULT_BLOCK_SIZE


class Residual(NamedTuple):
    """Error-feedback state of one flat ([Note: error feedback]): zeros to start, then owned by the calls."""

    contribution: Tensor  # n elements: this rank's rounding error of its contribution
    reduced: Tensor  # chunk elements: the rounding error of requantizing this rank's reduced chunk


class QuantizedReduce(Chain):
    """A quantized all-reduce in flight, waited like a ``dist.Work`` (``collectives.wait`` takes it): a ``Chain`` of
    the all-to-all and the all-gather ([Note: chained collectives] in collectives.py). ``advance()`` issues the
    all-gather (where the host waits for the all-to-all, at the same point of its program on every rank: it joins
    the group's sequence of collectives); ``output`` holds the sum once ``done``."""

    def __init__(self, output: Tensor, work: Optional[dist.Work] = None, then=None, finish=None, keep=(),
                 side=None) -> None:
        self.output = output
        super().__init__(work, then, finish, keep, side)


def chunk_numel(numel: int) -> int:
    """Elements of the one quantized chunk that holds ``numel``: the wire's chunks are multiples of 4 elements
    ([Note: quantized wire format]); a flat of r such rows is cut into exactly those r chunks."""
    return quant_layout(numel, DEFAULT_BLOCK_SIZE).chunk


def wire_bytes(numel: int, group_size: int, block_size: int) -> int:
    """Bytes of the int8 wire buffer of ``numel`` elements cut into ``group_size`` chunks (scales included): what
    each all-to-all and all-gather of the quantized all-reduce moves, and the telemetry's figure for it."""
    return group_size * quant_layout(numel, block_size, group_size).row_bytes


def feedback_numel(numel: int, group_size: int, block_size: int) -> int:
    """Elements of a flat's error-feedback state (``Residual``): the contribution's n plus the reduced chunk."""
    return numel + quant_layout(numel, block_size, group_size).chunk


def feedback_buffers(numel: int, group_size: int, block_size: int, dtype: torch.dtype,
                     device: torch.device) -> Residual:
    """Zeroed error-feedback state for a flat of ``numel`` elements reduced over ``group_size`` ranks."""
    chunk = quant_layout(numel, block_size, group_size).chunk
    return Residual(torch.zeros(numel, dtype=dtype, device=device), torch.zeros(chunk, dtype=dtype, device=device))


def _record(log: Optional[CommLog], op: str, group_name: str, nbytes: int) -> None:
    if log is not None:
        log.record(op, group_name, nbytes)


def _check(flat: Tensor, residual: Optional[Residual], layout) -> None:
    if flat.dim() != 1 or not flat.is_contiguous() or not flat.is_floating_point():
        raise ValueError(f"flat must be a contiguous 1-D float tensor, got shape {tuple(flat.shape)}, "
                         f"dtype {flat.dtype}")
    if residual is not None:
        sizes = (residual.contribution.numel(), residual.reduced.numel())
        if sizes != (layout.numel, layout.chunk):
            raise ValueError(f"residual holds {sizes} elements; a flat of {layout.numel} over "
                             f"{layout.num_chunks} ranks needs ({layout.numel}, {layout.chunk}) (feedback_buffers)")


def _reset_nonfinite(residual: Tensor) -> None:
    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # [Note: error feedback]


def _to_owners(flat: Tensor, group: dist.ProcessGroup, r: int, block_size: int, residual: Optional[Tensor],
               kernels: str) -> Tuple[Tensor, Tensor, dist.Work]:
    """Steps 1-2 of [Note: quantized all-reduce]: quantizes ``flat`` into r chunks (error feedback into
    ``residual``) and all-to-alls them (async), chunk j to rank j. Returns (the sent wire, the received (r,
    row_bytes) wire, the work): both wires are the caller's to hold until the work is waited for."""
    sent = lightning_mics_kernels.quantize([flat], block_size, num_chunks=r, backend=kernels, residual=residual)
    if residual is not None:
        _reset_nonfinite(residual)
    recv = torch.empty_like(sent.wire)
    work = dist.all_to_all_single(recv.view(-1), sent.wire.view(-1), group=group, async_op=True)
    return sent.wire, recv, work


def quantized_all_reduce(
    flat: Tensor,
    group: dist.ProcessGroup,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    residual: Optional[Residual] = None,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    group_name: str = "replicate",
    kernels: str = "auto",
) -> QuantizedReduce:
    """In-place sum of the 1-D ``flat`` over ``group`` through int8 blocks ([Note: quantized all-reduce]).

    Synchronous: returns (done) with the sum in ``flat``. ``async_op``: in flight; the handle's ``wait()`` (or
    ``collectives.wait``) finishes it, ``advance()`` issues its all-gather. ``flat`` is read here and written by
    the wait, not in between. The telemetry records one ``all_reduce/<group_name>`` call with the int8 wire
    buffer's bytes, scales included (an fp32 all-reduce records its 4 n bytes)."""
    r = dist.get_world_size(group)
    layout = quant_layout(flat.numel(), block_size, r)
    _check(flat, residual, layout)
    if r == 1 or layout.numel == 0:
        return QuantizedReduce(flat)
    sent, recv, work = _to_owners(flat, group, r, block_size, None if residual is None else residual.contribution,
                                  kernels)
    _record(log, "all_reduce", group_name, recv.numel())
    # the work between the two collectives writes only these ([Note: streams and buffer lifetime])
    part = torch.empty(layout.chunk, dtype=torch.float32, device=flat.device)
    mine = torch.empty(sent.shape[1], dtype=torch.uint8, device=flat.device)  # one row: this rank's reduced chunk
    rows = torch.empty_like(sent)

    def then() -> dist.Work:
        lightning_mics_kernels.dequantize_sum(recv, r, block_size, out=part, backend=kernels)  # fp32, this rank's chunk
        lightning_mics_kernels.quantize([part], block_size, backend=kernels, out=mine,
                                residual=None if residual is None else residual.reduced)
        if residual is not None:
            _reset_nonfinite(residual.reduced)
        return all_gather_single(rows.view(-1), mine, group=group, async_op=True)

    def finish() -> None:
        lightning_mics_kernels.dequantize(rows, [flat], block_size, num_chunks=r, backend=kernels)

    res = QuantizedReduce(flat, work, then, finish, keep=(sent, recv, part, mine, rows),
                          side=side_stream(group, flat.device))
    if not async_op:
        res.wait()
    return res


def quantized_reduce_scatter(
    flat: Tensor,
    group: dist.ProcessGroup,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    residual: Optional[Tensor] = None,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    group_name: str = "replicate",
    kernels: str = "auto",
) -> ReduceScatterResult:
    """Steps 1-3 of [Note: quantized all-reduce]: the sum over ``group`` of this rank's chunk of the 1-D ``flat``
    (r chunks of ``quant_layout(n, block_size, r).chunk`` elements, rank j's the j-th), in ``flat``'s dtype, as
    ``output``. ``residual`` (n elements): error feedback of the contribution. Synchronous: returns it summed;
    ``async_op``: the all-to-all is in flight, and waiting for the ``work`` (``collectives.wait``) sums. One
    ``reduce_scatter/<group_name>`` call is recorded with the int8 wire buffer's bytes."""
    r = dist.get_world_size(group)
    layout = quant_layout(flat.numel(), block_size, r)
    _check(flat, None, layout)
    if residual is not None and residual.numel() != layout.numel:
        raise ValueError(f"residual holds {residual.numel()} elements; the flat has {layout.numel}")
    out = torch.zeros(layout.chunk, dtype=flat.dtype, device=flat.device)
    sent, recv, work = _to_owners(flat, group, r, block_size, residual, kernels)
    _record(log, "reduce_scatter", group_name, recv.numel())

    def finish() -> None:
        if out.dtype == torch.float32:
            lightning_mics_kernels.dequantize_sum(recv, r, block_size, out=out, backend=kernels)
        else:
            out.copy_(lightning_mics_kernels.dequantize_sum(recv, r, block_size, backend=kernels))

    held = FinishAfter(work, finish, keep=(sent, recv, out))
    if not async_op:
        held.wait()
        return ReduceScatterResult(out, None)
    return ReduceScatterResult(out, held)


class _Gather(NamedTuple):
    """An int8 all-gather in flight: its work, the buffers it holds, and the dequantization still to run."""

    work: dist.Work
    keep: Tuple[Tensor, ...]  # the sent wire, the received rows, the output (and its padding's scratch)
    out: Tensor  # (k, S) of the output dtype, once ``dequantize`` ran
    dequantize: Callable[[], Tensor]


def _gather(shard: Tensor, group: dist.ProcessGroup, k: int, block_size: int, dtype: torch.dtype,
            residual: Optional[Tensor], own: Optional[Tensor], log: Optional[CommLog], group_name: str,
            kernels: str) -> _Gather:
    size = shard.numel()
    mine = lightning_mics_kernels.quantize([shard], block_size, backend=kernels, residual=residual)  # one row: c = ceil(S/4)*4
    if residual is not None:
        _reset_nonfinite(residual)
    if own is not None:  # one row: its padding is dropped
        lightning_mics_kernels.dequantize(mine.wire, [own], block_size, backend=kernels)
    rows = torch.empty(k * mine.layout.row_bytes, dtype=torch.uint8, device=shard.device)
    work = all_gather_single(rows, mine.wire.view(-1), group=group, async_op=True)
    _record(log, "all_gather", group_name, rows.numel())
    out = torch.empty(k, size, dtype=dtype, device=shard.device)
    pad = mine.layout.chunk - size  # rows are c long on the wire: the padding of each lands in a scratch
    scratch = torch.empty(k, pad, dtype=dtype, device=shard.device)
    outs: List[Tensor] = [t for j in range(k) for t in ((out[j], scratch[j]) if pad else (out[j],))]

    def dequantize() -> Tensor:
        lightning_mics_kernels.dequantize(rows, outs, block_size, num_chunks=k, backend=kernels)
        return out

    return _Gather(work, (mine.wire, rows, out, scratch), out, dequantize)


def quantized_all_gather(
    shard: Tensor,
    group: dist.ProcessGroup,
    group_size: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    dtype: Optional[torch.dtype] = None,
    residual: Optional[Tensor] = None,
    own: Optional[Tensor] = None,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    group_name: str = "inter",
    kernels: str = "auto",
) -> AllGatherResult:
    """All-gathers a 1-D shard in int8 blocks and dequantizes into ``(group_size, S)`` of ``dtype`` (default the
    shard's): every rank, the sender included, gets the same dequantized rows. The shard itself (fp32 masters) is
    only read. ``residual`` (S elements): error feedback of the shard ([Note: error feedback]); ``own`` (S
    elements of ``dtype``): this rank's row is dequantized into it at once, the bits every rank gets for it. Returns
    the ``AllGatherResult`` protocol of ``collectives`` (``gathered`` finishes it)."""
    dtype = dtype or shard.dtype
    if residual is not None and residual.numel() != shard.numel():
        raise ValueError(f"residual holds {residual.numel()} elements; the shard has {shard.numel()}")
    g = _gather(shard, group, group_size, block_size, dtype, residual, own, log, group_name, kernels)
    held = FinishAfter(g.work, keep=g.keep)
    if not async_op:
        held.wait()
        return AllGatherResult(g.dequantize(), None)
    return AllGatherResult(None, held, g.dequantize)


def round_trip(shard: Tensor, block_size: int, dtype: torch.dtype, kernels: str = "auto") -> Tensor:
    """``shard`` as every rank gets it from ``quantized_all_gather`` (dequantized into ``dtype``)."""
    out = torch.empty(shard.numel(), dtype=dtype, device=shard.device)
    lightning_mics_kernels.dequantize(lightning_mics_kernels.quantize([shard], block_size, backend=kernels).wire, [out], block_size,
                              backend=kernels)
    return out


def quantized_all_gather_two_hop(
    shard: Tensor,
    nodes: NodeGroups,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    dtype: Optional[torch.dtype] = None,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    kernels: str = "auto",
) -> AllGatherResult:
    """``collectives.all_gather_two_hop`` (inter first) with the cross-node hop in int8 blocks: hop 1 over
    ``nodes.inter`` quantized, dequantized into ``dtype`` between the hops ([Note: chained collectives] in
    collectives.py); hop 2 inside the node in ``dtype``. Every rank of the shard group ends with the same
    rank-major ``(s, S)`` buffer ([Note: two-hop all-gather])."""
    dtype = dtype or shard.dtype
    n, p, size = nodes.nodes, nodes.per_node, shard.numel()
    if p == 1 or nodes.intra is None:  # one hop
        return quantized_all_gather(shard, nodes.inter, n, block_size, dtype=dtype, async_op=async_op, log=log,
                                    group_name="inter", kernels=kernels)
    hop1 = _gather(shard, nodes.inter, n, block_size, dtype, None, None, log, "inter", kernels)
    hop2 = torch.empty(p * n * size, dtype=dtype, device=shard.device)

    def then() -> dist.Work:
        first = hop1.dequantize()
        _record(log, "all_gather", "intra", hop2.numel() * hop2.element_size())
        return all_gather_single(hop2, first.view(-1), group=nodes.intra, async_op=True)

    def finish() -> Tensor:
        return hop2.view(p, n, size).transpose(0, 1).contiguous().view(n * p, size)  # (l, a) -> rank-major

    chain = Chain(hop1.work, then, keep=(*hop1.keep, hop2), side=side_stream(nodes.intra, shard.device))
    res = AllGatherResult(None, chain, finish)
    return res if async_op else AllGatherResult(gathered(res), None)
