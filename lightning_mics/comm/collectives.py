"""Stateless collectives: each takes the tensors and the group it runs on, and returns what it made.

Nothing here knows about units or modules, so each function can be tested alone. The copy-in / copy-out
layout (many tensors <-> one communication buffer, rank-major) is done by ``triton_kernels``
([Note: rank-major layout]).

[Note: rank-major layout]
Every sharded parameter of shape (d0, *rest) is cut on dim 0 into s chunks of c = ceil(d0 / s) rows,
zero-padded. Rank j keeps chunk j of every parameter of a unit, concatenated: its flat shard of S elements.
The all-gather output is then (s, S) with row j = rank j's flat shard, which is exactly
``lightning_mics_kernels.chunk_cat(full_params, s)``: ``chunk_split`` turns it back into full parameters, and the
reduce-scatter input for gradients is ``chunk_cat(full_grads, s)``, whose row j reduces onto rank j.

[Note: two-hop all-gather]
When a shard group of s ranks spans n nodes of p ranks (s = n p; shard-group rank j = a p + l for node a and
local rank l), MiCS gathers in two hops. Inter first: (1) all-gather among the n ranks with the same local
rank l, one per node (x[a, l] for every a), (2) all-gather of that n-row block inside the node. Each rank then
receives only S elements per other node across the slow link, where the flat gather brings it (s - p) S:
for n = 2 exactly half. The result arrives as (p, n, S), row (l, a); one copy puts it in rank-major (n, p, S)
order, bit-identical to the flat gather. The other order (intra first, then inter) lands directly in
rank-major order with no copy, but then every rank carries p S per other node across nodes, more than the
flat gather. Inter first is the default (``HOP_ORDER``) because the cross-node bytes are what the two hops exist
to save; on one host (loopback, no slow link) the copy makes it a little slower than intra first. With one rank
per node (p = 1) it is one hop over the shard group.

[Note: streams and buffer lifetime]
Every collective runs on its backend's own stream (NCCL's internal ones: ``async_op=True``), issued from the compute
stream, which also runs the copies in and out (cast, ``chunk_cat``, ``copy_out``, (de)quantization); ``wait()`` makes
the compute stream wait for it (on NCCL without blocking the host). A side stream per group (``side_stream``) carries
only the middle of a ``Chain``. FSDP2's alternative (copy-in, all-gather, reduce-scatter and all-reduce streams whose
buffers are freed after recorded events) takes the copies off the compute stream; which is faster is not yet
measured. The allocator-safety rule, on every backend: a tensor an async collective
reads or writes is allocated on the compute stream before it is issued and stays referenced by the Work's holder
(``FinishAfter``, ``Chain``, a unit's ``FullStorage`` readers) until its ``wait()`` ran on the compute stream; until
then no buffer is read (output), written (input), reused, freed or resized (``resize_(0)`` frees whatever holds it).

[Note: chained collectives]
A ``Chain`` is two collectives with local work between them: the two-hop gather's hops (the int8 hop 1 dequantized
between them), the quantized all-reduce's all-to-all and all-gather. Where ``wait()`` is stream-ordered (NCCL on CUDA)
the second is issued at once: on the group's side stream, which waits for the compute stream, then for the first
collective, runs the local work into buffers allocated before (its temporaries stay on it) and issues the second; the
compute stream waits only for the second, when the result is needed. Where ``wait()`` blocks the host (gloo) the second
is issued when the result is first needed (``advance``, or ``wait``), the same point of the program on every rank, so
each group's sequence of collectives is the same on every rank; every chain issues both, even one dropped unused. After
a failure a chain is ``abandon``ed without a wait: its buffers are recorded on the side stream first. Tests run the
NCCL form on gloo with ``CHAIN_AT_ISSUE = True`` (the host waits for the first collective at issue).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_mics_kernels
from lightning_mics.comm.telemetry import CommLog

# torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single`` (the old names stay as
# deprecated aliases that warn). Users on GPUs bring their own torch, often an older one, so the engine calls these
# two, which take whichever name this torch has (looked up at each call, so a wrapper set on ``torch.distributed``
# by a profiler or a benchmark still sees every call): the same c10d ops with the same arguments either way.


def all_gather_single(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> Optional[dist.Work]:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
                          async_op: bool = False) -> Optional[dist.Work]:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


class AllGatherResult(NamedTuple):
    output: Optional[Tensor]  # (s, S) rank-major; None until ``finish`` has run (two hops)
    work: Optional[Any]  # a holder waited like a dist.Work ([Note: streams and buffer lifetime])
    finish: Optional[Callable[[], Tensor]] = None  # local work on the result, run after ``work`` is waited for


class NodeGroups(NamedTuple):
    """A shard group that spans whole nodes: n nodes of p ranks ([Note: two-hop all-gather])."""

    inter: dist.ProcessGroup  # the n ranks with this rank's local rank, one per node (the shard group if p = 1)
    intra: Optional[dist.ProcessGroup]  # the p ranks of this node; None if p = 1 (no second hop)
    nodes: int  # n
    per_node: int  # p


class ReduceScatterResult(NamedTuple):
    output: Tensor  # (S,)
    work: Optional[Any]  # a holder waited like a dist.Work


def _record(log: Optional[CommLog], op: str, group_name: str, nbytes: int) -> None:
    if log is not None:
        log.record(op, group_name, nbytes)


# -- holders of collectives in flight ([Note: streams and buffer lifetime]) -----------------------------------------
CHAIN_AT_ISSUE: Optional[bool] = None  # None: where waits are stream-ordered; True: everywhere (tests, on gloo)
_SIDE_STREAMS: Dict[Tuple[str, Optional[int]], Any] = {}


def side_stream(group: dist.ProcessGroup, device: torch.device) -> Optional[Any]:
    """The stream the middle of a ``Chain`` whose second collective runs on ``group`` runs on where ``wait()`` is
    stream-ordered (NCCL on CUDA), one per group and device; None where the host waits
    ([Note: chained collectives])."""
    if device.type != "cuda":
        return None
    backend = str(dist.get_backend(group))  # "nccl", or per device type: "cpu:gloo,cuda:nccl"
    if ":" in backend:
        backend = dict(part.split(":", 1) for part in backend.split(",")).get("cuda", "")
    if backend != "nccl":
        return None
    key = (group.group_name, device.index)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return stream


@contextlib.contextmanager
def _on(stream: Optional[Any]) -> Iterator[None]:
    """Runs the block on ``stream`` after everything the compute stream has queued (nothing to do without one)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


class FinishAfter:
    """A collective in flight, waited like a ``dist.Work``: it holds every tensor the collective reads or writes
    (``keep``) until the first ``wait``, which then runs ``finish`` (local work on the result), once, and drops them
    ([Note: streams and buffer lifetime])."""

    def __init__(self, work: dist.Work, finish: Optional[Callable[[], object]] = None, keep: Sequence[Tensor] = ()
                 ) -> None:
        self.work, self.finish, self.keep = work, finish, tuple(keep)

    def wait(self, *args: object, **kwargs: object) -> bool:
        if self.work is not None:
            self.work.wait(*args, **kwargs)
            self.work = None
            finish, self.finish = self.finish, None
            if finish is not None:
                finish()
            self.keep = ()
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class Chain:
    """Two collectives with local work between them, waited like a ``dist.Work`` ([Note: chained collectives]).
    ``then()`` runs once the first is done (the local work) and issues the second, returning its Work; ``finish()``
    runs after the second is waited for. ``keep``: every buffer of the two and of the work between, allocated before,
    held until ``wait``. ``side``: ``side_stream``'s stream, or None (the host waits for the first)."""

    def __init__(self, work: Optional[dist.Work], then: Optional[Callable[[], Optional[dist.Work]]],
                 finish: Optional[Callable[[], object]] = None, keep: Sequence[Tensor] = (),
                 side: Optional[Any] = None) -> None:
        self._work, self._then, self._finish, self.keep, self._side = work, then, finish, tuple(keep), side
        self.stage = 0 if work is None and then is None else 1  # 2: the second collective is issued
        if then is not None and (side is not None or CHAIN_AT_ISSUE):
            self.advance()

    @property
    def done(self) -> bool:
        return self._work is None and self._then is None and self._finish is None

    def advance(self) -> None:
        """Issues the second collective after the first is done: on the side stream, or with the host waiting."""
        if self._then is None:
            return
        then, self._then = self._then, None
        with _on(self._side):
            if self._work is not None:
                self._work.wait()  # on the side stream: the compute stream does not wait for it
            self._work = then()
        self.stage = 2

    def wait(self, *args: object, **kwargs: object) -> bool:
        self.advance()
        if self._work is not None:
            self._work.wait(*args, **kwargs)
            self._work = None
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        self.keep = ()
        return True

    def is_completed(self) -> bool:
        return self._then is None and (self._work is None or self._work.is_completed())

    def abandon(self) -> None:
        """Dropped without a wait (after a failure: a peer may be gone); the side stream's queued work may still
        write the buffers, so the allocator hands them out only after it ran."""
        if self._side is not None:
            for t in self.keep:
                t.record_stream(self._side)
        self._work = self._then = self._finish = None
        self.keep = ()


def abandon(*works: Optional[Any]) -> None:
    """Drops holders of collectives in flight without waiting for them ([``Chain.abandon``])."""
    for work in works:
        if isinstance(work, Chain):
            work.abandon()


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
    out: Optional[Tensor] = None,
) -> AllGatherResult:
    """All-gathers a 1-D flat shard (cast to ``dtype`` first) into an ``(group_size, S)`` buffer (``out``, 1-D of
    that many elements, if given)."""
    dtype = dtype or shard.dtype
    send = shard if shard.dtype == dtype else lightning_mics_kernels.flatten([shard], dtype=dtype, backend=kernels)
    if out is None:
        out = torch.empty(group_size * send.numel(), dtype=dtype, device=send.device)
    work = all_gather_single(out, send, group=group, async_op=async_op)
    _record(log, "all_gather", group_name, out.numel() * out.element_size())
    return AllGatherResult(out.view(group_size, -1), FinishAfter(work, keep=(send, out)) if async_op else None)


HOP_ORDER = "inter_first"  # [Note: two-hop all-gather]


def all_gather_two_hop(
    shard: Tensor,
    nodes: NodeGroups,
    *,
    dtype: Optional[torch.dtype] = None,
    async_op: bool = False,
    log: Optional[CommLog] = None,
    kernels: str = "auto",
    order: str = HOP_ORDER,
) -> AllGatherResult:
    """The flat all-gather's result in two hops ([Note: two-hop all-gather]), a ``Chain`` ([Note: chained collectives]);
    ``gathered`` waits for it and returns the rank-major ``(s, S)`` buffer. With one rank per node there is one hop,
    over ``nodes.inter``."""
    dtype = dtype or shard.dtype
    send = shard if shard.dtype == dtype else lightning_mics_kernels.flatten([shard], dtype=dtype, backend=kernels)
    n, p, size = nodes.nodes, nodes.per_node, send.numel()
    if p == 1 or nodes.intra is None:
        return all_gather_flat(send, nodes.inter, n, async_op=async_op, log=log, group_name="inter")
    first, second = (nodes.inter, nodes.intra) if order == "inter_first" else (nodes.intra, nodes.inter)
    names = ("inter", "intra") if order == "inter_first" else ("intra", "inter")
    hop1 = torch.empty((n if order == "inter_first" else p) * size, dtype=dtype, device=send.device)
    hop2 = torch.empty(n * p * size, dtype=dtype, device=send.device)
    work = all_gather_single(hop1, send, group=first, async_op=True)
    _record(log, "all_gather", names[0], hop1.numel() * hop1.element_size())

    def then() -> dist.Work:
        _record(log, "all_gather", names[1], hop2.numel() * hop2.element_size())
        return all_gather_single(hop2, hop1, group=second, async_op=True)

    def finish() -> Tensor:
        if order == "inter_first":  # (p, n, S) row (l, a) -> rank-major (n, p, S)
            return hop2.view(p, n, size).transpose(0, 1).contiguous().view(n * p, size)
        return hop2.view(n * p, size)

    res = AllGatherResult(None, Chain(work, then, keep=(send, hop1, hop2), side=side_stream(second, send.device)),
                          finish)
    return res if async_op else AllGatherResult(gathered(res), None)


def gather_numel(size: int, group_size: int, nodes: Optional[NodeGroups] = None, int8_row_bytes: int = 0,
                 itemsize: int = 4) -> int:
    """Elements (of ``itemsize`` bytes) of the buffers an all-gather of ``size``-element shards holds in flight: its
    (s, S) output; with two hops also hop 1's (n, S) output, and with an int8 hop 1 its received wire."""
    if nodes is None:
        return group_size * size
    hop1 = nodes.nodes * size if nodes.per_node > 1 and nodes.intra is not None else 0
    return group_size * size + hop1 + -(-nodes.nodes * int8_row_bytes // itemsize)


def gathered(res: AllGatherResult, log: Optional[CommLog] = None) -> Tensor:
    """Waits for an all-gather (flat or two-hop) and returns its rank-major ``(s, S)`` output."""
    wait(res.work, log)
    return res.finish() if res.finish is not None else res.output


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
    staging: Optional[Tensor] = None,
    fewest_bytes: bool = False,
) -> ReduceScatterResult:
    """Lays full gradients out rank-major (cast to ``dtype``), pre-scales, and reduce-scatters (sum).

    ``staging``: a ``(group_size, S)`` buffer of ``dtype`` to lay them out in (a new one if None); the caller
    keeps it intact until the collective is done. With ``group_size == 1`` there is nobody to reduce with: the
    flattened, scaled buffer is returned. ``fewest_bytes``: for a slow link, [Note: reduce-scatter on gloo].
    """
    buf = lightning_mics_kernels.chunk_cat(list(grads), group_size, out=staging, dtype=dtype, backend=kernels)
    if scale != 1.0:
        buf.mul_(scale)
    if group_size == 1:
        return ReduceScatterResult(buf.view(-1), None)
    out = torch.empty(buf.size(1), dtype=dtype, device=buf.device)
    _record(log, "reduce_scatter", group_name, buf.numel() * buf.element_size())
    if fewest_bytes and dist.get_backend(group) == "gloo":
        recv = torch.empty_like(buf)
        work = FinishAfter(dist.all_to_all_single(recv, buf, group=group, async_op=True),
                           lambda: torch.sum(recv, dim=0, out=out), keep=(buf, recv, out))
        if not async_op:
            work.wait()
        return ReduceScatterResult(out, work if async_op else None)
    work = reduce_scatter_single(out, buf.view(-1), group=group, async_op=async_op)
    return ReduceScatterResult(out, FinishAfter(work, keep=(buf, out)) if async_op else None)


# [Note: reduce-scatter on gloo]
# gloo's reduce-scatter (``reduce_scatter_single`` and the list form) is an all-reduce of the whole buffer with
# each rank keeping its part: every rank sends the buffer's size, twice what a ring reduce-scatter sends
# ((k-1)/k of it).
# Where the bytes cost (the replica hop over a slow link) the reduce-scatter is an all-to-all of the rank-major
# rows and a local sum of the k received rows (``FinishAfter``): the ring's bytes. NCCL's reduce-scatter moves
# those already and is used as it is.


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


def bucket_runs(sizes: Sequence[int], cap: int) -> List[List[int]]:
    """Greedy runs of consecutive indices whose sizes add up to at most ``cap`` (at least one index each): how
    gradients are bucketed for reduce-scatter, replica all-reduce and the replicated parameters' all-reduce."""
    out: List[List[int]] = []
    cur: List[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if cur and total + size > cap:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += size
    if cur:
        out.append(cur)
    return out


def wait(work: Optional[Any], log: Optional[CommLog] = None) -> None:
    """Waits for an async collective (a Work or a holder of one) on the current stream; the time it stalls is what
    telemetry calls waiting on communication (``CommLog.waiting``)."""
    if work is None:
        return
    if log is None:
        work.wait()
        return
    with log.waiting():
        work.wait()


def gather_flat(shard: Tensor, group: dist.ProcessGroup, group_size: int, dst: int,
                out: Optional[Tensor] = None) -> Optional[Tensor]:
    """Gathers equal-size 1-D shards onto global rank ``dst`` as ``(group_size, S)`` (into ``out``, 1-D of that
    many elements, if given); None on the others."""
    if group_size == 1:
        return shard.view(1, -1)
    if dist.get_rank() == dst:
        out = out.view(group_size, -1) if out is not None else \
            torch.empty(group_size, shard.numel(), dtype=shard.dtype, device=shard.device)
        dist.gather(shard, list(out.unbind(0)), dst=dst, group=group)
        return out
    dist.gather(shard, None, dst=dst, group=group)
    return None


def copy_out(gathered: Tensor, fulls: List[Tensor], group_size: int, kernels: str = "auto") -> None:
    """Writes an ``(s, S)`` all-gather output into unpadded full tensors (inverse of ``chunk_cat``)."""
    lightning_mics_kernels.chunk_split(gathered, fulls, group_size, backend=kernels)


def all_gather_batch(batch: object, group: dist.ProcessGroup, group_size: int) -> object:
    """Every tensor of a batch (any nesting) concatenated on dim 0 over ``group``, in rank order: the
    tensor-parallel ranks' batches become one batch that all of them compute (without ``prescaled_batch``)."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    def gather(t: Tensor) -> Tensor:
        if t.dim() == 0:
            return t
        out = t.new_empty((group_size * t.shape[0], *t.shape[1:]))
        all_gather_single(out, t.contiguous(), group=group)
        return out

    return apply_to_collection(batch, Tensor, gather)
