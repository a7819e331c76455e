"""Streaming DiLoCo ([Streaming DiLoCo](https://arxiv.org/abs/2501.18512)): the outer loop's units cut into
fragments, when each fragment is sent and when it applies, and its average while in flight.

[Note: streaming fragments]
``sync_fragments`` F cuts the units into F runs of consecutive units (``split_units``, by elements counted whole: the
same cut on every rank); [Note: the outer step on shards] in outer_sync.py then runs per fragment. Fragment f applies
after the inner steps n with n mod H = (f + 1) H / F, so about 1/F of the shard crosses the replica groups every H / F
steps. Its pseudo-gradient is taken and its all-reduce issued ``sync_delay`` = tau steps earlier; the inner steps run
meanwhile and nothing reads or writes its flat until ``wait()``. At the apply the outer SGD steps only that fragment's
anchors, and each of its masters becomes ``lerp(anchor, master, fragment_mixing)`` (the synced value plus alpha of the
local progress since the send); the anchor stays the synced value. tau < H / F: at most one fragment in flight, the
replica group's only collective until waited for. F = 1, tau = 0: the blocking sync of every master at the window's end.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

from torch import Tensor

from lightning_mics.comm import collectives
from lightning_mics.comm.telemetry import CommLog


def split_units(sizes: Sequence[int], count: int) -> List[List[int]]:
    """The indices of ``sizes`` (each unit's elements, in unit order) cut into ``count`` nonempty runs of consecutive
    indices, each cut where the running total comes nearest its share (ties: the earlier cut)."""
    n, total = len(sizes), sum(sizes)
    if not 1 <= count <= n:
        raise ValueError(f"MiCSStrategy option sync_fragments={count} is invalid: allowed is an integer in [1, {n}], "
                         f"the units that hold parameters in this model (shard_units makes more units).")
    running = [0]
    for size in sizes:
        running.append(running[-1] + size)
    cuts = [0]
    for f in range(1, count):
        candidates = range(cuts[-1] + 1, n - (count - f) + 1)
        cuts.append(min(candidates, key=lambda e: (abs(running[e] * count - f * total), e)))
    cuts.append(n)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def sent_after(steps: int, every: int, count: int, delay: int) -> Optional[int]:
    """The fragment whose all-reduce is issued after inner step ``steps`` (1..H) of the window, or None."""
    period = every // count
    due = steps + delay
    return due // period - 1 if due % period == 0 else None


def applies_after(fragment: int, every: int, count: int) -> int:
    """The inner step of the window (1..H) after which ``fragment``'s average applies."""
    return (fragment + 1) * (every // count)


class Average:
    """The mean of ``flat`` over the replica group, in flight until ``wait()`` ([Note: streams and buffer lifetime]
    in collectives.py): it holds ``flat`` and the collective's holder; ``wait()`` finishes the sum and divides, once."""

    def __init__(self, flat: Tensor, work: Optional[Any], replicas: int, log: Optional[CommLog] = None) -> None:
        self.flat, self.work, self.replicas, self.log, self.done = flat, work, replicas, log, False

    def wait(self) -> Tensor:
        if not self.done:
            collectives.wait(self.work, self.log)
            self.work, self.done = None, True
            if self.replicas > 1:
                self.flat.mul_(1.0 / self.replicas)
        return self.flat

    @classmethod
    def of(cls, mean: Tensor) -> "Average":
        """A mean already made (a checkpoint's)."""
        out = cls(mean, None, 1)
        out.done = True
        return out


class InFlight(NamedTuple):
    """A fragment sent and not yet applied ([Note: streaming fragments])."""

    fragment: int
    average: Average
