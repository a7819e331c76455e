"""The torch fallback of the quantized ops, bit-identical to quant_pack.py / quant_unpack.py.

Same arithmetic in the same order as the kernels (see [Note: quantized block rule] in
_quant_layout.py): fp32 inputs (+ residual), absmax / 127, x / scale clamped and rounded half to
even (torch.round), float(q) * scale, and for the sum an fp32 accumulation over chunks 0, 1, ...
starting from 0. Inputs arrive checked; callers run these under torch.no_grad().

[Note: fallback passes]
The blocks are strided views of the (r, c) chunk rows, never a padded copy: a chunk's full blocks
are one (r, c // B, B) view and its short last block another (r, 1, c % B); every op below runs on
those two views. Per element, quantize reads the input once for the block absmax (an inf-norm, no
|x| temporary), once for x / scale (into the one fp32 temporary, clamped and rounded in place) and
writes int8 once; dequantize is one int8 x fp32 multiply written straight into its output when
that output is one fp32 tensor of the chunks' size. Only blocks that hold a NaN or an inf take an
extra pass (their values are zeroed before the int8 cast).
"""

from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch

from ._quant_layout import QuantLayout, wire_views


def _parts(L: QuantLayout) -> Iterator[Tuple[int, int, int]]:
    """(start, blocks, block length) of each run of equal-length blocks in a chunk: the full blocks, then the
    short last one (if any)."""
    full = L.chunk // L.block_size
    if full:
        yield 0, full, L.block_size
    tail = L.chunk - full * L.block_size
    if tail:
        yield full * L.block_size, 1, tail


def _blocks(rows: torch.Tensor, start: int, nb: int, length: int) -> torch.Tensor:
    """(r, nb, length) view of ``nb`` blocks of ``length`` elements from column ``start`` of the (r, c) rows."""
    return rows[:, start:start + nb * length].unflatten(1, (nb, length))


def _input(tensors: Sequence[torch.Tensor], L: QuantLayout, residual: torch.Tensor | None) -> torch.Tensor:
    """The (r, c) fp32 chunk rows: the tensors in order (+ residual), zero-padded; a view of the input itself
    (read only, not copied) when it already is one contiguous fp32 tensor of r * c elements."""
    n = L.numel
    if residual is None and len(tensors) == 1 and tensors[0].dtype == torch.float32 \
            and tensors[0].is_contiguous() and n == L.num_chunks * L.chunk:
        return tensors[0].view(L.num_chunks, L.chunk)
    x = torch.empty(L.num_chunks * L.chunk, dtype=torch.float32, device=tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=x[:n])  # casts exactly: every input dtype fits in fp32
    x[n:].zero_()
    if residual is not None:
        x[:n] += residual.reshape(-1)
    return x.view(L.num_chunks, L.chunk)


def quantize(tensors: Sequence[torch.Tensor], L: QuantLayout, residual: torch.Tensor | None,
             wire: torch.Tensor) -> None:
    x = _input(tensors, L, residual)
    q, s = wire_views(wire, L)
    b0 = 0
    for start, nb, length in _parts(L):
        xb = _blocks(x, start, nb, length)
        # max |x|, NaN-propagating: a NaN or an inf makes the scale non-finite, and such a block's scale is NaN.
        # A tensor divisor, not the number 127: CUDA torch turns `t / number` into t * (1 / number), which is
        # not the IEEE quotient the kernel computes (measured on an H100: scales one ulp apart).
        scale = torch.linalg.vector_norm(xb, float("inf"), dim=-1) / xb.new_tensor(127.0)
        bad = ~torch.isfinite(scale)
        scale.masked_fill_(bad, float("nan"))
        # a zero scale (a zero block, or an absmax / 127 that underflows) divides by 1: |x| < 1 there, q = 0
        y = torch.div(xb, torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-127.0, 127.0).round_()
        y.masked_fill_(bad.unsqueeze(-1), 0.0)  # NaN / inf blocks send q = 0 under their NaN scale (no host read)
        s[:, b0:b0 + nb].copy_(scale)
        q[:, start:start + nb * length].copy_(y.flatten(1))  # exact: integers in [-127, 127]
        if residual is not None:  # x - float(q) * scale, as the kernel computes it (a NaN block stays NaN)
            xb.sub_(_blocks(q, start, nb, length).float() * scale.unsqueeze(-1))
        b0 += nb
    if residual is not None:
        residual.view(-1).copy_(x.view(-1)[: L.numel])  # casts to the residual's dtype, rounding to nearest even


def _dequantized(wire: torch.Tensor, L: QuantLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """float(q) * scale of every element: (r, c) fp32, into ``out`` (an (r, c) fp32 view) if given."""
    q, s = wire_views(wire, L)
    out = torch.empty(L.num_chunks, L.chunk, dtype=torch.float32, device=wire.device) if out is None else out
    b0 = 0
    for start, nb, length in _parts(L):
        torch.mul(_blocks(q, start, nb, length), s[:, b0:b0 + nb].unsqueeze(-1), out=_blocks(out, start, nb, length))
        b0 += nb
    return out


def dequantize(wire: torch.Tensor, outs: Sequence[torch.Tensor], L: QuantLayout) -> None:
    whole = outs[0] if len(outs) == 1 else None
    if whole is not None and whole.dtype == torch.float32 and whole.is_contiguous() \
            and whole.numel() == L.num_chunks * L.chunk:
        _dequantized(wire, L, whole.view(L.num_chunks, L.chunk))  # no padding: straight into the output
        return
    flat = _dequantized(wire, L).view(-1)[: L.numel]
    dsts = [o.view(-1) for o in outs]
    torch._foreach_copy_(dsts, list(torch.split_with_sizes(flat, [o.numel() for o in outs])))


def dequantize_sum(wire: torch.Tensor, L: QuantLayout, out: torch.Tensor) -> None:
    deq = _dequantized(wire, L)
    out.zero_()
    for row in deq:  # chunk by chunk, in order: the kernel's summation order, so the bits agree
        out.add_(row)
