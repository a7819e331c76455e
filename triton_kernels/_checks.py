"""Argument checks and the chunk layout, shared by the Triton and torch paths.

Both backends go through the same checks, so they accept and refuse exactly the same inputs.
Nothing here imports triton or a kernel module (the backend choice is _backend.py).
"""

from __future__ import annotations

import operator
from itertools import accumulate
from typing import NamedTuple, Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_CHUNKS = 65535  # CUDA's limit on grid axis 1, where the Triton kernels put the chunk index


class Layout(NamedTuple):
    """Where every tensor lives in a (num_chunks, total) buffer; flatten is num_chunks == 1.

    Row j, columns offsets[i] : offsets[i] + segs[i] hold elements j*segs[i] ... of tensor i
    (the rows of torch.chunk's j-th chunk), zero-padded past numels[i].
    """

    numels: tuple[int, ...]
    segs: tuple[int, ...]  # c_i * rest_i: tensor i's padded chunk, in elements
    offsets: tuple[int, ...]  # where tensor i's chunk starts inside one row
    total: int  # elements in one row
    num_chunks: int


def check_num_chunks(num_chunks: object) -> int:
    try:
        n = operator.index(num_chunks)  # ints and int-likes (numpy ints), not floats or bools
    except TypeError:
        n = None
    if n is None or isinstance(num_chunks, bool) or not 1 <= n <= MAX_CHUNKS:
        raise ValueError(f"num_chunks={num_chunks!r} must be an int in [1, {MAX_CHUNKS}]")
    return n


def check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {dtype}; supported dtypes: {', '.join(map(str, SUPPORTED_DTYPES))}")


def check_tensors(name: str, tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """Every tensor contiguous, of a supported dtype, all on one device (returned; None if empty)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    try:  # the common case in one quick pass per property; the loop below finds the culprit
        ok = (len({t.device for t in tensors}) <= 1 and {t.dtype for t in tensors} <= set(SUPPORTED_DTYPES)
              and all([t.is_contiguous() for t in tensors]))
    except AttributeError:
        ok = False
    if ok:
        return tensors[0].device if len(tensors) else None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        check_dtype(f"{name}[{i}]", t.dtype)
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {tensors[0].device}: mixed devices")
    raise AssertionError("unreachable")


def check_buffer(name: str, buf: torch.Tensor, numel: int, rows: int | None, device: torch.device | None) -> None:
    """buf is contiguous with `numel` elements; with `rows`, it is 1-D or (rows, numel // rows)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    check_dtype(name, buf.dtype)
    if not buf.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(buf.shape)}, strides {buf.stride()}) is not contiguous")
    if device is not None and buf.device != device:
        raise ValueError(f"{name} is on {buf.device} but the tensors are on {device}: mixed devices")
    shape2d = None if rows is None else (rows, numel // rows)
    if buf.numel() != numel or (shape2d is not None and buf.dim() != 1 and tuple(buf.shape) != shape2d):
        want = f"{numel} elements" if shape2d is None else f"shape ({numel},) or {shape2d}"
        raise ValueError(f"size mismatch: {name} has shape {tuple(buf.shape)} ({buf.numel()} elements) "
                         f"but the tensors need {want}")


def resolve_dtype(dtype: torch.dtype | None, out: torch.Tensor | None, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    if dtype is not None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
        if out is not None and out.dtype != dtype:
            raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}; pass one of them")
        return dtype
    if out is not None:
        return out.dtype
    return tensors[0].dtype if len(tensors) else torch.float32


def make_layout(tensors: Sequence[torch.Tensor], num_chunks: int) -> Layout:
    """torch.chunk rows along dim 0 (a 0-d tensor counts as shape (1,)), padded to c_i = ceil(d0 / num_chunks)."""
    numels = [t.numel() for t in tensors]
    if num_chunks == 1:
        segs = numels
    else:
        d0s = [t.shape[0] if t.dim() else 1 for t in tensors]
        segs = [-(-d0 // num_chunks) * (n // d0) if d0 else 0 for n, d0 in zip(numels, d0s)]
    offsets = list(accumulate(segs, initial=0))
    return Layout(tuple(numels), tuple(segs), tuple(offsets[:-1]), offsets[-1], num_chunks)
