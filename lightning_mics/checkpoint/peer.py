"""This rank's model state as a peer of the same layout holds it: what a replica group that joins a
fault-tolerant job loads from a live one ([Note: fault-tolerant replica groups] in options.py).

[Note: a peer's state]
Rank k of every replica group holds the same rows of every parameter (the same layout: world, s and module), so
a joining group takes rank k's state as it is, tensor for tensor, without a gather or a reshard: each unit's flat
master shard, the replicated parameters, the module's buffers, each optimizer's state with its DTensors as
their local tensors (their placement is the joining rank's own), and under DiLoCo the outer loop's anchors, outer
momentum and step counts. ``local_state`` copies nothing and runs no
collective (a quorum thread reads it while the main thread waits); ``load_local_state`` checks the layout's
fingerprint first, releases every unit (the masters change under them) and writes in place, so the optimizer's
DTensors keep viewing the shards.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.layout.placement import local


def fingerprint(engine: MiCSEngine) -> Dict[str, Any]:
    """What must agree between two ranks for one to take the other's state ([Note: a peer's state])."""
    lay = engine.topo.layout
    return {"world": lay.world_size, "s": lay.shard_size, "shard_rank": engine.topo.shard_rank,
            "units": [u.shard_flat.numel() for u in engine.units],
            "replicated": [tuple(rp.local.shape) for rp in engine.replicated],
            "buffers": [name for name, _ in engine.root.named_buffers()],
            "sync_every": engine.outer.sync_every if engine.outer is not None else None}


def _plain(t: Tensor) -> Tensor:
    return local(t).detach()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    sd = optimizer.state_dict()
    state = {k: {name: _plain(v) if isinstance(v, Tensor) else v for name, v in st.items()}
             for k, st in sd["state"].items()}
    kinds = {k: [name for name, v in st.items() if isinstance(v, DTensor)] for k, st in sd["state"].items()}
    return {"state": state, "dtensors": kinds, "param_groups": sd["param_groups"]}


def local_state(engine: MiCSEngine, optimizers: Sequence[torch.optim.Optimizer]) -> Dict[str, Any]:
    """This rank's state for a peer ([Note: a peer's state]): the tensors themselves, no copy, no collective."""
    return {"layout": fingerprint(engine),
            "units": [u.shard_flat.detach() for u in engine.units],
            "replicated": [rp.local.detach() for rp in engine.replicated],
            "buffers": [b.detach() for _, b in engine.root.named_buffers()],
            "optimizers": [_optimizer_state(o) for o in optimizers], "outer": _outer_state(engine)}


def _outer_state(engine: MiCSEngine) -> Optional[Dict[str, Any]]:
    """DiLoCo's outer loop ([Note: DiLoCo in checkpoints] in diloco.py), its flags and counts as plain lists."""
    if engine.outer is None:
        return None
    state = engine.outer.state()
    return {"anchors": state["anchors"], "momentum": state["momentum"],
            "has_momentum": state["has_momentum"].tolist(), "steps": state["steps"].tolist()}


def _check(engine: MiCSEngine, state: Dict[str, Any], count: int) -> None:
    ours, theirs = fingerprint(engine), state.get("layout")
    if theirs != ours:
        raise ValueError(f"MiCSStrategy(fault_tolerance=True): the live peer's layout {theirs} differs from this "
                         f"group's {ours}; allowed is the same number of ranks, the same options and the same "
                         "module in every replica group.")
    if len(state["optimizers"]) != count:
        raise ValueError(f"MiCSStrategy(fault_tolerance=True): the live peer has {len(state['optimizers'])} "
                         f"optimizer(s), this group {count}; allowed is the same optimizers in every group.")


@torch.no_grad()
def _load_optimizer(engine: MiCSEngine, optimizer: torch.optim.Optimizer, saved: Dict[str, Any]) -> None:
    slots = {id(p.sharded): p for u in engine.units for p in u.all_params()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for k, st in saved["state"].items():
        slot = slots.get(id(params[int(k)]))
        wrapped = set(saved["dtensors"].get(k, ()))
        state[int(k)] = {name: slot.wrap(v.to(engine.device).clone()) if name in wrapped and slot is not None
                         else (v.clone() if isinstance(v, Tensor) else v) for name, v in st.items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


@torch.no_grad()
def load_local_state(engine: MiCSEngine, optimizers: Sequence[torch.optim.Optimizer], state: Dict[str, Any]) -> None:
    """Takes a peer's ``local_state`` as this rank's ([Note: a peer's state]). Local: no collective."""
    _check(engine, state, len(optimizers))
    engine.release_idle()  # every unit released: a gathered one would go on with (and take back) the old values
    for unit, shard in zip(engine.units, state["units"]):
        unit.shard_flat.copy_(shard)
    for rp, value in zip(engine.replicated, state["replicated"]):
        rp.local.copy_(value)
    buffers: List[Tensor] = [b for _, b in engine.root.named_buffers()]
    for b, value in zip(buffers, state["buffers"]):
        local(b).copy_(value)
    for unit in engine.units:
        unit.rows_written()  # [Note: rows between steps] in optimizer_rows.py
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        _load_optimizer(engine, optimizer, saved)
    if engine.outer is not None:
        outer = state["outer"]
        engine.outer.load_state({"anchors": outer["anchors"], "momentum": outer["momentum"],
                                 "has_momentum": torch.tensor(outer["has_momentum"], dtype=torch.bool),
                                 "steps": torch.tensor(outer["steps"], dtype=torch.int64)})
    engine.pin()
