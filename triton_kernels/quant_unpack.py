"""dequantize / dequantize_sum: block-quantized int8 on the wire -> many tensors, or -> one fp32 sum.

dequantize replaces, per bucket: an int8 -> fp32 cast, a repeat of the scales to every element, a
multiply, and the split + cast into the outputs (torch: four passes and an (r, c) fp32 temporary).
Here one launch reads every int8 value once and writes every output once in its own dtype (bf16
rounded to nearest even with integer ops, as in _copy.py). Program (k, j) owns block k of chunk j,
as in quant_pack.py: one scale, B contiguous int8 values, and a masked store into each output the
block overlaps (found by binary search in the tensor table). A first version ran over the outputs'
blocks (unpack.py's table) and found each element's chunk and block by integer division: on an H100
it reached 0.21 of copy bandwidth for 1 GB buckets (64-bit division per element); this one 0.97
(fp32 outputs, 10 tensors, 0.46 ms, 7.3x the torch fallback; bf16 outputs 0.67 of copy).

dequantize_sum is the local step of a quantized reduction: after an all-to-all, row j of the wire
holds rank j's chunk; the sum of the r dequantized rows, accumulated in fp32 row by row (never a sum
in int8), in one launch that reads each row once: 8 rows of a 1 GB fp32 bucket in 0.18 ms on an H100
(0.78 of copy bandwidth, 21x the torch fallback's row-by-row adds).
Both are bit-identical to _quant_fallback.py (fp fusion off: acc + q * scale is not an fma).
"""

import torch
import triton
import triton.language as tl

from ._copy import TL_DTYPES, cast_to, last_at_or_before, launch
from ._quant_layout import QuantLayout
from ._table import QCOLS, addresses, tensor_table

_QCOLS = tl.constexpr(QCOLS)


@triton.jit
def _store_as(addr, local, v, mask, DT: tl.constexpr):
    tl.store(addr.to(tl.pointer_type(DT)) + local, cast_to(v, DT), mask=mask)


@triton.jit
def dequantize_kernel(table, n_rows, rel, first_ptr, wire, n, chunk, nblocks, row_bytes, block_size,
                      DST: tl.constexpr, MIXED: tl.constexpr, LOG_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)  # block inside the chunk
    j = tl.program_id(1).to(tl.int64)  # chunk = row of the wire
    offs = tl.arange(0, BLOCK)
    lo = j * chunk + k * block_size  # flat index of the block's first element
    hi = tl.minimum(lo + tl.minimum(block_size, chunk - k * block_size), n)  # real elements: lo .. hi - 1
    gi = lo + offs
    real = gi < hi
    base = wire.to(tl.int64) + j * row_bytes
    q = tl.load((base + 4 * nblocks + k * block_size).to(tl.pointer_type(tl.int8)) + offs, mask=real, other=0)
    v = q.to(tl.float32) * tl.load(base.to(tl.pointer_type(tl.float32)) + k)
    first = last_at_or_before(table, n_rows, lo, LOG_ROWS)
    last = last_at_or_before(table, n_rows, tl.maximum(hi - 1, lo), LOG_ROWS)
    for t in range(first, last + 1):  # every output that overlaps the block
        row = table + t * _QCOLS
        addr = first_ptr + tl.load(rel + t)  # [Note: descriptor tables] in _table.py
        off, numel = tl.load(row), tl.load(row + 1)
        m = real & (gi >= off) & (gi < off + numel)
        if MIXED:
            tag = tl.load(row + 2)
            if tag == 0:
                _store_as(addr, gi - off, v, m, tl.float32)
            elif tag == 1:
                _store_as(addr, gi - off, v, m, tl.bfloat16)
            else:
                _store_as(addr, gi - off, v, m, tl.float16)
        else:
            _store_as(addr, gi - off, v, m, DST)


@triton.jit
def dequantize_sum_kernel(wire, out, num_chunks, chunk, nblocks, row_bytes, block_size, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)  # block inside the chunk
    offs = tl.arange(0, BLOCK)
    mask = offs < tl.minimum(block_size, chunk - k * block_size)
    col = k * block_size + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(num_chunks):  # in order: the fallback sums the same way
        base = wire.to(tl.int64) + (k * 0 + j) * row_bytes  # in int64: r * row_bytes may pass 2**31
        q = tl.load((base + 4 * nblocks + col).to(tl.pointer_type(tl.int8)), mask=mask, other=0)
        s = tl.load(base.to(tl.pointer_type(tl.float32)) + k)
        acc = acc + q.to(tl.float32) * s
    tl.store(out + col, acc, mask=mask)


def launch_dequantize(wire: torch.Tensor, outs, layout: QuantLayout) -> None:
    """Dequantize `wire` ((r, row_bytes) uint8) into `outs` (their elements in order are the flat)."""
    if layout.blocks == 0:
        return
    d = tensor_table(outs, wire.device)
    live = [o for o in outs if o.numel()]  # the table's rows
    a = addresses(live, [o.data_ptr() for o in live], wire.device)
    block = max(16, triton.next_power_of_2(layout.block_size))
    launch(dequantize_kernel, (layout.blocks, layout.num_chunks), d.table, d.n_blocks, a.rel, a.base, wire,
           layout.numel, layout.chunk, layout.blocks, layout.row_bytes, layout.block_size,
           DST=TL_DTYPES[d.dtype] if d.dtype is not None else tl.float32, MIXED=d.dtype is None,
           LOG_ROWS=max(1, (d.n_blocks - 1).bit_length()), BLOCK=block, num_warps=4 if block <= 4096 else 8)


def launch_dequantize_sum(wire: torch.Tensor, layout: QuantLayout, out: torch.Tensor) -> None:
    """out (fp32, c elements) = sum over the r rows of `wire` of each row's dequantized chunk."""
    if layout.blocks == 0:
        return
    block = max(16, triton.next_power_of_2(layout.block_size))
    launch(dequantize_sum_kernel, (layout.blocks,), wire, out, layout.num_chunks, layout.chunk, layout.blocks,
           layout.row_bytes, layout.block_size, BLOCK=block, num_warps=4 if block <= 4096 else 8,
           enable_fp_fusion=False)
