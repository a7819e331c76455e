"""Full (consolidated) model and optimizer state for sharded training.

A full optimizer state has exactly the layout a plain, unsharded run of the same optimizer would have
(state keyed by parameter index, tensors of the full parameter's shape), so a checkpoint can be resumed
under any layout (s, r) or by a single process. Per-parameter state tensors of the shard's shape are
gathered over the shard group and unpadded; scalars (``step``) are the same on every rank.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics.placement import is_sharded, local
from lightning_mics.runtime import MiCSEngine, Scratch


def _slots(engine: MiCSEngine) -> Dict[int, Any]:
    return {id(p.sharded): p for u in engine.units for p in (*u.params, *u.replicated)}


@torch.no_grad()
def full_optimizer_state(engine: MiCSEngine, optimizer: torch.optim.Optimizer,
                         dst: Optional[int] = 0) -> Dict[str, Any]:
    """The optimizer's state dict with full-shape CPU tensors, as one plain process would have it.

    Collective over the shard group of ``dst`` (a global rank; ``None``: every rank, all of them take part).
    Sharded state (DTensors with a Shard placement) is gathered unit by unit and key by key, so no rank holds
    more than one unit's worth of one state key beyond its shards; returns {} on ranks other than ``dst``.
    """
    rank = dist.get_rank()
    keep = dst is None or rank == dst
    takes_part = dst is None or rank in engine.topo.layout.shard_group_of(dst)
    sd = optimizer.state_dict()  # state keyed by position in param_groups order
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index_of = {id(p): k for k, p in enumerate(params)}
    out: Dict[int, Dict[str, Any]] = defaultdict(dict)
    scratch = Scratch()
    if takes_part:
        for unit in engine.units:
            # (state key, dtype) -> one gather of every sharded parameter of the unit that has it
            groups: Dict[tuple, List[Optional[Tensor]]] = {}
            for i, sp in enumerate(unit.params):
                k = index_of.get(id(sp.sharded))
                for name, v in sd["state"].get(k, {}).items() if k is not None else ():
                    if is_sharded(v):
                        groups.setdefault((name, v.dtype), [None] * len(unit.params))[i] = local(v)
            for (name, dtype), locals_ in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                fulls = unit.gather_rows(locals_, dtype, dst, scratch)
                if keep and fulls is not None:
                    for sp, f in zip(unit.params, fulls):
                        if f is not None:
                            out[index_of[id(sp.sharded)]][name] = f.cpu()
    if not keep:
        return {}
    for k, st in sd["state"].items():
        for name, v in st.items():
            if name in out[k]:
                continue
            out[k][name] = local(v).detach().cpu().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
    return {"state": {k: out[k] for k in sorted(sd["state"])}, "param_groups": copy.deepcopy(sd["param_groups"])}


@torch.no_grad()
def load_full_optimizer_state(engine: MiCSEngine, optimizer: torch.optim.Optimizer, full: Dict[str, Any]) -> None:
    """Slices this rank's rows out of a consolidated optimizer state and loads it as DTensors."""
    slots = _slots(engine)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for k, st in full["state"].items():
        p = params[int(k)]
        slot = slots.get(id(p))
        new = {}
        for name, v in st.items():
            if isinstance(v, Tensor) and slot is not None and v.dim() > 0 and tuple(v.shape) == tuple(slot.shape):
                v = slot.wrap(slot.local_rows_of(v.to(engine.device)).clone())
            new[name] = v
        state[int(k)] = new
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def consolidate(path) -> Dict[str, Any]:
    """Loads a checkpoint written by MiCSStrategy and returns a plain dict with a full ``state_dict``."""
    return torch.load(path, map_location="cpu", weights_only=False)
