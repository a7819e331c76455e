"""What the kernel modules share: copy one block with a cast (Triton helpers), and the launcher.

The kernel modules (pack.py, unpack.py, ...) import this module and never each other.

Why the bf16 rounding is written out: torch (CPU and CUDA) and `cvt.rn.bf16.f32` on a GPU round
float32 -> bfloat16 to nearest even, but Triton 3.9's interpreter truncates in `.to(tl.bfloat16)`,
so the CPU tests could not pin the GPU's result. Integer rounding is exact on both: add
0x7FFF + (bit 16), keep the high half; overflow carries into the exponent and gives inf like the
hardware does. NaN becomes 0x7FFF, the canonical bf16 NaN (what PTX's cvt.rn.bf16.f32 gives); torch
on CPU writes 0xFFFF or 0x7FC0 depending on its code path, so NaN payloads are not part of the
contract, only NaN-ness. bfloat16 -> float32 is a 16-bit shift, also written out: the
interpreter's own conversion mangles subnormals. fp16 targets use `.to()` (round to nearest even
everywhere); bf16 <-> fp16 goes through float32, exactly like torch.
"""

import contextlib

import torch
import triton
import triton.language as tl

from ._backend import kernels_interpreted
from ._checks import Layout
from ._table import BLOCK, QCOLS, addresses, descriptors

_QCOLS = tl.constexpr(QCOLS)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _f32_to_bf16_rne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    hi = tl.where(x != x, 0x7FFF, rounded).to(tl.uint16)
    return hi.to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_to_f32(x):
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def cast_to(x, DST: tl.constexpr):
    if x.dtype == DST:
        y = x
    elif DST == tl.bfloat16:
        y = _f32_to_bf16_rne(x.to(tl.float32))
    elif x.dtype == tl.bfloat16:
        y = _bf16_to_f32(x).to(DST)
    else:
        y = x.to(DST)
    return y


@triton.jit
def copy_block(src_addr, src_start, n_src, dst_addr, dst_start, n_dst, fast,
               SRC: tl.constexpr, DST: tl.constexpr, BLOCK: tl.constexpr):
    """dst[dst_start + k] = cast(src[src_start + k]) for k < BLOCK; addresses are int64 data pointers.

    Masked form: source elements at k >= n_src read as 0 (chunk padding), destination elements at
    k >= n_dst are left alone. `fast` (whole block in bounds, both sides 16-byte aligned, checked by
    the caller) drops the masks and tells the compiler the alignment, so it emits 128-bit accesses.
    """
    offs = tl.arange(0, BLOCK)
    if fast:
        src = tl.multiple_of(src_addr.to(tl.pointer_type(SRC)) + src_start, 16)
        dst = tl.multiple_of(dst_addr.to(tl.pointer_type(DST)) + dst_start, 16)
        tl.store(dst + offs, cast_to(tl.load(src + offs), DST))
    else:
        src = src_addr.to(tl.pointer_type(SRC)) + src_start
        dst = dst_addr.to(tl.pointer_type(DST)) + dst_start
        x = tl.load(src + offs, mask=offs < n_src, other=0.0)
        tl.store(dst + offs, cast_to(x, DST), mask=offs < n_dst)


@triton.jit
def last_at_or_before(table, n_rows, target, LOG_ROWS: tl.constexpr):
    """The last row of a tensor_table (see _table.py) whose flat offset (column 0) is <= target."""
    a = tl.full([], 0, tl.int64)
    b = a + n_rows  # (n_rows may arrive as the constant 1: Triton specializes integer arguments equal to 1)
    for _ in tl.static_range(LOG_ROWS):
        mid = (a + b) // 2
        ok = tl.load(table + mid * _QCOLS) <= target
        a = tl.where(ok, mid, a)
        b = tl.where(ok, b, mid)
    return a


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) on the device of the tensors, built the way the backend choice assumed."""
    if (type(kernel).__name__ == "InterpretedFunction") != kernels_interpreted():
        raise RuntimeError("TRITON_INTERPRET changed after triton_kernels first used Triton: set it once, "
                           "before the first Triton call")
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    with torch.cuda.device(dev) if dev is not None and dev.type == "cuda" else contextlib.nullcontext():
        kernel[grid](*args, **kwargs)


def launch_table_kernel(kernel, tensors, layout: Layout, buf: torch.Tensor, dtype_arg: str) -> None:
    """One launch of `kernel` over a (blocks, num_chunks) grid for `tensors` <-> `buf`.

    Shared by pack and unpack; `dtype_arg` names the kernel's constexpr for the tensors' dtype
    ("SRC" when packing them, "DST" when unpacking into them).
    """
    assert buf.is_contiguous() and buf.numel() == layout.num_chunks * layout.total  # (tensors: checked by api.py)
    ptrs = [t.data_ptr() for t in tensors]
    d = descriptors(tensors, layout, buf, ptrs)
    if d.n_blocks == 0:
        return
    a = addresses(tensors, ptrs, buf.device)
    dtype = TL_DTYPES[d.dtype] if d.dtype is not None else tl.float32
    launch(kernel, (d.n_blocks, layout.num_chunks), d.table, d.block_map, a.rel, a.base, buf, layout.total,
           MIXED=d.dtype is None, BLOCK=BLOCK, num_warps=4, **{dtype_arg: dtype})
