"""The four public ops: check arguments once, then run the Triton kernel or the torch fallback.

flatten / chunk_cat pack tensors into a (num_chunks, total) buffer (flatten: one chunk, 1-D);
scatter / chunk_split are their exact inverses. See _checks.Layout for the layout, pack.py and
unpack.py for the kernels, _fallback.py for the torch ops. None of them is seen by autograd.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _fallback
from ._backend import check_backend, use_triton
from ._checks import check_buffer, check_num_chunks, check_tensors, make_layout, resolve_dtype


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
            backend: str = "auto") -> torch.Tensor:
    """Every tensor's elements in order in one 1-D buffer, cast to `dtype` (default: out's, else tensors[0]'s).

    `out` (any shape, contiguous, sum-of-numels elements) is filled and returned if given.
    """
    return _pack(tensors, 1, out, dtype, backend, two_d=False)


def chunk_cat(tensors: Sequence[torch.Tensor], num_chunks: int, out: torch.Tensor | None = None,
              dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """The reduce-scatter input: bit-identical to torch._chunk_cat(tensors, 0, num_chunks), cast to `dtype`.

    Tensor i is split along dim 0 into num_chunks chunks of c_i = ceil(size(0) / num_chunks) rows
    (torch.chunk's rows; a 0-d tensor is shape (1,)), each zero-padded to c_i * rest_i elements;
    row j of the (num_chunks, sum_i c_i * rest_i) result holds chunk j of every tensor in order.
    `out` may be that shape or 1-D with that many elements.
    """
    return _pack(tensors, check_num_chunks(num_chunks), out, dtype, backend, two_d=True)


def scatter(flat: torch.Tensor, outs: Sequence[torch.Tensor], backend: str = "auto") -> Sequence[torch.Tensor]:
    """Inverse of flatten: consecutive slices of `flat` into each of `outs`, cast to each one's dtype."""
    return _unpack(flat, outs, 1, backend)


def chunk_split(flat: torch.Tensor, outs: Sequence[torch.Tensor], num_chunks: int,
                backend: str = "auto") -> Sequence[torch.Tensor]:
    """Inverse of chunk_cat (all-gather copy-out): `flat` is (num_chunks, total), or 1-D of that size,
    laid out as chunk_cat lays it out; each outs[i] (full, unpadded) receives its rows from every
    chunk, padding dropped, cast to outs[i].dtype."""
    return _unpack(flat, outs, check_num_chunks(num_chunks), backend)


def _pack(tensors, num_chunks, out, dtype, backend, two_d):
    backend = check_backend(backend)
    device = check_tensors("tensors", tensors)
    dtype = resolve_dtype(dtype, out, tensors)
    layout = make_layout(tensors, num_chunks)
    rows = num_chunks if two_d else None  # flatten's out may have any shape, chunk_cat's is 1-D or 2-D
    if out is None:
        shape = (num_chunks, layout.total) if two_d else (layout.total,)
        out = torch.empty(shape, dtype=dtype, device=device if device is not None else "cpu")
    else:
        check_buffer("out", out, num_chunks * layout.total, rows, device)
    if layout.total == 0:
        return out
    with torch.no_grad():
        if use_triton(backend, device, num_chunks * layout.total):
            from .pack import launch_pack

            launch_pack(tensors, layout, out)
        elif not two_d:
            _fallback.flatten(tensors, out.view(-1), layout)
        else:
            _fallback.chunk_cat(tensors, layout, out.view(num_chunks, layout.total))
    return out


def _unpack(flat, outs, num_chunks, backend):
    backend = check_backend(backend)
    device = check_tensors("outs", outs)
    layout = make_layout(outs, num_chunks)
    check_buffer("flat", flat, num_chunks * layout.total, None if num_chunks == 1 else num_chunks, device)
    if layout.total == 0:
        return outs
    # [Note: auto's size rule]: chunk_split with a cast is Triton's at any size, the others from a size up
    casts = num_chunks > 1 and backend == "auto" and any([o.dtype != flat.dtype for o in outs])
    with torch.no_grad():
        if use_triton(backend, device, None if casts else num_chunks * layout.total):
            from .unpack import launch_unpack

            launch_unpack(flat, outs, layout)
        elif num_chunks == 1:
            _fallback.scatter(flat.view(-1), outs, layout)
        else:
            _fallback.chunk_split(flat.view(num_chunks, layout.total), outs, layout)
    return outs
