"""Full (consolidated) model and optimizer state for sharded training.

A full optimizer state has exactly the layout a plain, unsharded run of the same optimizer would have
(state keyed by parameter index, tensors of the full parameter's shape), so a checkpoint can be resumed
under any layout (s, r) or by a single process. Per-parameter state tensors of the shard's shape are
gathered over the shard group and unpadded; scalars (``step``) are the same on every rank.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics.runtime import MiCSEngine


def _shard_index(engine: MiCSEngine):
    return {id(p): (u, i) for u in engine.units for i, p in enumerate(u.sharded)}


@torch.no_grad()
def full_optimizer_state(engine: MiCSEngine, optimizer: torch.optim.Optimizer, keep: bool) -> Dict[str, Any]:
    """Collective over the shard group; returns the consolidated state dict where ``keep`` (else {})."""
    index = _shard_index(engine)
    sd = optimizer.state_dict()  # state keyed by position in param_groups order
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out_state: Dict[int, Dict[str, Any]] = {}
    for k, p in enumerate(params):
        st = sd["state"].get(k)
        if st is None:
            continue
        new = {}
        for name, v in st.items():
            if isinstance(v, Tensor) and id(p) in index and v.shape == p.shape:
                u, i = index[id(p)]
                if u.s > 1:
                    g = torch.empty((u.s * v.shape[0],) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device)
                    dist.all_gather_single(g, v.contiguous(), group=engine.topo.shard_group)
                    v = g
                v = v[: u.rows[i]]
            if keep:
                new[name] = v.detach().cpu().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
        if keep:
            out_state[k] = new
    if not keep:
        return {}
    return {"state": out_state, "param_groups": copy.deepcopy(sd["param_groups"])}


@torch.no_grad()
def load_full_optimizer_state(engine: MiCSEngine, optimizer: torch.optim.Optimizer, full: Dict[str, Any]) -> None:
    """Slices this rank's rows out of a consolidated optimizer state and loads it."""
    index = _shard_index(engine)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for k, st in full["state"].items():
        p = params[int(k)]
        new = {}
        for name, v in st.items():
            if isinstance(v, Tensor) and id(p) in index and v.shape == index[id(p)][0].shapes[index[id(p)][1]]:
                u, i = index[id(p)]
                v = u.copy_local_rows_(i, v, torch.empty(p.shape, dtype=v.dtype, device=p.device))
            new[name] = v
        state[int(k)] = new
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def consolidate(path) -> Dict[str, Any]:
    """Loads a checkpoint written by MiCSStrategy and returns a plain dict with a full ``state_dict``."""
    return torch.load(path, map_location="cpu", weights_only=False)
