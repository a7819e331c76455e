"""Gathered-parameter elements alive at every dispatched op, measured from storages (not the engine's counter).

Alive at a given moment: (a) the storages of the plain (non-DTensor) parameters the modules hold, except the
masters the optimizer steps (a replicated parameter's plain twin shares its master's storage); (b) every
all-gather output buffer that someone besides this meter still holds (``_storage_Use_Count`` > 1), until a
computation (not a collective) has read it: its copy-out, after which the engine is done with it. Without that
last rule (b) would include an output for as long as gloo's communication thread takes to drop its Work after
the wait returns, which on a loaded machine can be several ops later. ``peak_param_bytes`` is (a) alone.
"""

from __future__ import annotations

from typing import Iterable, List

import torch
from torch.distributed.tensor import DTensor


class LiveMeter:
    def __init__(self, module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.module = module
        self.masters = {p._local_tensor.untyped_storage().data_ptr() for o in optimizers
                        for g in o.param_groups for p in g["params"] if isinstance(p, DTensor)}
        self.pending: List[torch.UntypedStorage] = []
        self.peak_bytes = 0
        self.peak_param_bytes = 0  # (a) alone: what the modules hold, without transient communication buffers

    def on_all_gather(self, output: torch.Tensor) -> None:
        self.pending.append(output.untyped_storage())

    def read_by_compute(self, inputs: Iterable[object]) -> None:
        """A non-communication op read these: an all-gather output among them has been copied out."""
        if not self.pending:
            return
        ptrs = {t.untyped_storage().data_ptr() for t in inputs
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and not t.is_meta}
        if ptrs:
            self.pending = [st for st in self.pending if st.data_ptr() not in ptrs]

    def sample(self) -> None:
        seen, total = set(), 0
        for m in self.module.modules():
            for p in m._parameters.values():
                if p is None or isinstance(p, DTensor):
                    continue
                st = p.untyped_storage()
                ptr = st.data_ptr()
                if st.nbytes() == 0 or ptr in self.masters or ptr in seen:
                    continue
                seen.add(ptr)
                total += st.nbytes()
        self.peak_param_bytes = max(self.peak_param_bytes, total)
        self.pending = [st for st in self.pending if torch._C._storage_Use_Count(st._cdata) > 1]
        for st in self.pending:
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, total)
