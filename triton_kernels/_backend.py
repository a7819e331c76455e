"""Backend choice: "auto" | "triton" | "torch", and whether the Triton kernels run interpreted.

Nothing here imports a kernel module, and triton itself is imported only to read its
interpreter switch, when a Triton backend is actually considered.
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("auto", "triton", "torch")

_TRITON_FOUND: bool | None = None
_INTERPRETED: bool | None = None


def check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed values: {', '.join(map(repr, BACKENDS))}")
    return backend  # type: ignore[return-value]


def triton_available() -> bool:
    """Whether the optional `triton` package is installed (checked without importing it)."""
    global _TRITON_FOUND
    if _TRITON_FOUND is None:
        try:
            _TRITON_FOUND = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):
            _TRITON_FOUND = False
    return _TRITON_FOUND


def kernels_interpreted() -> bool:
    """Whether our kernels run in the Triton interpreter: TRITON_INTERPRET as Triton reads it, fixed at
    the first call (the kernel modules are imported right after it, and `triton.jit` reads the same
    switch when they are; the launcher in _copy.py checks that the two agree)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        from triton import knobs

        _INTERPRETED = bool(knobs.runtime.interpret)
    return _INTERPRETED


# [Note: auto's size rule]
# On CUDA "auto" runs a bucket copy in Triton from AUTO_MIN_NUMEL buffer elements up (padding included), and
# chunk_split with a cast at any size; torch below. AUTO_MIN_NUMEL (2**26, 256 MB of fp32) is the first measured
# size at which every copy op ran in Triton about as fast as its best torch baseline or faster (H100, triton 3.6:
# benchmarks/kernels_h100.md); below it flatten and the other no-cast ops lose to torch at some tensor counts
# (the host's launch cost), while chunk_split with a cast wins in Triton at every size. 64-256 MB was not measured and those runs reused their
# tensors: measure again on a GPU with `python benchmarks/kernels.py --rotate` and set it here. The quantized ops
# take no size: Triton beats their torch fallback at every size from 1 MB (quant_kernels_h100.md).
AUTO_MIN_NUMEL = 1 << 26


def use_triton(backend: str, device: torch.device | None, numel: int | None = None) -> bool:
    """"auto": Triton for CUDA tensors (compiled, not interpreted) of at least `numel` >= AUTO_MIN_NUMEL
    elements (None: any size), torch elsewhere ([Note: auto's size rule]); "triton" forces it."""
    if backend == "torch" or device is None:
        return False
    if backend == "auto":
        return (device.type == "cuda" and (numel is None or numel >= AUTO_MIN_NUMEL) and triton_available()
                and not kernels_interpreted())
    why = triton_unusable(device.type)
    if why is not None:
        raise RuntimeError(f"backend='triton': {why}")
    return True


def triton_unusable(device_type: str) -> str | None:
    """Why the Triton kernels cannot run on ``device_type`` tensors in this process (None: they can)."""
    if not triton_available():
        return "the optional triton package is not installed (pip install triton)"
    interpreted = kernels_interpreted()
    if device_type == "cpu" and not interpreted:
        return "on CPU tensors they run only under TRITON_INTERPRET=1, set before the first Triton call"
    if device_type != "cpu" and (device_type != "cuda" or interpreted):
        return (f"on {device_type} tensors they run only compiled for CUDA (the interpreter of TRITON_INTERPRET=1 "
                "cannot follow the device pointers in the descriptor table)")
    return None
