"""Gradient norms over sharded gradients: clipping by the total norm, and each parameter's norm for logging.

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

[Note: the norm's device]
Every rank reduces its partial norms, also a rank that holds no gradient of a class (or none at all): its zeros
must be where its peers' sums are, on the mesh's device (NCCL refuses a host tensor that gloo takes). So they are
made on the device of this rank's gradients, else of its parameters (DTensors on the mesh, whose local tensors are
on its device), else of the mesh itself (``mesh.device_type``, the current device of that type), never the host by
default. Nothing is read back: the coefficient is applied on the device (``clamp``, ``_foreach_mul_``).

``grad_norm`` is Lightning's ``lightning.pytorch.utilities.grad_norm`` (each parameter's gradient norm and their
total, to log in ``on_before_optimizer_step``) over the shards. Lightning's builds a plain tensor from the norms of
the gradients, which fails on DTensor gradients (here as under FSDP2); this one gives each norm of the unsharded
gradient as a plain tensor on every rank, with one all-reduce per class of placements (not one per parameter).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_mics.layout.placement import local, sharded_mesh_dims


def _powered_norms(ts: List[Tensor], norm_type: float) -> Tensor:
    """Each local tensor's norm (in fp32), raised to ``norm_type`` (inf: as is): the terms that add (inf: the
    largest wins) over the slices of a tensor and over tensors."""
    norms = torch.stack(torch._foreach_norm([t.float() for t in ts], norm_type))
    return norms if norm_type == float("inf") else norms ** norm_type


def _reduce_over(part: Tensor, dims: Tuple[int, ...], mesh: DeviceMesh, inf: bool) -> None:
    """Sums (inf: maxes) ``part`` in place over the mesh dimensions its tensors are slices over."""
    for d in dims:
        if mesh.size(d) > 1:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(d))


def norm_device(grads: Sequence[Tensor], params: Sequence[Tensor], device_type: str) -> torch.device:
    """Where the norms are summed and reduced ([Note: the norm's device]): the device of the gradients, else of
    the parameters, of the mesh's ``device_type``; else the current device of that type."""
    for t in (*grads, *params):
        if local(t).device.type == device_type:
            return local(t).device
    acc = getattr(torch, "accelerator", None)
    if device_type != "cpu" and acc is not None and acc.is_available() and \
            acc.current_accelerator().type == device_type:
        return torch.device(device_type, acc.current_device_index())
    return torch.device(device_type)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, mesh: DeviceMesh,
                    norm_type: float = 2.0, eps: float = 1e-6) -> Tensor:
    seen, grads, seen_params = set(), [], []
    by_dims: Dict[Tuple[int, ...], List[Tensor]] = {}
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            seen_params.append(p)
            # every rank must see the same classes, even where it holds no gradient of one: those of the
            # parameters' placements (the same on every rank) and the mesh's usual ones
            by_dims.setdefault(sharded_mesh_dims(p), [])
            if p.grad is not None:
                grads.append(p.grad)
    for g in grads:
        by_dims.setdefault(sharded_mesh_dims(g), []).append(local(g))
    for dims in ((1,), (1, 2), (2,)) if mesh.ndim == 3 else ((1,),):
        by_dims.setdefault(dims, [])
    device = norm_device(grads, seen_params, mesh.device_type)
    norm_type = float(norm_type)
    inf = norm_type == float("inf")

    def reduce_local(ts: List[Tensor]) -> Tensor:
        if not ts:
            return torch.zeros((), dtype=torch.float32, device=device)
        terms = _powered_norms(ts, norm_type)
        return terms.max() if inf else terms.sum()

    total = torch.zeros((), dtype=torch.float32, device=device)
    for dims in sorted(by_dims):
        part = reduce_local(by_dims[dims])
        _reduce_over(part, dims, mesh, inf)
        total = torch.maximum(total, part) if inf else total + part
    if not inf:
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    flat = [t for ts in by_dims.values() for t in ts]
    if flat:
        torch._foreach_mul_(flat, coef.to(flat[0].device))
    return total


@torch.no_grad()
def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> Dict[str, Tensor]:
    """Lightning's ``grad_norm`` over sharded gradients: ``{"grad_<p>_norm/<name>": norm, ...,
    "grad_<p>_norm_total": norm of the norms}`` for each parameter with a gradient, the norms those of the unsharded
    gradients, as plain 0-dim tensors on every rank. Call it on every rank (it all-reduces), as
    ``trainer.strategy``'s collectives are called; on a plain module it is Lightning's, with no collective."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm got norm_type={norm_type}: allowed is a positive number or 'inf'.")
    inf = norm_type == float("inf")
    classes: Dict[Tuple[int, Tuple[int, ...]], Tuple[DeviceMesh, List[str], List[Tensor]]] = {}
    names = []
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        names.append(name)
        mesh, dims = getattr(p.grad, "device_mesh", None), sharded_mesh_dims(p.grad)
        # classes in the order of their first parameter (the same on every rank): the collectives' order
        _, group, grads = classes.setdefault((id(mesh), dims), (mesh, [], []))
        group.append(name)
        grads.append(local(p.grad))
    norms: Dict[str, Tensor] = {}
    for (_, dims), (mesh, group, grads) in classes.items():
        part = _powered_norms(grads, norm_type)
        _reduce_over(part, dims, mesh, inf)
        part = part if inf else part ** (1.0 / norm_type)
        norms.update((n, v.to(g.dtype)) for n, v, g in zip(group, part.unbind(), grads))
    out = {f"grad_{norm_type}_norm{group_separator}{n}": norms[n] for n in names}
    if out:
        out[f"grad_{norm_type}_norm_total"] = torch.stack([v.float() for v in out.values()]).norm(norm_type)
    return out
