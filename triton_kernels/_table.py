"""The descriptor tables that let one Triton launch cover any number of tensors.

[Note: descriptor tables]
A launch reads a *geometry* table and the tensors' *addresses*. The geometry is computed from numels,
chunk sizes, dtypes and 16-byte alignment classes only, never from a data pointer, and is cached by
exactly those: one build and one upload per distinct bucket shape (the engine's buckets are fixed after
setup; equal layers share one), whatever the allocator does to the buffers. The address of tensor i is
first_ptr + rel[i], first_ptr = tensors[0].data_ptr(), a kernel scalar. When the tensors are views of one
storage (a unit's full parameters) or a single tensor, rel is fixed and cached like the geometry: nothing
crosses to the device per call. Otherwise (autograd's gradients, new every step) rel is copied per call
from pinned memory, non_blocking: no host sync. `table_stats()` counts lookups, builds and those copies.

[Note: copy-kernel tables]
Copy kernels (pack.py / unpack.py): per tensor i a row of NCOLS int64 [numel, seg, offset, first_block,
flags] (seg/offset: see _checks.Layout; flags: dtype tag in bits 0-1, ALIGNED in bit 2), followed by the
block map: one entry per BLOCK-element block of every tensor's chunk, naming the tensor. The grid is
(number of blocks, num_chunks): program (g, j) copies block g - first_block[i] of chunk j of tensor
i = map[g], so the work is balanced however uneven the sizes. ALIGNED means tensor i's blocks start on
16-byte boundaries on both sides (data_ptr, offset, and for num_chunks > 1 the row and chunk strides), so
the kernel may use unmasked 128-bit accesses for its full blocks. Quantize kernels: `tensor_table`.
Nothing here imports triton.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import repeat
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ._checks import Layout

NCOLS = 5
QCOLS = 3  # tensor_table's row: [flat offset, numel, dtype tag]
ALIGNED = 4
TAGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SIZES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
BLOCK = 4096  # elements per program: 16 KB of fp32, 32 per thread with 4 warps
MAX_ENTRIES = 4096  # cached tables (geometries and fixed offsets); the engine needs a few per distinct unit
MAX_ELEMENTS = 1 << 22  # int64 entries over all of them (32 MiB): a bucket's map is 1/BLOCK of its elements
_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_ELEMENTS = [0]
_LOCK = threading.Lock()


class Descriptors(NamedTuple):
    table: torch.Tensor  # (n, NCOLS) int64 on the buffer's device (QCOLS for tensor_table)
    block_map: torch.Tensor  # (n_blocks,) int64, tensor index of every block (empty for tensor_table)
    n_blocks: int  # blocks of the grid (tensor_table: its rows)
    dtype: torch.dtype | None  # the tensors' one dtype, or None when they mix dtypes


class Addresses(NamedTuple):
    rel: torch.Tensor  # (n,) int64 on the device: byte offset of tensor i from tensor 0
    base: int  # tensors[0].data_ptr(), a kernel scalar (the kernels' first_ptr)


class TableStats(NamedTuple):
    lookups: int  # cache lookups: one per launch, two when its addresses are fixed offsets
    builds: int  # tables built on the host and uploaded (geometry or fixed offsets): each one is cached
    pointer_copies: int  # per-call address arrays (tensors not views of one storage): pinned, non_blocking
    cached: int  # tables held now


_STATS = {"lookups": 0, "builds": 0, "pointer_copies": 0}


def table_stats() -> TableStats:
    """Counters since the process started (or `reset_table_stats`): after warm-up `builds` stays put."""
    with _LOCK:
        return TableStats(_STATS["lookups"], _STATS["builds"], _STATS["pointer_copies"], len(_CACHE))


def reset_table_stats(clear: bool = False) -> None:
    """Zero the counters; `clear` also drops every cached table (the next launches build them again)."""
    with _LOCK:
        _STATS.update(lookups=0, builds=0, pointer_copies=0)
        if clear:
            _CACHE.clear()
            _ELEMENTS[0] = 0


def descriptors(tensors: Sequence[torch.Tensor], layout: Layout, buf: torch.Tensor,
                ptrs: Sequence[int]) -> Descriptors:
    """The copy kernels' geometry for `tensors` <-> `buf` (`ptrs`: their data pointers, for alignment only)."""
    bes = buf.element_size()
    buf_ok = buf.data_ptr() % 16 == 0 and (layout.num_chunks == 1 or layout.total * bes % 16 == 0)
    odd = tuple([i for i, p in enumerate(ptrs) if p & 15])  # alignment classes, not pointers
    key = ("copy", buf.device, buf_ok, bes, layout.num_chunks, layout.numels, layout.segs,
           tuple([t.dtype for t in tensors]), odd)
    return _cached(key, lambda: _build(key, layout))


def tensor_table(tensors: Sequence[torch.Tensor], device: torch.device) -> Descriptors:
    """The quantize kernels' table: per NON-EMPTY tensor i a row [flat offset, numel, dtype tag], rows in
    order (so flat offsets increase strictly); no block map (block_map is empty, n_blocks = rows). The
    addresses come from `addresses` over the same non-empty tensors."""
    key = ("flat", device, tuple([t.numel() for t in tensors]), tuple([t.dtype for t in tensors]))
    return _cached(key, lambda: _build_flat(key))


def addresses(tensors: Sequence[torch.Tensor], ptrs: Sequence[int], device: torch.device) -> Addresses:
    """base + rel[i] = tensors[i].data_ptr(), base = first_ptr ([Note: descriptor tables]); `tensors` is not empty."""
    base = ptrs[0]
    rel = tuple([p - base for p in ptrs])
    owner = tensors[0]._base
    if len(ptrs) == 1 or (owner is not None and all([t._base is owner for t in tensors])):
        return Addresses(_cached(("rel", device, rel), lambda: _upload(list(rel), device)), base)
    with _LOCK:
        _STATS["pointer_copies"] += 1
    if device.type == "cuda":  # the pinned block is not reused before the copy ran (torch records an event)
        host = torch.tensor(rel, dtype=torch.int64, pin_memory=True)
        return Addresses(host.to(device, non_blocking=True), base)
    return Addresses(torch.tensor(rel, dtype=torch.int64, device=device), base)


def _cached(key: tuple, build: Callable[[], Any]) -> Any:
    """The table for `key`, built (and counted) on a miss; an LRU bounded by entries and elements."""
    with _LOCK:  # autograd may run hooks (and so these copies) on its own threads
        _STATS["lookups"] += 1
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = build()
            _STATS["builds"] += 1
            _ELEMENTS[0] += _numel(hit)
            while len(_CACHE) > 1 and (len(_CACHE) > MAX_ENTRIES or _ELEMENTS[0] > MAX_ELEMENTS):
                _ELEMENTS[0] -= _numel(_CACHE.popitem(last=False)[1])
        else:
            _CACHE.move_to_end(key)
    t = hit.table if isinstance(hit, Descriptors) else hit
    if t.is_cuda:  # the cached table may be read on another stream than it was made on
        t.record_stream(torch.cuda.current_stream(t.device))  # (a table and its map share the storage)
    return hit


def _numel(entry: Any) -> int:
    return entry.table.numel() + entry.block_map.numel() if isinstance(entry, Descriptors) else entry.numel()


def _upload(values: list, device: torch.device) -> torch.Tensor:
    """One blocking upload from pageable memory (a sync): only ever for a table that is then cached."""
    return torch.tensor(values, dtype=torch.int64).to(device)


def _build_flat(key: tuple) -> Descriptors:
    _, device, numels, dtypes = key
    rows, off = [], 0
    for numel, dtype in zip(numels, dtypes):
        if numel:
            rows += (off, numel, TAGS[dtype])
            off += numel
    table = _upload(rows, device).view(-1, QCOLS)
    kinds = {d for n, d in zip(numels, dtypes) if n}
    return Descriptors(table, table.new_empty(0), table.shape[0], kinds.pop() if len(kinds) == 1 else None)


def _build(key: tuple, layout: Layout) -> Descriptors:
    _, device, buf_ok, bes, num_chunks, numels, segs, dtypes, odd = key
    odd = set(odd)
    table, block_map, first = [], [], 0
    for i, (numel, seg, dtype, off) in enumerate(zip(numels, segs, dtypes, layout.offsets)):
        ok = buf_ok and i not in odd and off * bes % 16 == 0 and (num_chunks == 1 or seg * _SIZES[dtype] % 16 == 0)
        table += (numel, seg, off, first, TAGS[dtype] | (ALIGNED if ok else 0))
        blocks = -(-seg // BLOCK)
        block_map += repeat(i, blocks)
        first += blocks
    n = len(numels)
    dev = _upload(table + block_map, device)  # one upload for table and map (a no-op on CPU)
    kinds = set(dtypes)
    return Descriptors(dev[: n * NCOLS].view(n, NCOLS), dev[n * NCOLS :], first,
                       kinds.pop() if len(kinds) == 1 else None)
