"""Gradient-norm clipping over sharded gradients.

Each rank of a shard group holds a different slice of every sharded gradient, and after the replica
all-reduce every replica holds the same slices, so a sharded gradient's squared norm is summed over the
*shard group only* (with the optimizer's rows over replicas, [Note: optimizer rows over replicas] in
optimizer_rows.py, a gradient is a slice over both axes and summed over both). Replicated (small) parameters
hold the same whole gradient on every rank: counted once, locally. With tensor parallelism a gradient can also
be a slice over the "tp" axis. Which is which is read from the gradient's placement ([Note: placement] in
placement.py): gradients are grouped by the mesh dimensions over which they are slices, and each group's local
sum is all-reduced over exactly those dimensions. The groups are the same on every rank (placements are), so
every rank issues the same collectives. The result equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded
model.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_mics.placement import local, sharded_mesh_dims


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, mesh: DeviceMesh,
                    norm_type: float = 2.0, eps: float = 1e-6) -> Tensor:
    seen, grads = set(), []
    by_dims: Dict[Tuple[int, ...], List[Tensor]] = {}
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            # every rank must see the same classes, even where it holds no gradient of one: those of the
            # parameters' placements (the same on every rank) and the mesh's usual ones
            by_dims.setdefault(sharded_mesh_dims(p), [])
            if p.grad is not None:
                grads.append(p.grad)
    for g in grads:
        by_dims.setdefault(sharded_mesh_dims(g), []).append(local(g))
    for dims in ((1,), (1, 2), (2,)) if mesh.ndim == 3 else ((1,),):
        by_dims.setdefault(dims, [])
    device = grads[0].device if grads else torch.device("cpu")
    norm_type = float(norm_type)
    inf = norm_type == float("inf")

    def reduce_local(ts: List[Tensor]) -> Tensor:
        if not ts:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch.stack(torch._foreach_norm([t.float() for t in ts], norm_type))
        return norms.max() if inf else (norms ** norm_type).sum()

    total = torch.zeros((), dtype=torch.float32, device=device)
    for dims in sorted(by_dims):
        part = reduce_local(by_dims[dims])
        for d in dims:
            if mesh.size(d) > 1:
                dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(d))
        total = torch.maximum(total, part) if inf else total + part
    if not inf:
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    flat = [t for ts in by_dims.values() for t in ts]
    if flat:
        torch._foreach_mul_(flat, coef.to(flat[0].device))
    return total
