"""The descriptor table that lets one Triton launch cover any number of tensors.

One int64 tensor on the device holds, per tensor i, a row of NCOLS values
    [data_ptr, numel, seg, offset, first_block, flags]
(seg/offset: see _checks.Layout; flags: dtype tag in bits 0-1, ALIGNED in bit 2), followed by the
block map: one entry per BLOCK-element block of every tensor's chunk, naming the tensor. The grid is
(number of blocks, num_chunks): program (g, j) copies block g - first_block[i] of chunk j of tensor
i = map[g], so the work is balanced however uneven the sizes. Nothing here imports triton.

ALIGNED means tensor i's blocks start on 16-byte boundaries on both sides (data_ptr, offset, and for
num_chunks > 1 the row and chunk strides), so the kernel may use unmasked 128-bit loads/stores for
its full blocks. Tables are cached by everything they are computed from (pointers included), so a
bucket copied every step builds and uploads its table once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import repeat
from typing import NamedTuple, Sequence

import torch

from ._checks import Layout

NCOLS = 6
ALIGNED = 4
TAGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
BLOCK = 4096  # elements per program: 16 KB of fp32, 32 per thread with 4 warps
_CACHE: OrderedDict[tuple, Descriptors] = OrderedDict()
_CACHE_SIZE = 64
_LOCK = threading.Lock()


class Descriptors(NamedTuple):
    table: torch.Tensor  # (n, NCOLS) int64 on the buffer's device
    block_map: torch.Tensor  # (n_blocks,) int64, tensor index of every block
    n_blocks: int
    dtype: torch.dtype | None  # the tensors' one dtype, or None when they mix dtypes


def descriptors(tensors: Sequence[torch.Tensor], layout: Layout, buf: torch.Tensor) -> Descriptors:
    bes = buf.element_size()
    buf_ok = buf.data_ptr() % 16 == 0 and (layout.num_chunks == 1 or layout.total * bes % 16 == 0)
    key = (buf.device, buf_ok, bes, layout.num_chunks, layout.numels, layout.segs,
           tuple([t.data_ptr() for t in tensors]), tuple([t.dtype for t in tensors]))
    return _cached(key, lambda: _build(key, layout))


def tensor_table(tensors: Sequence[torch.Tensor], device: torch.device) -> Descriptors:
    """The quantize kernel's table: per NON-EMPTY tensor i a row [data_ptr, numel, flat offset, dtype tag],
    rows in order (so flat offsets increase strictly); no block map (block_map is empty, n_blocks = rows)."""
    key = ("flat", device, tuple([t.data_ptr() for t in tensors]), tuple([t.numel() for t in tensors]),
           tuple([t.dtype for t in tensors]))
    return _cached(key, lambda: _build_flat(tensors, device))


def _cached(key: tuple, build) -> Descriptors:
    with _LOCK:  # autograd may run hooks (and so these copies) on its own threads
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = build()
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
    if hit.table.is_cuda:  # the cached table may be read on another stream than it was made on
        hit.table.record_stream(torch.cuda.current_stream(hit.table.device))  # (table and map share it)
    return hit


def _build_flat(tensors: Sequence[torch.Tensor], device: torch.device) -> Descriptors:
    rows, off = [], 0
    for t in tensors:
        if t.numel():
            rows += (t.data_ptr(), t.numel(), off, TAGS[t.dtype])
            off += t.numel()
    table = torch.tensor(rows, dtype=torch.int64).to(device).view(-1, 4)
    kinds = {t.dtype for t in tensors if t.numel()}
    return Descriptors(table, table.new_empty(0), table.shape[0], kinds.pop() if len(kinds) == 1 else None)


def _build(key: tuple, layout: Layout) -> Descriptors:
    device, buf_ok, bes, num_chunks, numels, segs, ptrs, dtypes = key
    table, block_map, first = [], [], 0
    for i, (ptr, numel, seg, dtype, off) in enumerate(zip(ptrs, numels, segs, dtypes, layout.offsets)):
        ok = buf_ok and ptr % 16 == 0 and off * bes % 16 == 0 and (num_chunks == 1 or seg * _SIZES[dtype] % 16 == 0)
        table += (ptr, numel, seg, off, first, TAGS[dtype] | (ALIGNED if ok else 0))
        blocks = -(-seg // BLOCK)
        block_map += repeat(i, blocks)
        first += blocks
    n = len(ptrs)
    host = torch.tensor(table + block_map, dtype=torch.int64)  # (small torch ops cost more than lists here)
    dev = host.to(device)  # one upload for table and map (a no-op on CPU)
    kinds = set(dtypes)
    return Descriptors(dev[: n * NCOLS].view(n, NCOLS), dev[n * NCOLS :], first,
                       kinds.pop() if len(kinds) == 1 else None)
