"""unpack: one (num_chunks, total) buffer -> many tensors in ONE launch; scatter and chunk_split.

Replaces `torch.split_with_sizes_copy(flat, sizes, out=views)` / `torch._foreach_copy_` (copy a
gathered bucket back into the parameters, or a reduced bucket into the gradients) and, for
chunk_split, the per-chunk copies that rebuild full parameters from an all-gather's rank-major
output (chunk j of every tensor in row j, padding dropped). Why: split_with_sizes_copy cannot cast,
a cast after it is a second pass, and in plain torch padded tensors need a scratch copy or one
copy per chunk. Here one launch reads every byte once, casting to each output's own dtype.
scatter is chunk_split with one chunk. Measured on one H100: benchmarks/kernels_h100.md.

Mixed output dtypes: as in pack.py, one compiled dtype when the outputs agree, else a per-tensor
branch on the dtype tag of its table row.
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
def unpack_kernel(table, block_map, rel, first_ptr, buf, total, DST: tl.constexpr, MIXED: tl.constexpr,
                  BLOCK: tl.constexpr):
    g = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)  # chunk = row of the buffer
    i = tl.load(block_map + g)  # the tensor this block belongs to
    row = table + i * _NCOLS
    addr = first_ptr + tl.load(rel + i)  # its data pointer ([Note: descriptor tables] in _table.py)
    numel, seg, off = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    local = (g - tl.load(row + 3)) * BLOCK  # this block's start inside the tensor's chunk
    flags = tl.load(row + 4)
    src_start = j * total + off + local
    dst_start = j * seg + local
    n = tl.minimum(numel - dst_start, seg - local)  # <= 0 for blocks of pure padding
    fast = ((flags & _ALIGNED) != 0) & (n >= BLOCK)
    SRC = buf.dtype.element_ty
    src_addr = buf.to(tl.int64)
    if MIXED:
        tag = flags & 3
        if tag == 0:
            copy_block(src_addr, src_start, n, addr, dst_start, n, fast, SRC, tl.float32, BLOCK)
        elif tag == 1:
            copy_block(src_addr, src_start, n, addr, dst_start, n, fast, SRC, tl.bfloat16, BLOCK)
        else:
            copy_block(src_addr, src_start, n, addr, dst_start, n, fast, SRC, tl.float16, BLOCK)
    else:
        copy_block(src_addr, src_start, n, addr, dst_start, n, fast, SRC, DST, BLOCK)


def launch_unpack(buf: torch.Tensor, outs, layout: Layout) -> None:
    """Copy `buf` (contiguous, num_chunks * total elements) into `outs`, inverse of launch_pack."""
    launch_table_kernel(unpack_kernel, outs, layout, buf, "DST")
