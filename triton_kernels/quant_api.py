"""The quantized ops for the slow hop: block-quantized int8 with fp32 scales, one launch per bucket.

    q = lightning_mics_kernels.quantize(tensors, block_size, num_chunks=r, residual=res)  # -> Quantized(wire, q, scales)
    dist.all_to_all_single(recv, q.wire, group=replicas)                        # chunk j, scales included, to rank j
    part = lightning_mics_kernels.dequantize_sum(recv, r, block_size)                   # fp32 sum of the r chunks
    mine = lightning_mics_kernels.quantize([part], block_size)                          # one row
    dist.all_gather_into_tensor(gathered, mine.wire, group=replicas)            # (r, row_bytes)
    lightning_mics_kernels.dequantize(gathered, grads, block_size, num_chunks=r)        # into any float dtypes

Layout: [Note: quantized wire format] in _quant_layout.py; scale rule, non-finite rule and error
bound: [Note: quantized block rule] in _quant_layout.py. Both backends run the same checks and give
bit-identical results (NaN payloads of the dequantized values and the residual aside, as in api.py).
None of this is seen by autograd.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import _quant_fallback
from ._backend import check_backend, use_triton
from ._checks import check_buffer, check_num_chunks, check_tensors
from ._quant_layout import QuantLayout, check_wire, chunk_from_row_bytes, quant_layout, wire_views


class Quantized(NamedTuple):
    wire: torch.Tensor  # uint8 (r, row_bytes): what the collective sends, scales included
    q: torch.Tensor  # int8 (r, c) view into wire
    scales: torch.Tensor  # fp32 (r, nb) view into wire, one per block
    layout: QuantLayout


def quantize(tensors: Sequence[torch.Tensor], block_size: int, *, num_chunks: int = 1,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             backend: str = "auto") -> Quantized:
    """The tensors' elements in order (any mix of fp32 / bf16 / fp16), quantized in blocks of
    `block_size` into `num_chunks` chunks on one uint8 wire buffer (`out` if given: contiguous,
    r * row_bytes bytes, 4-byte aligned).

    residual (error feedback): one flat tensor of sum-of-numels elements, any supported float dtype.
    It is added to the input (in fp32) before quantizing and overwritten, in the same launch, with
    input + residual - dequantize(q), rounded to its dtype. A non-finite block leaves NaN there.
    """
    backend = check_backend(backend)
    device = check_tensors("tensors", tensors)
    layout = quant_layout(sum(t.numel() for t in tensors), block_size, check_num_chunks(num_chunks))
    if residual is not None:
        check_buffer("residual", residual, layout.numel, None, device)
    if out is None:
        out = torch.empty(layout.num_chunks, layout.row_bytes, dtype=torch.uint8,
                          device=device if device is not None else "cpu")
    wire = check_wire("out", out, layout, device)
    if layout.numel:
        with torch.no_grad():
            if use_triton(backend, device):
                from .quant_pack import launch_quantize

                launch_quantize(tensors, layout, residual, wire)
            else:
                _quant_fallback.quantize(tensors, layout, residual, wire)
    elif layout.row_bytes:  # unreachable today (n = 0 gives c = 0); kept for a layout with fixed chunks
        wire.zero_()
    q, scales = wire_views(wire, layout)
    return Quantized(wire, q, scales, layout)


def dequantize(wire: torch.Tensor, outs: Sequence[torch.Tensor], block_size: int, *, num_chunks: int = 1,
               backend: str = "auto") -> Sequence[torch.Tensor]:
    """Inverse of quantize: the wire's values, in order, into `outs` (any mix of float dtypes, rounded to
    nearest even), their elements summing to the n that was quantized; the padding is dropped."""
    backend = check_backend(backend)
    device = check_tensors("outs", outs)
    layout = quant_layout(sum(o.numel() for o in outs), block_size, check_num_chunks(num_chunks))
    wire = check_wire("wire", wire, layout, device)
    if layout.numel:
        with torch.no_grad():
            if use_triton(backend, device):
                from .quant_unpack import launch_dequantize

                launch_dequantize(wire, outs, layout)
            else:
                _quant_fallback.dequantize(wire, outs, layout)
    return outs


def dequantize_sum(wire: torch.Tensor, num_chunks: int, block_size: int, *, out: torch.Tensor | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """The fp32 sum of the `num_chunks` chunks (rows) of `wire`, each dequantized: what rank j holds after
    an all-to-all of quantize(..., num_chunks=r) buffers is r copies of chunk j; this reduces them.
    Summed in fp32 in row order, never in int8. Returns `out` (fp32, c elements) or a new (c,) tensor,
    c = the chunk length, read from the row size (see quant_layout)."""
    backend = check_backend(backend)
    r = check_num_chunks(num_chunks)
    if not isinstance(wire, torch.Tensor):
        raise TypeError(f"wire must be a torch.Tensor, got {type(wire).__name__}")
    if wire.numel() % r:
        raise ValueError(f"size mismatch: wire has {wire.numel()} bytes, not a multiple of num_chunks={r}")
    row_bytes = wire.numel() // r
    c = chunk_from_row_bytes(row_bytes, block_size)
    layout = QuantLayout(r * c, r, block_size, c, row_bytes - c >> 2, row_bytes)
    wire = check_wire("wire", wire, layout, None)
    if out is None:
        out = torch.empty(c, dtype=torch.float32, device=wire.device)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise ValueError(f"out must be a float32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    check_buffer("out", out, c, None, wire.device)
    if c:
        with torch.no_grad():
            if use_triton(backend, wire.device):
                from .quant_unpack import launch_dequantize_sum

                launch_dequantize_sum(wire, layout, out.view(-1))
            else:
                _quant_fallback.dequantize_sum(wire, layout, out.view(-1))
    return out
