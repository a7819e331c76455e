"""The optimizer's rows over replicas: one unit's gradient reduce-scatter across the replica group at the
accumulation boundary, and the all-gather of the updated rows that the next forward waits for.

[Note: optimizer rows over replicas]
``shard_optimizer_state=True`` with s > 1 keeps MiCS's layout for parameters and gradients (each rank of a shard
group holds its chunk of every sharded parameter, every replica the same chunk) but shards the optimizer state
over all s x r data-parallel ranks: replica j steps only its part of the chunk, rows
``[j * ceil(n / r), (j + 1) * ceil(n / r))`` of the chunk's n rows (torch.chunk's rows), which is DTensor's
``(_StridedShard(0, split_factor=s), Shard(0))`` on the (replicate, shard) mesh: the optimizer's DTensors, their
gradients and optimizer state are those rows (``ShardedParam.stepped``, a view of the flat shard).

The replica all-reduce of the window's shard gradients becomes its two halves, split around the step:
- at the boundary each unit's accumulator is *reduce-scattered* over the replica group (the rows laid out
  replica-major by ``chunk_cat``, so each replica receives the summed rows it steps), issued as early as the
  all-reduce was ([Note: replica sync overlap] in gradients.py);
- after the optimizer step every unit's updated rows are *all-gathered* over the replica group (master dtype,
  async, in unit order), and a unit's gather waits for its rows before it reads the flat shard, so these
  transfers run while the next forward computes the units before it. A state dict, a save or a full gather
  (``Schedule.quiesce``, ``full_state.gather_rows``) waits for them first.
The bytes on the replica link are the all-reduce's (a ring all-reduce is a reduce-scatter plus an all-gather);
in fp32 the same, with a lower reduce_dtype the gather half moves master-dtype rows. What moves is *when*: half
of it overlaps the forward instead of queueing after the backward, and each replica's optimizer steps 1/r of
the rows and holds 1/r of the state. The model's sharded checkpoint holds the chunks as without the option
(``ShardedParam.held``); the optimizer state is saved and resharded through its DTensor placement.

[Note: quantized optimizer rows]
With ``quantize_gradients`` the reduce-scatter travels as int8 blocks: steps 1-3 of [Note: quantized all-reduce]
(quantized.py), the replica-major layout's rows padded to a multiple of 4 elements so that each replica's row is
one quantized chunk. The all-gather carries parameters, not gradients: rounding them would leave every replica's
masters off by a quantum, and an update smaller than half a quantum would be lost on every step. So it stays in
the master dtype with ``quantize_gradients=True``; with ``"error_feedback"`` what travels in int8 is the step's
*change* of this replica's rows plus the rounding error left by the last one (the residual's ``reduced`` half):
- this replica keeps a copy of its rows as every replica holds them (``agreed``: taken by the optimizers'
  pre-step hook when there is none, after construction or a load, which writes every replica's rows alike);
- after a step, delta = rows - agreed (the step's change, and any other write to these rows since the last
  step, e.g. a clamp after it); delta + residual is quantized and all-gathered, and agreed and this replica's
  rows become agreed + its own dequantized delta;
- every other replica adds that dequantized delta to its copy of those rows (``settle``).
All replicas then hold the same bits, as in fp32: each adds the same dequantized values to the same rows. The
masters move by the quantized deltas; summed over steps they differ from the optimizer's own updates only by
the last residual, within one quantization's bound ([Note: error feedback]): the error does not accumulate.
Per step and replica the link carries about n / 2 + n / 2 bytes (int8 both ways, scales 4/B) against the fp32
all-reduce's 4 n: a quarter, as the quantized all-reduce. The residuals (the contribution's r x row elements in
the reduction dtype, the delta's row in the master dtype) are carried by sharded checkpoints like the others
([Note: residuals in checkpoints] in feedback_state.py).

[Note: rows when a run ends]
A run that ends leaves the last step's all-gather of rows in flight: no forward follows to settle it. Dropping it
would leave this replica holding the other replicas' rows from before that step, and the next run (a second
``fit`` in the same process, a state dict of a module left sharded) would start from parameters that differ
across replicas. So:
- a run that ends well settles every unit's rows (a wait: every rank issued the all-gather);
- a failure on every rank alike ([Note: a lone failure] in reliability.py) keeps the groups, and each rank issued
  the same all-gathers before it raised: each is waited for, bounded by the failure grace (ranks that fail at
  different points may never match), and taken if it completed;
- a lone failure destroys the groups: what has already arrived is taken, nothing is waited for.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from torch import Tensor

import triton_kernels
from lightning_mics import collectives as C
from lightning_mics import quantized as Q
from lightning_mics.placement import ShardedParam
from lightning_mics.telemetry import CommLog
from lightning_mics.topology import Topology

_POLL_S = 0.005


class OptimizerRows:
    """One unit's optimizer rows over the replica group ([Note: optimizer rows over replicas]): where each
    parameter's rows sit in the replica-major layout, the gradients' reduce-scatter, the rows' all-gather."""

    def __init__(self, params: Sequence[ShardedParam], topo: Topology, log: CommLog, kernels: str,
                 quantize: Optional[Q.QuantizeSpec] = None, reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.params, self.log, self.kernels = list(params), log, kernels
        self.group, self.r = topo.replica_group, topo.layout.replicas
        self.offsets: List[int] = [0]  # of each parameter's slot in one replica's row of the layout
        for sp in self.params:
            self.offsets.append(self.offsets[-1] + sp.rows.sub_chunk * sp.rows.rest)
        self.quantize = quantize or Q.QuantizeSpec()  # [Note: quantized optimizer rows]
        self.deltas = self.quantize.gradients == "error_feedback"  # the all-gather sends int8 deltas
        self.row = Q.chunk_numel(self.offsets[-1])  # one replica's row, padded to a whole quantized chunk
        self.reduce_dtype = reduce_dtype or self.params[0].local.dtype
        self.residual: Optional[Q.Residual] = None  # error feedback: (contribution, delta), lazily
        self._agreed: Optional[Tensor] = None  # this replica's rows as every replica holds them (int8 deltas)
        self._pending: Optional[C.AllGatherResult] = None  # the updated rows' all-gather, in flight

    @staticmethod
    def _chunk(flat: Tensor, sp: ShardedParam) -> Tensor:
        """The chunk's unpadded rows of ``sp`` in a flat-shard-layout tensor."""
        return flat[sp.offset:sp.offset + sp.rows.local_rows * sp.rows.rest].view(sp.rows.local_rows, *sp.shape[1:])

    def reduce_scatter(self, accum: Tensor, async_op: bool) -> C.ReduceScatterResult:
        """Sums ``accum`` (the window's shard gradients, flat-shard layout) over the replicas; the output holds
        this replica's rows of every parameter (``rows_of``)."""
        chunks = [self._chunk(accum, sp) for sp in self.params]
        if not self.quantize.gradients:
            return C.reduce_scatter_grads(chunks, self.group, self.r, dtype=accum.dtype, async_op=async_op,
                                          log=self.log, group_name="replicate", kernels=self.kernels,
                                          fewest_bytes=True)  # [Note: reduce-scatter on gloo] in collectives.py
        send = triton_kernels.chunk_cat(chunks, self.r, dtype=accum.dtype, backend=self.kernels)  # replica-major
        if self.row > self.offsets[-1]:  # each replica's row padded to a whole quantized chunk
            send = torch.nn.functional.pad(send, (0, self.row - self.offsets[-1]))
        return Q.quantized_reduce_scatter(send.view(-1), self.group, self.quantize.block_size, async_op=async_op,
                                          residual=self._residual().contribution if self.deltas else None,
                                          log=self.log, group_name="replicate", kernels=self.kernels)

    def _residual(self) -> Q.Residual:
        if self.residual is None:
            master = self.params[0].local
            self.residual = Q.Residual(torch.zeros(self.r * self.row, dtype=self.reduce_dtype, device=master.device),
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
        send = torch.zeros(numel, dtype=dtype, device=device)
        for i, t in enumerate(locals_):
            if t is not None and t.numel():
                send[self.offsets[i]:self.offsets[i] + t.numel()].copy_(t.reshape(-1))
        return send

    def _gather(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype, device: torch.device,
                async_op: bool) -> C.AllGatherResult:
        send = self._pack(locals_, dtype, device, self.offsets[-1])
        return C.all_gather_flat(send, self.group, self.r, async_op=async_op, log=self.log, group_name="replicate")

    # -- the master rows around a step ----------------------------------------------------------------------
    def snapshot(self) -> None:
        """Before an optimizer step, with int8 deltas and no ``agreed`` copy ([Note: quantized optimizer rows]):
        this replica's rows as every replica holds them. No wait: the other replicas' rows may still be on their
        way (under Lightning's automatic optimization this hook runs before the closure's forward, which waits for
        them unit by unit)."""
        if self.deltas and self._agreed is None:
            ref = self.params[0].local
            with torch.no_grad():
                self._agreed = self._pack([sp.stepped for sp in self.params], ref.dtype, ref.device, self.row)

    def written(self) -> None:
        """Every replica's rows were written alike (a load): the next step's pre-step hook copies them afresh."""
        self._agreed = None

    def share(self, shard_flat: Tensor) -> None:
        """After an optimizer step: starts the all-gather of this replica's updated rows (async)."""
        self.settle()
        if not self.deltas:
            self._pending = self._gather([sp.stepped for sp in self.params], shard_flat.dtype, shard_flat.device,
                                         async_op=True)
            return
        agreed = self._agreed
        if agreed is None:
            raise RuntimeError("MiCS engine: an optimizer step with int8 deltas of the optimizer's rows but no "
                               "copy of them before it (the optimizer's pre-step hook did not run)")
        with torch.no_grad():
            delta = self._pack([sp.stepped for sp in self.params], agreed.dtype, agreed.device, self.row)
            delta.sub_(agreed)
            own = torch.empty_like(delta)  # this replica's change as every replica dequantizes it
            self._pending = Q.quantized_all_gather(delta, self.group, self.r, self.quantize.block_size, own=own,
                                                   residual=self._residual().reduced, async_op=True,
                                                   log=self.log, group_name="replicate", kernels=self.kernels)
            agreed.add_(own)  # the rows every replica will hold: the others add the same bits in ``settle``
            for sp, o in zip(self.params, self.offsets):
                sp.stepped.view(-1).copy_(agreed[o:o + sp.stepped.numel()])

    def settle(self) -> None:
        """Waits for the rows' all-gather, if one is in flight, and writes the other replicas' rows into the
        chunks (with int8 deltas: adds their change to them). This replica's own rows are left as they are
        (another optimizer may have stepped them since)."""
        res, self._pending = self._pending, None
        if res is None:
            return
        out = C.gathered(res, self.log)
        with torch.no_grad():
            for sp, o in zip(self.params, self.offsets):
                for j in range(self.r):
                    lo, hi = sp.rows.sub_rows(j)
                    if hi == lo or j == sp.rows.replica:
                        continue
                    rows, got = sp.local[lo:hi].view(-1), out[j, o:o + (hi - lo) * sp.rows.rest]
                    if self.deltas:
                        rows.add_(got)
                    else:
                        rows.copy_(got)

    def drop(self, deadline: float = 0.0) -> None:
        """Local reset after a failure, no collective issued: the rows' all-gather in flight is given until
        ``deadline`` (``time.monotonic()``) to complete and is taken if it did, otherwise dropped ([Note: rows
        when a run ends]). The error-feedback residual is the gradient path's to drop (``UnitGrads.drop``)."""
        work = self._pending.work if self._pending is not None else None
        while work is not None and not work.is_completed() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if self._pending is not None and (work is None or work.is_completed()):
            self.settle()
        self._pending = self._agreed = None

    # -- optimizer state ---------------------------------------------------------------------------------------
    def chunks(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype,
               device: torch.device) -> List[Optional[Tensor]]:
        """Whole chunks (the shard group's rows) of per-parameter optimizer-state rows (``None``: no such
        tensor): an all-gather over the replica group. Collective; every replica passes the same Nones."""
        out = C.gathered(self._gather(locals_, dtype, device, async_op=False), self.log)
        fulls = [torch.empty(sp.rows.local_rows, *sp.shape[1:], dtype=dtype, device=device) for sp in self.params]
        C.copy_out(out, fulls, self.r, "torch")
        return [f if t is not None else None for f, t in zip(fulls, locals_)]
