"""Counts c10d collectives as the dispatcher sees them, with the ranks of their process group.

Independent of the strategy's own telemetry: every eager c10d call (all-gather, reduce-scatter, all-reduce)
passes the dispatcher as a ``c10d.*`` op whose arguments include the ProcessGroup.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_NAMES = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast_": "broadcast", "barrier": "barrier",
}


class CommCounter(TorchDispatchMode):
    def __init__(self, live=None) -> None:
        super().__init__()
        self.live = live  # an optional tests.helpers.live.LiveMeter, sampled at every op
        self.replayed = 0  # forward-only ops (gelu) run while autograd runs a backward: recomputation
        self.events: List[Tuple[str, Tuple[int, ...], int]] = []  # (op, group ranks, bytes)
        self.dtypes: List[torch.dtype] = []  # dtype of each event's largest buffer, parallel to events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.gelu.default and torch._C._current_graph_task_id() != -1:
            self.replayed += 1
        if self.live is not None:
            out = func(*args, **kwargs)
            if func.namespace == "c10d" and _NAMES.get(func._schema.name.split("::")[-1]) == "all_gather":
                self.live.on_all_gather(args[0] if isinstance(args[0], torch.Tensor) else args[0][0])
            self.live.sample()  # the op's inputs still count while it runs
            if func.namespace != "c10d" and not func.is_view:  # a view of an output is not its copy-out
                self.live.read_by_compute(t for a in (*args, *kwargs.values())
                                          for t in (a if isinstance(a, (list, tuple)) else (a,)))
            self._count(func, args, kwargs)
            return out
        self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def marker(self, name: str) -> None:
        """A named point between the collectives (e.g. a unit's forward starting)."""
        self.events.append((name, None, 0))
        self.dtypes.append(None)

    def _count(self, func, args, kwargs) -> None:
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            op = _NAMES.get(name, name)
            group = None
            nbytes = 0
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.ScriptObject) and group is None:
                    try:
                        group = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
                    except RuntimeError:
                        pass
            # bytes of the largest buffer involved (the gathered output / the pre-reduce input)
            dtype = None
            for a in list(args) + list(kwargs.values()):
                ts = [t for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
                size = sum(t.numel() * t.element_size() for t in ts)
                if size > nbytes:
                    nbytes, dtype = size, ts[0].dtype
            self.events.append((op, group, nbytes))
            self.dtypes.append(dtype)

    def counts(self) -> Counter:
        return Counter((op, group) for op, group, _ in self.events)

    def reset(self) -> None:
        self.events.clear()
        self.dtypes.clear()
