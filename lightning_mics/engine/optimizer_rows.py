"""The optimizer's rows over replicas: one unit's gradient reduce-scatter across the replica group at the
accumulation boundary, and the all-gather of the updated rows that the next forward waits for.

[Note: optimizer rows over replicas]
With ``shard_optimizer_state=True`` and s > 1, parameters and gradients keep MiCS's layout, but replica j steps
only rows ``[j * ceil(n / r), (j + 1) * ceil(n / r))`` of its chunk's n rows (torch.chunk's): DTensor's
``(_StridedShard(0, split_factor=s), Shard(0))`` on the (replicate, shard) mesh. The optimizer's DTensors, their
gradients and state are those rows (``ShardedParam.optimizer_local``, a view of the flat shard). The replica
all-reduce splits around the step: at the boundary the accumulator is reduce-scattered (rows replica-major by
``chunk_cat``), issued as early as the all-reduce was ([Note: replica sync overlap] in gradients.py); the updated
rows are all-gathered (master dtype, async, unit order) when the next forward starts, each unit's gather waiting
for its own ([Note: rows between steps]); a state dict, a save or a full gather exchanges them and waits first.
The bytes are the all-reduce's (the gather half in the master dtype), half of them now overlapping the forward,
and each replica steps and holds 1/r of the state. Checkpoints hold the chunks as without the option
(``ShardedParam.checkpoint_view``); the optimizer state reshards through its DTensor placement.

[Note: rows between steps]
Between steps the module's parameters are each replica's own rows. A read (``full_tensor``) gathers every
replica's and sees what DDP would; a write (a clamp after the step, an average swapped in) changes this replica's
rows only, and every replica must take it before the chunks are next read whole. So when a forward enters the
root, and before a save, a state dict or the end of a run (``exchange``), every unit whose rows differ from
``agreed`` (its rows as all replicas hold them: set when built, loaded and at every exchange) exchanges them,
async, in unit order, each unit's gather waiting for its own. Those are the ``stale`` units (an optimizer step
marks all, alike on every rank) and, unless all are stale, those some replica finds changed bit for bit: one
all-reduce of a flag per unit over the replica group makes the replicas decide alike, since a write may change
one replica's rows and not another's. So every rank must run the same forwards as its replicas
(``DistributedSampler`` pads evaluation). Cost: a copy of 1/r of the master shard and, on a forward no step
precedes, the comparison, the flags' all-reduce (4 bytes a unit) and one host read ([Note: host reads per step]
in reliability.py). Not seen: a write after a forward has entered the root, before a unit's backward gathers it.

[Note: quantized optimizer rows]
With ``quantize_gradients`` the reduce-scatter travels as int8 blocks (steps 1-3 of [Note: quantized all-reduce]
in quantized.py), each replica's row of the replica-major layout padded to a multiple of 4 elements so that it is
one quantized chunk. The all-gather carries parameters: rounding them would leave the masters off by a quantum
and lose every update under half a quantum, so it stays in the master dtype, except with ``"error_feedback"``.
Then an exchange quantizes delta = rows - ``agreed`` (the step's change and any other write since) plus the last
rounding error (the residual's ``reduced`` half) and all-gathers it; this replica sets agreed and its rows to
agreed + its own dequantized delta, and every other replica adds the same dequantized delta (``settle``). So all
replicas hold the same bits, and the masters differ from the optimizer's own updates only by the last residual,
within one quantization's bound ([Note: error feedback] in quantized.py): the error does not accumulate. The link
carries about n / 2 + n / 2 bytes per step and replica (int8 both ways), a quarter of the fp32 all-reduce's 4 n.
The residuals (the contribution's r x row elements in the reduction dtype, the delta's row in the master dtype)
go into sharded checkpoints ([Note: residuals in checkpoints] in checkpoint/feedback.py).

[Note: rows when a run ends]
A run that ends well exchanges what is stale or written (``exchange``, in ``Schedule.release_idle``), so the next
run (a second ``fit`` in the same process, a state dict of a module left sharded) starts from the same parameters
on every replica. After a failure (``drop``, no collective issued: a peer may be gone) an exchange in flight is
given until the failure grace ([Note: a failure on every rank] in reliability.py) to complete and is taken if it
did; either way every unit is marked stale with its *rows* due next, also with int8 deltas: ranks may have taken
different exchanges, and the next one (every rank alike, after a failure on every rank, whose groups are kept)
sends the rows themselves, after which the replicas agree whatever arrived before.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from torch import Tensor

import lightning_mics_kernels
from lightning_mics.comm import collectives
from lightning_mics.comm import quantized
from lightning_mics.layout.placement import ShardedParam
from lightning_mics.comm.telemetry import CommLog
from lightning_mics.layout.topology import Topology

_POLL_S = 0.005


class OptimizerRows:
    """One unit's optimizer rows over the replica group ([Note: optimizer rows over replicas]): where each
    parameter's rows sit in the replica-major layout, the gradients' reduce-scatter, the rows' all-gather."""

    def __init__(self, params: Sequence[ShardedParam], topo: Topology, log: CommLog, kernels: str,
                 quantize: Optional[quantized.QuantizeSpec] = None, reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.params, self.log, self.kernels = list(params), log, kernels
        self.group, self.r = topo.replica_group, topo.layout.replicas
        self.offsets: List[int] = [0]  # of each parameter's slot in one replica's row of the layout
        for sp in self.params:
            self.offsets.append(self.offsets[-1] + sp.rows.sub_chunk * sp.rows.rest)
        self.quantize = quantize or quantized.QuantizeSpec()  # [Note: quantized optimizer rows]
        self.deltas = self.quantize.gradients == "error_feedback"  # the all-gather sends int8 deltas
        self.row = quantized.chunk_numel(self.offsets[-1])  # one replica's row, padded to a whole quantized chunk
        self.reduce_dtype = reduce_dtype or self.params[0].local.dtype
        self.residual: Optional[quantized.Residual] = None  # error feedback: (contribution, delta), lazily
        self._agreed: Optional[Tensor] = None  # this replica's rows as every replica holds them (``agree``)
        self.stale = False  # stepped since the last exchange ([Note: rows between steps])
        self._rows_next = False  # the next exchange sends the rows, not int8 deltas ([Note: rows when a run ends])
        self._pending: Optional[collectives.AllGatherResult] = None  # the rows' exchange, in flight
        self._pending_rows = False  # whether it carries rows (else int8 deltas)

    @staticmethod
    def chunk_of(flat: Tensor, sp: ShardedParam) -> Tensor:
        """The chunk's unpadded rows of ``sp`` in a flat-shard-layout tensor."""
        return flat[sp.offset:sp.offset + sp.rows.local_rows * sp.rows.rest].view(sp.rows.local_rows, *sp.shape[1:])

    def reduce_scatter(self, accum: Tensor, async_op: bool) -> collectives.ReduceScatterResult:
        """Sums ``accum`` (the window's shard gradients, flat-shard layout) over the replicas; the output holds
        this replica's rows of every parameter (``rows_of``)."""
        chunks = [self.chunk_of(accum, sp) for sp in self.params]
        if not self.quantize.gradients:
            return collectives.reduce_scatter_grads(chunks, self.group, self.r, dtype=accum.dtype, async_op=async_op,
                                          log=self.log, group_name="replicate", kernels=self.kernels,
                                          fewest_bytes=True)  # [Note: reduce-scatter on gloo] in collectives.py
        send = lightning_mics_kernels.chunk_cat(chunks, self.r, dtype=accum.dtype, backend=self.kernels)  # replica-major
        if self.row > self.offsets[-1]:  # each replica's row padded to a whole quantized chunk
            send = torch.nn.functional.pad(send, (0, self.row - self.offsets[-1]))
        return quantized.quantized_reduce_scatter(send.view(-1), self.group, self.quantize.block_size, async_op=async_op,
                                          residual=self._residual().contribution if self.deltas else None,
                                          log=self.log, group_name="replicate", kernels=self.kernels)

    def _residual(self) -> quantized.Residual:
        if self.residual is None:
            master = self.params[0].local
            self.residual = quantized.Residual(torch.zeros(self.r * self.row, dtype=self.reduce_dtype, device=master.device),
                                       torch.zeros(self.row, dtype=master.dtype, device=master.device))
        return self.residual

    def residual_numel(self) -> int:
        """Elements of the contribution half of the error-feedback state (checked when a checkpoint restores it)."""
        return self.r * self.row

    def rows_of(self, out: Tensor, i: int) -> Tensor:
        """Parameter ``i``'s rows in this replica's row of the layout (a view; the shape of its DTensor's local)."""
        sp = self.params[i]
        o = self.offsets[i]
        return out[o:o + sp.rows.sub_chunk * sp.rows.rest].view(sp.rows.sub_chunk, *sp.shape[1:])[
            : sp.rows.sub_hi - sp.rows.sub_lo]

    def _pack(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype, device: torch.device,
              numel: int) -> Tensor:
        return self._pack_into(torch.zeros(numel, dtype=dtype, device=device), locals_)

    def _pack_into(self, send: Tensor, locals_: Sequence[Optional[Tensor]]) -> Tensor:
        """Each tensor into its slot of ``send`` (the rest of ``send`` left as it is)."""
        for i, t in enumerate(locals_):
            if t is not None and t.numel():
                send[self.offsets[i]:self.offsets[i] + t.numel()].copy_(t.reshape(-1))
        return send

    def _gather(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype, device: torch.device,
                async_op: bool) -> collectives.AllGatherResult:
        send = self._pack(locals_, dtype, device, self.offsets[-1])
        return collectives.all_gather_flat(send, self.group, self.r, async_op=async_op, log=self.log, group_name="replicate")

    # -- the rows between steps ([Note: rows between steps]) ------------------------------------------------
    def agree(self) -> None:
        """Every replica holds these chunks alike (they were just built, or loaded): this replica's rows as they
        all hold them. Nothing may be in flight."""
        ref = self.params[0].local
        with torch.no_grad():
            self._agreed = self._pack([sp.optimizer_local for sp in self.params], ref.dtype, ref.device, self.row)
        self.stale = self._rows_next = False

    def changed(self) -> Tensor:
        """Whether this replica's rows differ, bit for bit, from what the replicas agreed on: a 0-dim float tensor
        on the rows' device (1.0: changed), so that many units are decided with one host synchronization."""
        ref = self.params[0].local
        if self._agreed is None:
            return torch.ones((), device=ref.device)
        flags = [torch.ne(sp.optimizer_local.reshape(-1).view(torch.uint8), self._agreed[o:o + sp.optimizer_local.numel()]
                          .view(torch.uint8)).any() for sp, o in zip(self.params, self.offsets) if sp.optimizer_local.numel()]
        return torch.stack(flags).any().float() if flags else torch.zeros((), device=ref.device)

    def share(self) -> None:
        """Starts the exchange of this replica's rows (async): the rows, or with int8 deltas their change since
        ``agreed`` ([Note: quantized optimizer rows]). Collective: every replica calls it for the same units."""
        self._take()
        agreed = self._agreed
        if agreed is None:
            raise RuntimeError("MiCS engine: optimizer rows exchanged before the replicas agreed on them")
        self._pending_rows = not self.deltas or self._rows_next
        with torch.no_grad():
            if self._pending_rows:
                self._pack_into(agreed, [sp.optimizer_local for sp in self.params])  # its padding stays zero
                self._pending = collectives.all_gather_flat(agreed[:self.offsets[-1]], self.group, self.r, async_op=True,
                                                  log=self.log, group_name="replicate")
            else:
                delta = self._pack([sp.optimizer_local for sp in self.params], agreed.dtype, agreed.device, self.row)
                delta.sub_(agreed)
                own = torch.empty_like(delta)  # this replica's change as every replica dequantizes it
                self._pending = quantized.quantized_all_gather(delta, self.group, self.r, self.quantize.block_size, own=own,
                                                       residual=self._residual().reduced, async_op=True,
                                                       log=self.log, group_name="replicate", kernels=self.kernels)
                agreed.add_(own)  # the rows every replica will hold: the others add the same bits in ``_take``
                for sp, o in zip(self.params, self.offsets):
                    sp.optimizer_local.view(-1).copy_(agreed[o:o + sp.optimizer_local.numel()])
        self.stale = self._rows_next = False

    def settle(self) -> None:
        """Before the chunks are read: the other replicas' rows are in. A stale unit exchanges first (collective;
        ``stale`` is set alike on every rank)."""
        if self.stale:
            self.share()
        self._take()

    def _take(self) -> None:
        """Waits for the exchange in flight, if any, and writes the other replicas' rows into the chunks (with
        int8 deltas: adds their change to them)."""
        res, self._pending = self._pending, None
        if res is None:
            return
        out = collectives.gathered(res, self.log)
        with torch.no_grad():
            for sp, o in zip(self.params, self.offsets):
                for j in range(self.r):
                    lo, hi = sp.rows.sub_rows(j)
                    if hi == lo or j == sp.rows.replica:
                        continue
                    rows, got = sp.local[lo:hi].view(-1), out[j, o:o + (hi - lo) * sp.rows.rest]
                    if self._pending_rows:
                        rows.copy_(got)
                    else:
                        rows.add_(got)

    def buffers(self) -> List[Tensor]:
        """What this unit's rows keep beside the chunks: ``agreed``, a copy of this replica's rows."""
        return [self._agreed] if self._agreed is not None else []

    def drop(self, deadline: float = 0.0) -> None:
        """Local reset after a failure, no collective issued: the exchange in flight is given until ``deadline``
        (``time.monotonic()``) to complete and is taken if it did; the rows are due next ([Note: rows when a run ends]).
        The error-feedback residual is the gradient path's to drop (``UnitGrads.drop``)."""
        work = self._pending.work if self._pending is not None else None
        while work is not None and not work.is_completed() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self._pending is not None and (work is None or work.is_completed()):
            self._take()
        self._pending = None
        self.stale = self._rows_next = True

    # -- optimizer state ---------------------------------------------------------------------------------------
    def chunks(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype,
               device: torch.device) -> List[Optional[Tensor]]:
        """Whole chunks (the shard group's rows) of per-parameter optimizer-state rows (``None``: no such
        tensor): an all-gather over the replica group. Collective; every replica passes the same Nones."""
        out = collectives.gathered(self._gather(locals_, dtype, device, async_op=False), self.log)
        fulls = [torch.empty(sp.rows.local_rows, *sp.shape[1:], dtype=dtype, device=device) for sp in self.params]
        collectives.copy_out(out, fulls, self.r, "torch")
        return [f if t is not None else None for f, t in zip(fulls, locals_)]


def exchange(units: Sequence[OptimizerRows]) -> None:
    """[Note: rows between steps]: starts the exchange of every unit whose rows changed since the replicas agreed
    on them, the stale ones and those a replica finds written. Collective over the replica group."""
    if not units:
        return
    check = [u for u in units if not u.stale]
    if check:
        flags = torch.stack([u.changed() for u in check])
        collectives.all_reduce_sum(flags, units[0].group, log=units[0].log, group_name="replicate")
        for u, f in zip(check, flags.tolist()):  # one host read for every unit ([Note: host reads per step])
            u.stale = u.stale or f > 0
    for u in units:
        if u.stale:
            u.share()
