"""dequantize / dequantize_sum: block-quantized int8 on the wire -> many tensors, or -> one fp32 sum.

dequantize replaces, per bucket: an int8 -> fp32 cast, a repeat of the scales to every element, a
multiply, and the split + cast into the outputs (torch: four passes and an (r, c) fp32 temporary).
Here one launch reads every int8 value once and writes every output once in its own dtype (bf16
rounded to nearest even with integer ops, as in _copy.py). It runs over the outputs' blocks like
unpack.py (descriptor table, any number and mix of outputs); element i of the flat reads chunk
i // c, column i % c and the scale of block (i % c) // B (see [Note: quantized wire format]).

dequantize_sum is the local step of a quantized reduction: after an all-to-all, row j of the wire
holds rank j's chunk; the sum of the r dequantized rows, accumulated in fp32 row by row (never a sum
in int8), in one launch that reads each row once. Measured numbers: benchmarks/kernels.py (GPU).
Both are bit-identical to _quant_fallback.py (fp fusion off: acc + q * scale is not an fma).
"""

import torch
import triton
import triton.language as tl

from ._checks import make_layout
from ._copy import cast_to, launch, launch_table_kernel
from ._quant_layout import QuantLayout
from ._table import NCOLS

_NCOLS = tl.constexpr(NCOLS)


@triton.jit
def _store_as(addr, start, v, mask, DT: tl.constexpr, BLOCK: tl.constexpr):
    tl.store(addr.to(tl.pointer_type(DT)) + start + tl.arange(0, BLOCK), cast_to(v, DT), mask=mask)


@triton.jit
def dequantize_kernel(table, block_map, wire, total, chunk, nblocks, row_bytes, block_size,
                      DST: tl.constexpr, MIXED: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    row = table + tl.load(block_map + g) * _NCOLS
    addr, numel, off = tl.load(row), tl.load(row + 1), tl.load(row + 3)
    local = (g - tl.load(row + 4)) * BLOCK  # this block's start inside the output tensor
    offs = tl.arange(0, BLOCK)
    mask = local + offs < numel
    gi = off + local + offs  # flat index
    j = gi // chunk
    col = gi - j * chunk
    base = wire.to(tl.int64) + j * row_bytes
    q = tl.load((base + 4 * nblocks + col).to(tl.pointer_type(tl.int8)), mask=mask, other=0)
    s = tl.load(base.to(tl.pointer_type(tl.float32)) + col // block_size, mask=mask, other=0.0)
    v = q.to(tl.float32) * s
    if MIXED:
        tag = tl.load(row + 5) & 3
        if tag == 0:
            _store_as(addr, local, v, mask, tl.float32, BLOCK)
        elif tag == 1:
            _store_as(addr, local, v, mask, tl.bfloat16, BLOCK)
        else:
            _store_as(addr, local, v, mask, tl.float16, BLOCK)
    else:
        _store_as(addr, local, v, mask, DST, BLOCK)


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
    launch_table_kernel(dequantize_kernel, outs, make_layout(outs, 1), wire, "DST",
                        extra=(layout.chunk, layout.blocks, layout.row_bytes, layout.block_size))


def launch_dequantize_sum(wire: torch.Tensor, layout: QuantLayout, out: torch.Tensor) -> None:
    """out (fp32, c elements) = sum over the r rows of `wire` of each row's dequantized chunk."""
    if layout.blocks == 0:
        return
    block = max(16, triton.next_power_of_2(layout.block_size))
    launch(dequantize_sum_kernel, (layout.blocks,), wire, out, layout.num_chunks, layout.chunk, layout.blocks,
           layout.row_bytes, layout.block_size, BLOCK=block, num_warps=4 if block <= 4096 else 8,
           enable_fp_fusion=False)
