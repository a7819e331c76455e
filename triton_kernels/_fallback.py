"""The torch fallback: the fastest plain torch op for each layout, same semantics as the kernels.

Inputs arrive checked (see _checks.py); buffers arrive as 1-D (flatten/scatter) or 2-D (chunk ops)
views. Callers run these under torch.no_grad(), like the kernels, which autograd does not see.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._checks import Layout


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor, layout: Layout) -> None:
    if all(t.dtype == out.dtype for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=out)
        return
    # A cast: torch.cat casts input by input on CUDA (H100, fp32 -> bf16, 1 MB: 31 us for 10 tensors, 534 us
    # for 100) where _foreach_copy_ took 13 and 10 us (benchmarks/kernels_h100.md); on one CPU thread 34 against
    # 68 us (10 tensors, 1 MB), 973 against 1670 us (100 tensors, 16 MB). Both round to nearest even.
    torch._foreach_copy_(list(out.split(list(layout.numels))), [t.reshape(-1) for t in tensors])


def scatter(flat: torch.Tensor, outs: Sequence[torch.Tensor], layout: Layout) -> None:
    dsts = [o.view(-1) for o in outs]
    if all(o.dtype == flat.dtype for o in outs):
        torch.split_with_sizes_copy(flat, list(layout.numels), out=dsts)
    else:  # split_with_sizes_copy does not cast; copy_ does, one (foreach) op for all
        torch._foreach_copy_(dsts, list(torch.split_with_sizes(flat, list(layout.numels))))


def chunk_cat(tensors: Sequence[torch.Tensor], layout: Layout, out: torch.Tensor) -> None:
    nc, segs = layout.num_chunks, list(layout.segs)
    if all(t.dtype == out.dtype for t in tensors) and all(n == nc * seg for n, seg in zip(layout.numels, segs)):
        # No padding, one dtype: torch._chunk_cat, one pass (it refuses empty and 0-d tensors: empty ones own
        # no columns, 0-d ones are shape (1,)).
        keep = [t.reshape(-1) if t.dim() == 0 else t for t, seg in zip(tensors, segs) if seg]
        if keep:
            torch._chunk_cat(keep, dim=0, num_chunks=nc, out=out)
        return
    # Padding or casting: the inverse of chunk_split's strided copies, one _foreach_copy_ (which casts) and a
    # zero fill of the padding only. torch._chunk_cat pads by copying each padded tensor whole into a zeroed
    # scratch first (fill, copy, cat): three passes over it and a second padded-size allocation instead of one
    # pass. Measured on GPT-2's root unit (50257-row embedding + 64-row position table + a LayerNorm, 2 chunks,
    # one CPU thread, fresh output): 19 ms against 40 ms (benchmarks/LOG.md, "Communication schedule").
    pairs, pads = _chunk_pieces(out, [t.reshape(-1) for t in tensors], layout)
    if pairs:
        torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])
    if pads:
        torch._foreach_zero_(pads)


def chunk_split(flat: torch.Tensor, outs: Sequence[torch.Tensor], layout: Layout) -> None:
    nc, segs = layout.num_chunks, list(layout.segs)
    if all(o.dtype == flat.dtype for o in outs) and all(n == nc * seg for n, seg in zip(layout.numels, segs)):
        # No padding: one split_with_sizes_copy along dim 1 (FSDP2's copy-out), each tensor in place.
        torch.split_with_sizes_copy(flat, segs, dim=1, out=[o.view(nc, seg) for o, seg in zip(outs, segs)])
        return
    # Padding or casting: per tensor at most two copy_ pairs, its full chunks as one strided (rows, seg) block
    # and the partial last chunk, all in one _foreach_copy_ (which casts like copy_). One pass, no scratch:
    # measured 15.5 ms against 34.4 ms for split_with_sizes_copy into a scratch and a trim (GPT-2 shapes,
    # 50257-row embedding, 2 chunks, one CPU thread).
    pairs, _ = _chunk_pieces(flat, [o.view(-1) for o in outs], layout)
    if pairs:
        torch._foreach_copy_([p for _, p in pairs], [c for c, _ in pairs])


def _chunk_pieces(chunks: torch.Tensor, flats: Sequence[torch.Tensor], layout: Layout):
    """The (num_chunks, S) buffer against 1-D tensors ([Note: rank-major layout]): per tensor at most two
    (buffer region, tensor region) pairs, its full chunks as one strided (rows, seg) block and its partial last
    chunk; and the buffer regions that are padding."""
    nc = layout.num_chunks
    pairs, pads = [], []
    for t, n, seg, off in zip(flats, layout.numels, layout.segs, layout.offsets):
        if not seg:
            continue
        full, rest = divmod(n, seg)
        if full:
            pairs.append((chunks[:full, off : off + seg], t[: full * seg].view(full, seg)))
        if rest:
            pairs.append((chunks[full, off : off + rest], t[full * seg :]))
            pads.append(chunks[full, off + rest : off + seg])
        if full + (1 if rest else 0) < nc:
            pads.append(chunks[full + (1 if rest else 0) :, off : off + seg])
    return pairs, pads
