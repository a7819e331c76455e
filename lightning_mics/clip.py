"""Gradient-norm clipping over sharded gradients.

Each rank of a shard group holds a different slice of every sharded gradient, and after the replica
all-reduce every replica holds the same slices, so the squared norm is summed over the *shard group only*.
Replicated (small) parameters hold the same whole gradient on every rank: counted once, locally. Which is
which is read from the gradient's placement ([Note: placement] in placement.py): a DTensor with a Shard
placement holds a slice; anything else is whole. The result equals ``torch.nn.utils.clip_grad_norm_`` on the
unsharded model.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics.placement import is_sharded, local


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, shard_group: dist.ProcessGroup,
                    shard_size: int, norm_type: float = 2.0, eps: float = 1e-6) -> Tensor:
    seen, grads = set(), []
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            grads.append(p.grad)
    sharded = [local(g) for g in grads if is_sharded(g)]
    replicated = [local(g) for g in grads if not is_sharded(g)]
    device = grads[0].device if grads else torch.device("cpu")
    norm_type = float(norm_type)

    def reduce_local(grads, agg):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch._foreach_norm([g.float() for g in grads], norm_type)
        return agg(torch.stack(norms))

    if norm_type == float("inf"):
        shard_part = reduce_local(sharded, torch.max)
        if shard_size > 1:
            dist.all_reduce(shard_part, op=dist.ReduceOp.MAX, group=shard_group)
        total = torch.maximum(shard_part, reduce_local(replicated, torch.max))
    else:
        shard_part = reduce_local(sharded, lambda n: (n ** norm_type).sum())
        if shard_size > 1:
            dist.all_reduce(shard_part, op=dist.ReduceOp.SUM, group=shard_group)
        total = (shard_part + reduce_local(replicated, lambda n: (n ** norm_type).sum())) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    grads = sharded + replicated
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
