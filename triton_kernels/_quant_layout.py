"""The wire format of block-quantized int8 buffers, and the argument checks of the quantized ops.

[Note: quantized wire format]
A flat of n elements (the tensors of a bucket concatenated in order) is cut into r = num_chunks equal chunks of
c = ceil(n / r) elements rounded up to a multiple of 4; the flat is zero-padded to r * c (at most 4r - 1 padding
elements, all at the end). Each chunk is cut into nb = ceil(c / B) blocks of B = block_size elements from the
chunk's start, so a block never straddles a chunk; a chunk's last block is short (c - (nb - 1) * B elements), not
padded. Chunk j travels as one row of row_bytes = 4 * nb + c bytes in a uint8 (r, row_bytes) "wire" buffer:

    row j = [ nb fp32 scales (4 * nb bytes, native byte order) | c int8 values ]

so the scales travel WITH their values, in the same collective: an all-to-all of the buffer sends chunk j, scales
included, to rank j; an all-gather of one row per rank rebuilds a buffer laid out exactly as quantize(...,
num_chunks=r) lays it out. One collective per hop instead of two (the scales are 4 / B of the bytes: their own
collective would be latency only). row_bytes is a multiple of 4, so every row's scales are 4-byte aligned, and a
row is self-describing given B: c and nb follow from row_bytes (chunk_from_row_bytes).

[Note: quantized block rule]
Per block (x in fp32): absmax = max |x|; scale = absmax / 127 (fp32, rounded to nearest);
q = round-half-even(clamp(x / scale, -127, 127)) as int8; dequantized value = float(q) * scale.
Zero blocks (and blocks whose absmax / 127 underflows to 0, absmax < 127 * 2**-149) get scale 0 and
q = 0. A block holding any NaN or +-inf gets scale NaN and q = 0, so EVERY dequantized value of that
block is NaN: a non-finite value is never hidden by the scale (nor turned into a finite one), and
the reduction that sums it stays NaN. For scales in the normal fp32 range, |x - dequant| <=
absmax / 254 up to fp32 rounding of the scale and of the product (a few ulps of absmax).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

MAX_BLOCK_SIZE = 1 << 16  # elements per scale: one Triton program holds a block in registers


class QuantLayout(NamedTuple):
    numel: int  # n: elements of the flat (before padding)
    num_chunks: int  # r
    block_size: int  # B: elements per scale
    chunk: int  # c: elements per chunk (ceil(n / r) rounded up to a multiple of 4)
    blocks: int  # nb: blocks (scales) per chunk
    row_bytes: int  # 4 * nb + c: bytes of one chunk on the wire

    @property
    def q_offset(self) -> int:
        return 4 * self.blocks  # where the int8 values start inside a row


def quant_layout(numel: int, block_size: int, num_chunks: int = 1) -> QuantLayout:
    """The wire layout of `numel` elements quantized in blocks of `block_size`, in `num_chunks` chunks."""
    block_size = check_block_size(block_size)
    c = -(-numel // (4 * num_chunks)) * 4
    nb = -(-c // block_size)
    return QuantLayout(numel, num_chunks, block_size, c, nb, 4 * nb + c)


def chunk_from_row_bytes(row_bytes: int, block_size: int) -> int:
    """c such that a chunk of c elements takes row_bytes on the wire (c + 4 * ceil(c / B) is increasing in c)."""
    block_size = check_block_size(block_size)
    nb = -(-row_bytes // (block_size + 4))
    c = row_bytes - 4 * nb
    if c < 0 or c % 4 or -(-c // block_size) != nb:
        raise ValueError(f"rows of {row_bytes} bytes are not a quantized chunk for block_size={block_size} "
                         "(see quant_layout)")
    return c


def check_block_size(block_size: object) -> int:
    try:
        b = operator.index(block_size)
    except TypeError:
        b = None
    if b is None or isinstance(block_size, bool) or not 1 <= b <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size!r} must be an int in [1, {MAX_BLOCK_SIZE}]")
    return b


def check_wire(name: str, wire: torch.Tensor, layout: QuantLayout, device: torch.device | None) -> torch.Tensor:
    """wire is a contiguous, 4-byte aligned uint8 tensor of r * row_bytes bytes; returns its (r, row_bytes) view."""
    if not isinstance(wire, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(wire).__name__}")
    if wire.dtype != torch.uint8:
        raise ValueError(f"{name} has dtype {wire.dtype}; the quantized wire format is torch.uint8")
    if not wire.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(wire.shape)}, strides {wire.stride()}) is not contiguous")
    if device is not None and wire.device != device:
        raise ValueError(f"{name} is on {wire.device} but the tensors are on {device}: mixed devices")
    r, rb = layout.num_chunks, layout.row_bytes
    if wire.numel() != r * rb:
        raise ValueError(f"size mismatch: {name} has {wire.numel()} bytes but the layout needs {r} rows of {rb} "
                         f"bytes ({layout.numel} elements, block_size={layout.block_size}, num_chunks={r})")
    if wire.data_ptr() % 4:
        raise ValueError(f"{name} does not start on a 4-byte boundary (its fp32 scales must be aligned)")
    return wire.view(r, rb)


def wire_views(wire: torch.Tensor, layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): int8 (r, c) and fp32 (r, nb) views into a (r, row_bytes) wire buffer (no copy)."""
    w = wire.view(layout.num_chunks, layout.row_bytes)
    scales = w.view(torch.float32)[:, : layout.blocks] if layout.row_bytes else w.new_empty(w.shape[0], 0).float()
    return w[:, layout.q_offset :].view(torch.int8), scales
