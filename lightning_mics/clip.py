"""Gradient-norm clipping over sharded gradients.

Each rank of a shard group holds a different slice of every sharded gradient, and after the replica
all-reduce every replica holds the same slices, so the squared norm is summed over the *shard group only*.
Replicated (small) parameters hold the same whole gradient on every rank: counted once, locally.
Padding rows of a shard carry zero gradient and add nothing. The result equals
``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
"""

from __future__ import annotations

from typing import Iterable, Set

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, sharded_ids: Set[int],
                    shard_group: dist.ProcessGroup, shard_size: int, norm_type: float = 2.0,
                    eps: float = 1e-6) -> Tensor:
    params = [p for p in params if p.grad is not None]
    sharded = [p.grad for p in params if id(p) in sharded_ids]
    replicated = [p.grad for p in params if id(p) not in sharded_ids]
    device = params[0].grad.device if params else torch.device("cpu")
    norm_type = float(norm_type)

    def local(grads, agg):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch._foreach_norm([g.float() for g in grads], norm_type)
        return agg(torch.stack(norms))

    if norm_type == float("inf"):
        shard_part = local(sharded, torch.max)
        if shard_size > 1:
            dist.all_reduce(shard_part, op=dist.ReduceOp.MAX, group=shard_group)
        total = torch.maximum(shard_part, local(replicated, torch.max))
    else:
        shard_part = local(sharded, lambda n: (n ** norm_type).sum())
        if shard_size > 1:
            dist.all_reduce(shard_part, op=dist.ReduceOp.SUM, group=shard_group)
        total = (shard_part + local(replicated, lambda n: (n ** norm_type).sum())) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    grads = sharded + replicated
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
