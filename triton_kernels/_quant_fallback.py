"""The torch fallback of the quantized ops, bit-identical to quant_pack.py / quant_unpack.py.

Same arithmetic in the same order as the kernels (see [Note: quantized wire format] in
_quant_layout.py): fp32 inputs (+ residual), absmax / 127, x / scale clamped and rounded half to
even (torch.round), float(q) * scale, and for the sum an fp32 accumulation over chunks 0, 1, ...
starting from 0. Inputs arrive checked; callers run these under torch.no_grad().
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._quant_layout import QuantLayout, wire_views


def _blocks(flat: torch.Tensor, L: QuantLayout) -> torch.Tensor:
    """(r * c,) -> (r, nb, B), each chunk's short last block zero-padded (zeros change no absmax)."""
    padded = flat.new_zeros(L.num_chunks, L.blocks * L.block_size)
    padded[:, : L.chunk] = flat.view(L.num_chunks, L.chunk)
    return padded.view(L.num_chunks, L.blocks, L.block_size)


def _per_element(scales: torch.Tensor, L: QuantLayout) -> torch.Tensor:
    """(r, nb) scales -> (r, c): each element's own block scale."""
    return scales.repeat_interleave(L.block_size, dim=1)[:, : L.chunk]


def quantize(tensors: Sequence[torch.Tensor], L: QuantLayout, residual: torch.Tensor | None,
             wire: torch.Tensor) -> None:
    n = L.numel
    x = torch.zeros(L.num_chunks * L.chunk, dtype=torch.float32, device=wire.device)
    torch.cat([t.reshape(-1) for t in tensors], out=x[:n])  # casts exactly: every input dtype fits in fp32
    if residual is not None:
        x[:n] += residual.reshape(-1)
    xb = _blocks(x, L)
    bad = ~torch.isfinite(xb).all(dim=-1)
    # A tensor divisor, not the number 127: CUDA torch turns `t / number` into t * (1 / number), which is
    # not the IEEE quotient the kernel computes (measured on an H100: scales one ulp apart).
    scale = torch.where(bad, float("nan"), xb.abs().amax(dim=-1) / xb.new_tensor(127.0))
    ok = scale > 0
    y = (xb / torch.where(ok, scale, 1.0).unsqueeze(-1)).clamp_(-127.0, 127.0).round_()
    qf = torch.where(ok.unsqueeze(-1), y, 0.0)
    q, s = wire_views(wire, L)
    s.copy_(scale)
    q.copy_(qf.view(L.num_chunks, -1)[:, : L.chunk])  # exact: integers in [-127, 127]
    if residual is not None:
        new = (xb - qf * scale.unsqueeze(-1)).view(L.num_chunks, -1)[:, : L.chunk]
        residual.view(-1).copy_(new.reshape(-1)[:n])  # casts to the residual's dtype, rounding to nearest even


def _dequantized(wire: torch.Tensor, L: QuantLayout) -> torch.Tensor:
    q, s = wire_views(wire, L)
    return q.float() * _per_element(s, L)  # (r, c) fp32


def dequantize(wire: torch.Tensor, outs: Sequence[torch.Tensor], L: QuantLayout) -> None:
    flat = _dequantized(wire, L).view(-1)[: L.numel]
    dsts = [o.view(-1) for o in outs]
    torch._foreach_copy_(dsts, list(torch.split_with_sizes(flat, [o.numel() for o in outs])))


def dequantize_sum(wire: torch.Tensor, L: QuantLayout, out: torch.Tensor) -> None:
    deq = _dequantized(wire, L)
    out.zero_()
    for row in deq:  # chunk by chunk, in order: the kernel's summation order, so the bits agree
        out.add_(row)
