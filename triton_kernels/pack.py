"""pack: many tensors -> one (num_chunks, total) buffer in ONE launch; flatten and chunk_cat.

Replaces `torch.cat([t.view(-1) ...], out=buf)` (flatten a gradient / parameter bucket) and
`torch._chunk_cat(ts, 0, num_chunks, out=buf)` (the reduce-scatter input: chunk j of every tensor,
zero-padded, in row j), both with a cast to the buffer's dtype. Why: the bucket copy sits on the
critical path of every unit's all-gather / reduce-scatter. A separate cast is a second pass over the
bytes, and (as we read torch's CUDA source) torch.cat batches a bounded number of inputs per launch
and copies input by input when it has to cast. Here one launch reads every byte once and writes it
once, casting on the fly, for any number and mix of tensors. flatten is chunk_cat with one chunk (seg =
numel, no padding). Measured on one H100: benchmarks/kernels_h100.md (benchmarks/README.md).

Mixed dtypes: all tensors of one dtype compile a kernel for that dtype; otherwise the kernel
branches per tensor on the dtype tag in its table row (uniform within a program, so no divergence).
"""

import torch
import triton
import triton.language as tl

from ._checks import Layout
from ._copy import copy_block, launch_table_kernel
from ._table import ALIGNED, NCOLS

_NCOLS = tl.constexpr(NCOLS)
_ALIGNED = tl.constexpr(ALIGNED)


@triton.jit
def pack_kernel(table, block_map, rel, first_ptr, buf, total, SRC: tl.constexpr, MIXED: tl.constexpr,
                BLOCK: tl.constexpr):
    g = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)  # chunk = row of the buffer
    i = tl.load(block_map + g)  # the tensor this block belongs to
    row = table + i * _NCOLS
    addr = first_ptr + tl.load(rel + i)  # its data pointer ([Note: descriptor tables] in _table.py)
    numel, seg, off = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    local = (g - tl.load(row + 3)) * BLOCK  # this block's start inside the tensor's chunk
    flags = tl.load(row + 4)
    src_start = j * seg + local
    dst_start = j * total + off + local
    n_src = numel - src_start  # <= 0 for blocks of pure padding
    n_dst = seg - local
    fast = ((flags & _ALIGNED) != 0) & (n_src >= BLOCK) & (n_dst >= BLOCK)
    DST = buf.dtype.element_ty
    dst_addr = buf.to(tl.int64)
    if MIXED:
        tag = flags & 3
        if tag == 0:
            copy_block(addr, src_start, n_src, dst_addr, dst_start, n_dst, fast, tl.float32, DST, BLOCK)
        elif tag == 1:
            copy_block(addr, src_start, n_src, dst_addr, dst_start, n_dst, fast, tl.bfloat16, DST, BLOCK)
        else:
            copy_block(addr, src_start, n_src, dst_addr, dst_start, n_dst, fast, tl.float16, DST, BLOCK)
    else:
        copy_block(addr, src_start, n_src, dst_addr, dst_start, n_dst, fast, SRC, DST, BLOCK)


def launch_pack(tensors, layout: Layout, buf: torch.Tensor) -> None:
    """Fill `buf` (contiguous, num_chunks * total elements) with the layout of `tensors`."""
    launch_table_kernel(pack_kernel, tensors, layout, buf, "SRC")
