"""Counts the host's reads of tensor data: what would stop the host until the device catches up on a GPU.

On CPU every read is free, so the count is what a test can assert. Counted, as the dispatcher sees them:

- ``aten._local_scalar_dense``: ``item()``, ``bool()``, ``int()``, ``float()``, a tensor in an ``if``;
- the ops whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``...) and ``equal``,
  which a CUDA tensor answers only after a synchronization;
- ``_to_copy`` / ``copy_`` into host memory from another device.

``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu`` of a host tensor never reach the dispatcher (they read the
memory directly, or return the tensor itself), so while the mode is on they are counted by patching them; what they
dispatch inside is not counted again. Each read is attributed to the innermost frame outside torch, as ``file:function``
(``_where``): ``engine`` when that frame is the package's (it asked for the read, directly or through torch),
``optimizer`` for torch.optim's own reads, else ``outside`` (Lightning, the user's loop).

On CPU a host tensor and a device tensor look alike: a read of a tensor the engine keeps in host memory by design (free
on a GPU) counts here too, so the budget a test asserts names each site and says which are which.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
            aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
            aten.repeat_interleave.Tensor, aten.nonzero_static.default}
_TORCH = os.path.dirname(torch.__file__)
_OPTIM = os.path.join(_TORCH, "optim")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENGINE = (os.path.join(_REPO, "lightning_mics"), os.path.join(_REPO, "triton_kernels"))
_PATCHED = ("tolist", "numpy", "cpu")


def _off_host(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _where() -> Tuple[str, str]:
    """(who, ``file:function``) of the innermost frame outside torch and this file: who is ``engine`` for a frame
    in ``lightning_mics/`` or ``triton_kernels/``, ``optimizer`` when the read is torch.optim's own (an
    optimizer's step counts, host tensors unless ``capturable``), else ``outside``."""
    optim = False
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = os.path.abspath(frame.filename)
        if f.startswith(_OPTIM):
            optim = True
        if f.startswith(_TORCH) or f == os.path.abspath(__file__):
            continue
        who = "optimizer" if optim else "engine" if f.startswith(_ENGINE) else "outside"
        return who, f"{os.path.relpath(f, _REPO) if f.startswith(_REPO) else os.path.basename(f)}:{frame.name}"
    return "outside", "?"


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...``; then ``reads.engine`` (the engine's reads), ``reads.outside`` (all
    others) and ``reads.sites`` (a Counter of ``(who, file:function, what)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter = Counter()
        self._inside = 0  # inside a patched method: its own dispatches are not counted again
        self._saved: Dict[str, object] = {}

    def _record(self, what: str) -> None:
        who, where = _where()
        self.sites[(who, where, what)] += 1

    @property
    def engine(self) -> int:
        return sum(n for (who, _, _), n in self.sites.items() if who == "engine")

    @property
    def outside(self) -> int:
        return sum(n for (who, _, _), n in self.sites.items() if who != "engine")

    def by_site(self) -> Dict[str, int]:
        """The engine's reads per ``file:function``."""
        out: Counter = Counter()
        for (who, where, _), n in self.sites.items():
            if who == "engine":
                out[where] += n
        return dict(out)

    def listing(self) -> List[Tuple[str, str, str, int]]:
        return sorted((who, where, what, n) for (who, where, what), n in self.sites.items())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside:
            if func in _SYNCING:
                self._record(func.__name__)
            elif func is aten._to_copy.default and _off_host(args[0]) and \
                    torch.device(kwargs.get("device") or args[0].device).type == "cpu":
                self._record("to_host")
            elif func is aten.copy_.default and not _off_host(args[0]) and _off_host(args[1]):
                self._record("copy_to_host")
        return func(*args, **kwargs)

    def _patch(self, name: str):
        original = self._saved[name]

        def method(t, *a, **k):
            if self._inside == 0:
                self._record(name)
            self._inside += 1
            try:
                return original(t, *a, **k)
            finally:
                self._inside -= 1
        return method

    def __enter__(self):
        for name in _PATCHED:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._patch(name))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, m in self._saved.items():
                setattr(torch.Tensor, name, m)
            self._saved.clear()
