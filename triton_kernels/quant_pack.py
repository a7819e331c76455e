"""quantize: a bucket of many tensors -> block-quantized int8 + fp32 scales on the wire, in ONE launch.

Replaces, per bucket: torch.cat to an fp32 flat (a cast pass), padding, a per-block absmax, a divide,
a round, an int8 cast, a scale copy, and with error feedback the residual add before and the
residual update after: six to ten passes over the bucket and as many launches. Here one launch reads
every input byte once (and the residual once) and writes the int8 values, the scales and the new
residual once. Program (k, j) owns block k of chunk j (see [Note: quantized wire format] in
_quant_layout.py); a block may span many small tensors: it finds the first and last by binary search
in the tensor table (flat offsets increase) and loads each tensor's part with a masked load, the
dtype branch uniform per tensor as in pack.py. Measured on an H100 (benchmarks/kernels.py, 10 fp32
tensors, 2048-element blocks, 8 chunks): 1 GB bucket in 0.81 ms (0.55 of copy bandwidth), 11.8x the
torch fallback; with error feedback 2.0 ms (0.58 of copy), 7.0x. Not yet at copy speed: the loads are
masked and of unknown alignment (no 128-bit accesses) and each program first binary-searches the table.

Bit-identical to _quant_fallback.quantize: fp32 throughout, IEEE division (div_rn: Triton's `/` is
div.full.f32 on NVIDIA, off by up to 2 ulp, which changed scales and rounding on an H100), round half
to even by the 1.5 * 2**23 trick (exact for |y| <= 127), fp fusion off (so x - q * scale is not
contracted into an fma on a GPU).
"""

import torch
import triton
import triton.language as tl

from ._copy import TL_DTYPES, cast_to, last_at_or_before, launch
from ._quant_layout import QuantLayout
from ._table import QCOLS, addresses, tensor_table

_QCOLS = tl.constexpr(QCOLS)
_RNE = tl.constexpr(12582912.0)  # 1.5 * 2**23: y + _RNE - _RNE rounds y to an integer, half to even


@triton.jit
def _load_f32(addr, local, mask, DT: tl.constexpr):
    return cast_to(tl.load(addr.to(tl.pointer_type(DT)) + local, mask=mask, other=0.0), tl.float32)


@triton.jit
def quantize_kernel(table, n_rows, rel, first_ptr, residual, wire, n, chunk, nblocks, row_bytes, block_size,
                    SRC: tl.constexpr, MIXED: tl.constexpr, HAS_RES: tl.constexpr, LOG_ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)  # block inside the chunk
    j = tl.program_id(1).to(tl.int64)  # chunk = row of the wire
    offs = tl.arange(0, BLOCK)
    lo = j * chunk + k * block_size  # flat index of the block's first element
    cnt = tl.minimum(block_size, chunk - k * block_size)  # the block's elements, flat padding included
    hi = tl.minimum(lo + cnt, n)  # real (unpadded) elements: lo .. hi - 1, maybe none
    gi = lo + offs
    real = gi < hi
    x = tl.zeros([BLOCK], dtype=tl.float32)
    first = last_at_or_before(table, n_rows, lo, LOG_ROWS)
    last = last_at_or_before(table, n_rows, tl.maximum(hi - 1, lo), LOG_ROWS)
    for t in range(first, last + 1):  # every tensor that overlaps the block
        row = table + t * _QCOLS
        addr = first_ptr + tl.load(rel + t)  # [Note: descriptor tables] in _table.py
        off, numel = tl.load(row), tl.load(row + 1)
        m = real & (gi >= off) & (gi < off + numel)
        local = gi - off
        if MIXED:
            tag = tl.load(row + 2)
            if tag == 0:
                v = _load_f32(addr, local, m, tl.float32)
            elif tag == 1:
                v = _load_f32(addr, local, m, tl.bfloat16)
            else:
                v = _load_f32(addr, local, m, tl.float16)
        else:
            v = _load_f32(addr, local, m, SRC)
        x = tl.where(m, v, x)
    if HAS_RES:
        x = x + cast_to(tl.load(residual + gi, mask=real, other=0.0), tl.float32)
    ax = tl.abs(x)
    bad = tl.max(((x != x) | (ax == float("inf"))).to(tl.int32), axis=0) > 0
    scale = tl.where(bad, float("nan"), tl.math.div_rn(tl.max(ax, axis=0), 127.0))
    ok = scale > 0.0  # False for zero blocks and (NaN) non-finite ones: q = 0 there
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.where(ok, scale, 1.0)), -127.0), 127.0)
    qf = tl.where(ok, (y + _RNE) - _RNE, 0.0)
    base = wire.to(tl.int64) + j * row_bytes
    tl.store(base.to(tl.pointer_type(tl.float32)) + k, scale)
    tl.store((base + 4 * nblocks + k * block_size).to(tl.pointer_type(tl.int8)) + offs, qf.to(tl.int8),
             mask=offs < cnt)
    if HAS_RES:
        new = x - qf * scale
        tl.store(residual + gi, cast_to(new, residual.dtype.element_ty), mask=real)


def launch_quantize(tensors, layout: QuantLayout, residual: torch.Tensor | None, wire: torch.Tensor) -> None:
    """Fill `wire` ((r, row_bytes) uint8, contiguous) from `tensors` (+ residual, updated in place)."""
    if layout.blocks == 0:
        return
    d = tensor_table(tensors, wire.device)
    live = [t for t in tensors if t.numel()]  # the table's rows
    a = addresses(live, [t.data_ptr() for t in live], wire.device)
    src = TL_DTYPES[d.dtype] if d.dtype is not None else tl.float32
    block = max(16, triton.next_power_of_2(layout.block_size))
    launch(quantize_kernel, (layout.blocks, layout.num_chunks), d.table, d.n_blocks, a.rel, a.base,
           residual if residual is not None else wire, wire, layout.numel, layout.chunk, layout.blocks,
           layout.row_bytes, layout.block_size, SRC=src, MIXED=d.dtype is None, HAS_RES=residual is not None,
           LOG_ROWS=max(1, (d.n_blocks - 1).bit_length()), BLOCK=block, num_warps=4 if block <= 4096 else 8,
           enable_fp_fusion=False)
