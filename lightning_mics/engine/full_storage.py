"""One unit's full storage: the buffer in param_dtype its full parameters alias, allocated while the unit is
gathered and freed while it is sharded, and lent to the unit's reduce-scatter input once it is released.

[Note: staging in place]
A unit released right after its gradients are reduce-scattered no longer needs its full parameters once the
reduction starts: its backward is done. The rank-major reduce-scatter input is laid out in the unit's own
full-parameter storage (allocated with room for it: the padded s x S elements in reduce_dtype, when reduce_dtype is
no wider than param_dtype), instead of in a new buffer of the unit's size. The release then leaves the storage
allocated until the last reduce-scatter reading it is waited for (``finish_reduce`` frees it: ``done_reading``), and
a gather or refresh that writes the storage first waits for those reductions ([Note: streams and buffer lifetime]
in collectives.py). Units kept gathered (the root inside an accumulation window, a pinned unit, a unit still running
its forward) stage in a buffer of their own as before. On CPU, where a buffer above glibc's mmap threshold is a
fresh mapping every time, this saves the page faults of one unit-sized buffer per reduction; everywhere it lowers
the backward peak by one.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor

from lightning_mics.comm import collectives
from lightning_mics.comm.telemetry import CommLog


class FullStorage:
    """``flat``: the full parameters' buffer (``numel`` elements of ``dtype``): allocated until the unit, having
    made its views, calls ``release``; then again from ``fill`` to ``release``."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, staging_numel: int,
                 reduce_dtype: torch.dtype) -> None:
        """``staging_numel``: reduce_dtype elements of the unit's reduce-scatter input (the padded s x S), staged
        here when reduce_dtype is no wider than ``dtype`` and there is a shard group to reduce over (> 0)."""
        self.flat = torch.empty(numel, dtype=dtype, device=device)
        self.full_nbytes = self.flat.untyped_storage().nbytes()
        self.stages = staging_numel > 0 and reduce_dtype.itemsize <= dtype.itemsize
        self.gathered_nbytes = max(self.full_nbytes, staging_numel * reduce_dtype.itemsize) if self.stages \
            else self.full_nbytes
        self.reduce_dtype, self.device = reduce_dtype, device
        self.released = True  # no full parameters in it (a reader may keep it allocated)
        self._readers: List[Any] = []  # reduce-scatters whose input lies in it, until waited for

    def nbytes(self, pinned: bool) -> int:
        """Bytes allocated while gathered: a pinned unit never stages, so it needs no room for it."""
        return self.full_nbytes if pinned else self.gathered_nbytes

    def fill(self, pinned: bool, log: Optional[CommLog]) -> None:
        """Before the full parameters are written into it: the reductions still reading it are waited for."""
        self.settle(log)
        self.flat.untyped_storage().resize_(self.nbytes(pinned))
        self.released = False

    def settle(self, log: Optional[CommLog]) -> None:
        for work in self._readers:
            collectives.wait(work, log)
        self._readers.clear()

    def release(self) -> None:
        """Freed, or left to the last reduce-scatter reading it."""
        self.released = True
        if not self._readers:
            self.flat.untyped_storage().resize_(0)

    def drop(self) -> None:
        """After a failure (no wait): freed unless a collective may still read it, then left allocated."""
        self.released = True
        if not self._readers:
            self.flat.untyped_storage().resize_(0)
        self._readers.clear()

    def staging(self, at: int, rows: int, cols: int) -> Tensor:
        """A (rows, cols) reduce_dtype view of the storage, ``at`` elements (of reduce_dtype) in."""
        return torch.empty(0, dtype=self.reduce_dtype, device=self.device).set_(
            self.flat.untyped_storage(), at, (rows, cols))

    def reading(self, work: Optional[Any]) -> None:
        """A reduce-scatter reads its input from the storage until ``work`` is waited for."""
        if work is not None:
            self._readers.append(work)

    def done_reading(self, work: Optional[Any]) -> None:
        """``work`` was waited for; the last reader frees the storage a release left allocated."""
        if work is not None and work in self._readers:
            self._readers.remove(work)
            if not self._readers and self.released:
                self.flat.untyped_storage().resize_(0)
