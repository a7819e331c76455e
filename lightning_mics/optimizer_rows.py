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
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from lightning_mics import collectives as C
from lightning_mics.placement import ShardedParam
from lightning_mics.telemetry import CommLog
from lightning_mics.topology import Topology


class OptimizerRows:
    """One unit's optimizer rows over the replica group ([Note: optimizer rows over replicas]): where each
    parameter's rows sit in the replica-major layout, the gradients' reduce-scatter, the rows' all-gather."""

    def __init__(self, params: Sequence[ShardedParam], topo: Topology, log: CommLog, kernels: str) -> None:
        self.params, self.log, self.kernels = list(params), log, kernels
        self.group, self.r = topo.replica_group, topo.layout.replicas
        self.offsets: List[int] = [0]  # of each parameter's slot in one replica's row of the layout
        for sp in self.params:
            self.offsets.append(self.offsets[-1] + sp.rows.sub_chunk * sp.rows.rest)
        self._pending: Optional[C.AllGatherResult] = None  # the updated rows' all-gather, in flight

    @staticmethod
    def _chunk(flat: Tensor, sp: ShardedParam) -> Tensor:
        """The chunk's unpadded rows of ``sp`` in a flat-shard-layout tensor."""
        return flat[sp.offset:sp.offset + sp.rows.local_rows * sp.rows.rest].view(sp.rows.local_rows, *sp.shape[1:])

    def reduce_scatter(self, accum: Tensor, async_op: bool) -> C.ReduceScatterResult:
        """Sums ``accum`` (the window's shard gradients, flat-shard layout) over the replicas; the output holds
        this replica's rows of every parameter (``rows_of``)."""
        chunks = [self._chunk(accum, sp) for sp in self.params]
        return C.reduce_scatter_grads(chunks, self.group, self.r, dtype=accum.dtype, async_op=async_op,
                                      log=self.log, group_name="replicate", kernels=self.kernels,
                                      fewest_bytes=True)  # [Note: reduce-scatter on gloo] in collectives.py

    def rows_of(self, out: Tensor, i: int) -> Tensor:
        """Parameter ``i``'s rows in this replica's row of the layout (a view; the shape of its DTensor's local)."""
        sp = self.params[i]
        o = self.offsets[i]
        return out[o:o + sp.rows.sub_chunk * sp.rows.rest].view(sp.rows.sub_chunk, *sp.shape[1:])[
            : sp.rows.sub_hi - sp.rows.sub_lo]

    def _gather(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype, device: torch.device,
                async_op: bool) -> C.AllGatherResult:
        send = torch.zeros(self.offsets[-1], dtype=dtype, device=device)
        for i, t in enumerate(locals_):
            if t is not None and t.numel():
                send[self.offsets[i]:self.offsets[i] + t.numel()].copy_(t.reshape(-1))
        return C.all_gather_flat(send, self.group, self.r, async_op=async_op, log=self.log, group_name="replicate")

    # -- the master rows after a step -----------------------------------------------------------------------
    def share(self, shard_flat: Tensor) -> None:
        """After an optimizer step: starts the all-gather of this replica's updated rows (async)."""
        self.settle()
        self._pending = self._gather([sp.stepped for sp in self.params], shard_flat.dtype, shard_flat.device,
                                     async_op=True)

    def settle(self) -> None:
        """Waits for the rows' all-gather, if one is in flight, and writes the other replicas' rows into the
        chunks. This replica's own rows are left as they are (another optimizer may have stepped them since)."""
        res, self._pending = self._pending, None
        if res is None:
            return
        out = C.gathered(res, self.log)
        with torch.no_grad():
            for sp, o in zip(self.params, self.offsets):
                for j in range(self.r):
                    lo, hi = sp.rows.sub_rows(j)
                    if j != sp.rows.replica and hi > lo:
                        sp.local[lo:hi].view(-1).copy_(out[j, o:o + (hi - lo) * sp.rows.rest])

    def drop(self) -> None:
        """Local reset after a failure: no wait (a peer may be gone); rows that already arrived are taken."""
        if self._pending is not None and (self._pending.work is None or self._pending.work.is_completed()):
            self.settle()
        self._pending = None

    # -- optimizer state ---------------------------------------------------------------------------------------
    def chunks(self, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype,
               device: torch.device) -> List[Optional[Tensor]]:
        """Whole chunks (the shard group's rows) of per-parameter optimizer-state rows (``None``: no such
        tensor): an all-gather over the replica group. Collective; every replica passes the same Nones."""
        out = C.gathered(self._gather(locals_, dtype, device, async_op=False), self.log)
        fulls = [torch.empty(sp.rows.local_rows, *sp.shape[1:], dtype=dtype, device=device) for sp in self.params]
        C.copy_out(out, fulls, self.r, "torch")
        return [f if t is not None else None for f, t in zip(fulls, locals_)]
