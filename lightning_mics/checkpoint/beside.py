"""DTensors a checkpoint holds beside the model and optimizer state: what a save does with them, and a load.

[Note: DTensors beside the model]
Besides the module's and the optimizers' state a checkpoint holds other entries (what ``on_save_checkpoint`` hooks
add, or ``fabric.save``'s entries that are neither modules nor optimizers), which rank 0 alone writes (``meta.pt``,
or the full file). A DTensor among them (an average kept as clones of the parameters) holds each rank's own shard:
written by rank 0 alone, every rank would read rank 0's rows back, as under Lightning's FSDP and ModelParallel
strategies (silently wrong on even shards). So, at any depth in dicts, lists and tuples: in the sharded format each
DTensor goes through DCP under ``KEY`` (each rank writes its shard), leaving a placeholder of its global shape,
dtype, placements and mesh axes, and a load reads it into a DTensor of those placements on the live mesh's axes of
the same names (resharded by DCP if the layout changed; ``consolidate`` puts back the full tensor). In the full
format each DTensor is gathered (``full_tensor``, every rank in the same order) and a load slices it back into a
DTensor of its placements: from the Trainer's marker (where each was, its placements and mesh axes) or, under
``fabric.load`` (no marker), where the live state holds a DTensor of that shape; no collective, every rank reads the
whole file. Placements must be ``Shard``, ``Replicate`` or ``_StridedShard``; a ``Partial`` DTensor is refused with
a ``ValueError`` naming the entry, on every rank alike before any collective (every rank walks the same structure).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

KEY = "mics_beside"  # the top-level DCP entry of a sharded checkpoint
TAG = "__mics_dtensor__"  # a placeholder: {TAG: name, "shape": [...], "dtype": "float32", ...} (plain types only)
SKIP = ("state_dict", "optimizer_states")  # the Trainer checkpoint's own model and optimizer state


def _walk(obj: Any, fn: Callable[[Any, Tuple], Any], where: Tuple) -> Any:
    """A copy of ``obj`` with every leaf replaced by ``fn(leaf, where)``, through dicts (their own type kept),
    lists and tuples (named too); a placeholder is a leaf. The containers are new: an entry may be the user's own
    live object (``checkpoint["ema"] = self.ema``), which must keep its DTensors."""
    if isinstance(obj, dict) and TAG not in obj:
        new = copy.copy(obj) if type(obj) is not dict else {}
        for k, v in obj.items():
            new[k] = _walk(v, fn, (*where, k))
        return new
    if isinstance(obj, (list, tuple)):
        items = [_walk(v, fn, (*where, i)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return fn(obj, where)


def _entries(checkpoint: Dict[str, Any], skip: Iterable[str]) -> List[str]:
    return [k for k in checkpoint if k not in skip]


def _name(where: Tuple) -> str:
    return "/".join(map(str, where))


def _encode(p: Placement, where: Tuple) -> List[Any]:
    if isinstance(p, _StridedShard):  # a subclass of Shard: first
        return ["strided", p.dim, p.split_factor]
    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise ValueError(f"checkpoint entry {_name(where)!r}: a DTensor with placement {type(p).__name__} ({p}) cannot "
                     "be saved beside the model (allowed: Shard, Replicate, _StridedShard); call .full_tensor() or "
                     ".redistribute() first.")


def _decode(p: List[Any]) -> Placement:
    if p[0] == "strided":
        return _StridedShard(p[1], split_factor=p[2])
    return Shard(p[1]) if p[0] == "shard" else Replicate()


def _record(leaf: DTensor, where: Tuple) -> Dict[str, Any]:
    return {"where": list(where), "placements": [_encode(p, where) for p in leaf.placements],
            "mesh": list(leaf.device_mesh.mesh_dim_names or ())}


def _mesh_for(record: Dict[str, Any], mesh: DeviceMesh) -> DeviceMesh:
    """The axes of the live ``mesh`` a DTensor was saved on (by name); a ``ValueError`` naming the entry if this
    mesh lacks one (the same on every rank)."""
    names, axes = tuple(mesh.mesh_dim_names or ()), tuple(record["mesh"])
    if not axes or any(a not in names for a in axes):
        raise ValueError(f"checkpoint entry {_name(record['where'])!r}: a DTensor saved on mesh axes {axes}; this "
                         f"run's mesh has axes {names}.")
    return mesh if axes == names else mesh[axes]


def take(checkpoint: Dict[str, Any], skip: Iterable[str] = SKIP) -> Dict[str, DTensor]:
    """Replaces, in place, every DTensor in the entries of ``checkpoint`` (but ``skip``) by a placeholder, and returns
    them by name for DCP (``{KEY: ...}`` as a top-level entry of the sharded save; {} if there are none)."""
    found: Dict[str, DTensor] = {}

    def placeholder(leaf: Any, where: Tuple) -> Any:
        if not isinstance(leaf, DTensor):
            return leaf
        name = str(len(found))
        found[name] = leaf
        return {TAG: name, **_record(leaf, where), "shape": list(leaf.shape), "dtype": str(leaf.dtype).split(".")[-1]}

    for k in _entries(checkpoint, skip):
        checkpoint[k] = _walk(checkpoint[k], placeholder, (k,))
    return {KEY: found} if found else {}


def _placeholders(meta: Dict[str, Any], skip: Iterable[str]) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []

    def note(leaf: Any, where: Tuple) -> Any:
        if isinstance(leaf, dict) and TAG in leaf:
            out.append(leaf)
        return leaf

    for k in _entries(meta, skip):
        _walk(meta[k], note, (k,))
    return out


def targets(meta: Dict[str, Any], mesh: DeviceMesh, skip: Iterable[str] = SKIP) -> Dict[str, Any]:
    """Empty DTensors on ``mesh``'s axes to read the placeholders of ``meta`` into (``{KEY: ...}``; {} if none).
    Raises ``ValueError`` naming the entry if this mesh lacks an axis it was saved on (the same on every rank)."""
    found: Dict[str, DTensor] = {}
    for ph in _placeholders(meta, skip):
        found[ph[TAG]] = torch.distributed.tensor.empty(
            *ph["shape"], dtype=getattr(torch, ph["dtype"]), device_mesh=_mesh_for(ph, mesh),
            placements=[_decode(p) for p in ph["placements"]])
    return {KEY: found} if found else {}


def put_back(meta: Dict[str, Any], loaded: Dict[str, Any], skip: Iterable[str] = SKIP) -> List[Dict[str, Any]]:
    """Replaces, in place, the placeholders of ``meta`` by what the load read under ``KEY`` (DTensors, or the full
    tensors of ``consolidate``); returns where each was, as ``gather_full`` does (for a consolidated file's marker)."""
    tensors, records = loaded.get(KEY, {}), []
    if not tensors:
        return records

    def fill(leaf: Any, where: Tuple) -> Any:
        if not (isinstance(leaf, dict) and TAG in leaf):
            return leaf
        records.append({k: leaf[k] for k in ("where", "placements", "mesh")})
        return tensors[leaf[TAG]]

    for k in _entries(meta, skip):
        meta[k] = _walk(meta[k], fill, (k,))
    return records


def gather_full(checkpoint: Dict[str, Any], skip: Iterable[str] = SKIP) -> List[Dict[str, Any]]:
    """For the full format: every DTensor in the entries of ``checkpoint`` (but ``skip``) replaced, in place, by its
    full tensor. Collective (every rank, the same walk); returns where each was, for ``slice_back``."""
    records: List[Dict[str, Any]] = []

    def full(leaf: Any, where: Tuple) -> Any:
        if not isinstance(leaf, DTensor):
            return leaf
        records.append(_record(leaf, where))  # refuses Partial, as the sharded format does
        return leaf.full_tensor()

    for k in _entries(checkpoint, skip):
        checkpoint[k] = _walk(checkpoint[k], full, (k,))
    return records


def _sliced(full: Any, mesh: DeviceMesh, placements: Any) -> Any:
    """This rank's DTensor of a full tensor every rank holds (no collective)."""
    if not isinstance(full, Tensor) or isinstance(full, DTensor):
        return full
    return distribute_tensor(full.to(mesh.device_type), mesh, placements, src_data_rank=None)


def slice_back(checkpoint: Dict[str, Any], records: List[Dict[str, Any]], mesh: DeviceMesh) -> None:
    """Turns, in place, the full tensors ``gather_full`` left at ``records`` back into DTensors on ``mesh``."""
    at = {tuple(r["where"]): r for r in records}

    def back(leaf: Any, where: Tuple) -> Any:
        rec = at.get(where)
        return leaf if rec is None else _sliced(leaf, _mesh_for(rec, mesh), [_decode(p) for p in rec["placements"]])

    for k in dict.fromkeys(r["where"][0] for r in records):
        if k in checkpoint:
            checkpoint[k] = _walk(checkpoint[k], back, (k,))


def like(template: Any, loaded: Any) -> Any:
    """``loaded`` in the layout of the live ``template`` wherever that holds a DTensor: a full tensor of its shape
    sliced (``fabric.load`` of a full file, which carries no marker), a DTensor of other placements redistributed
    (collective, in the same order on every rank); where ``template`` holds a plain tensor, a DTensor gathered."""
    if isinstance(template, DTensor) and isinstance(loaded, DTensor):
        same = (loaded.device_mesh, tuple(loaded.placements)) == (template.device_mesh, tuple(template.placements))
        return loaded if same else loaded.redistribute(template.device_mesh, template.placements)
    if isinstance(template, DTensor):
        ok = isinstance(loaded, Tensor) and tuple(loaded.shape) == tuple(template.shape)
        return _sliced(loaded, template.device_mesh, template.placements) if ok else loaded
    if isinstance(template, Tensor) and isinstance(loaded, DTensor):
        return loaded.full_tensor()
    if isinstance(template, dict) and isinstance(loaded, dict):
        out = copy.copy(loaded) if type(loaded) is not dict else {}
        for k, v in loaded.items():
            out[k] = like(template.get(k), v)
        return out
    if isinstance(template, list) and isinstance(loaded, list) and len(template) == len(loaded):
        return [like(t, v) for t, v in zip(template, loaded)]
    return loaded
