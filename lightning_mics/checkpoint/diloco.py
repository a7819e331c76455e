"""DiLoCo's state in sharded checkpoints: what each replica group holds apart, and when a load takes it back.

[Note: DiLoCo in checkpoints]
Under ``replica_sync="diloco"`` the replica groups differ between outer steps: each has its own masters and its own
inner optimizer state, while a sharded checkpoint's model and optimizer entries hold one copy (DCP writes a tensor
replicated over the replicate axis once). So every rank also writes, under ``KEY``, what is its own::

    {KEY: {<module key>: {"rank<k>": {"masters": {i: t}, "anchors": {i: t}, "momentum": {i: t},
                                      "has_momentum": t, "steps": t, "inner": {<optimizer>: {<slot>: {<name>: t}}},
                                      "in_flight": t}}}}

(the masters and anchors in the order of ``OuterSync.masters``; ``inner``: the local tensors of the inner optimizer's
state, by position of the parameter in the optimizer; ``steps``: the window's inner steps, the outer steps and the
fragment in flight; ``in_flight``, only when there is one: its average, waited for at the save, applied at its step
after the load, [Note: streaming fragments] in engine/fragments.py). A load into the same layout (world size, s,
units, optimizers, fragments) reads them back after the model and the optimizer have been loaded, so a resumed run
is the uninterrupted one, inside a window too. From another layout, a full checkpoint or one saved without DiLoCo,
every replica starts from the checkpoint's copy and the anchors are taken again at the next step (a warning says so).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mics.checkpoint.files import empty_entries_under
from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.layout.placement import local

KEY = "mics_diloco"
Engines = Dict[str, Optional[MiCSEngine]]
Optimizers = Dict[str, Sequence[torch.optim.Optimizer]]  # each module key's optimizers, in the checkpoint's order


def layouts(engines: Engines, optimizers: Optimizers) -> Dict[str, Optional[Dict[str, Any]]]:
    """For the checkpoint's marker: per module key, what its DiLoCo state depends on (None: not DiLoCo)."""
    return {k: _layout(e, optimizers.get(k, ())) for k, e in engines.items()}


def _layout(engine: Optional[MiCSEngine], optimizers: Sequence[torch.optim.Optimizer]) -> Optional[Dict[str, Any]]:
    if engine is None or engine.outer is None:
        return None
    lay, outer = engine.topo.layout, engine.outer
    out = {"world_size": lay.world_size, "shard_size": lay.shard_size, "units": len(engine.units),
           "masters": [m.numel() for m in outer.masters],
           "optimizers": [sum(len(g["params"]) for g in o.param_groups) for o in optimizers]}
    if len(outer.fragments) > 1 or outer.delay:  # what the step count and a fragment in flight mean
        out["fragments"] = [len(outer.fragments), outer.sync_every, outer.delay]
    return out


def entries(engines: Engines, optimizers: Optimizers, rank: int) -> Dict[str, Any]:
    """This rank's DiLoCo state (the tensors themselves) as top-level entries of a sharded save; {} if none."""
    mine = {}
    for key, engine in engines.items():
        if engine is None or engine.outer is None:
            continue
        outer = engine.outer.state()
        state = {"masters": _numbered(m.detach() for m in engine.outer.masters),
                 "anchors": _numbered(outer["anchors"]), "momentum": _numbered(outer["momentum"]),
                 "has_momentum": outer["has_momentum"], "steps": outer["steps"],
                 "inner": {str(i): _inner_state(o) for i, o in enumerate(optimizers.get(key, ()))}}
        if "in_flight" in outer:
            state["in_flight"] = outer["in_flight"]
        mine[key] = {f"rank{rank}": state}
    return {KEY: mine} if mine else {}


def _numbered(tensors: Any) -> Dict[str, Tensor]:
    return {str(i): t for i, t in enumerate(tensors)}


def _params(optimizer: torch.optim.Optimizer) -> List[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _inner_state(optimizer: torch.optim.Optimizer) -> Dict[str, Dict[str, Tensor]]:
    """The local tensors of ``optimizer``'s state (those with a dimension: ``step`` is the same on every replica)."""
    out: Dict[str, Dict[str, Tensor]] = {}
    for j, p in enumerate(_params(optimizer)):
        st = {n: local(v).detach() for n, v in optimizer.state.get(p, {}).items() if isinstance(v, Tensor) and v.dim()}
        if st:
            out[str(j)] = st
    return out


def targets(index: Metadata, engines: Engines, optimizers: Optimizers, saved: Optional[Dict[str, Any]], rank: int,
            where: Any) -> Dict[str, Any]:
    """Top-level entries of empty tensors to read this rank's DiLoCo state into (``restore`` takes it back once the
    model and the optimizers are loaded); {} if there is none to take. ``saved``: the marker's ``diloco``."""
    found = {}
    for key, engine in engines.items():
        want = _layout(engine, optimizers.get(key, ()))
        if want is None:
            continue
        have = (saved or {}).get(key)
        if have != want:
            _restart(where, "it was saved without replica_sync='diloco'" if have is None else
                     f"it was saved in another layout ({have} here {want})")
            continue
        target = empty_entries_under(index, (KEY, key, f"rank{rank}"), engine.device)
        if target:
            found[key] = target
    return {KEY: found} if found else {}


def restore(engines: Engines, optimizers: Optimizers, loaded: Optional[Dict[str, Any]]) -> None:
    """Takes back what ``targets`` read, after the model's and the optimizers' load: ``restore_model`` and
    ``restore_optimizers`` at once."""
    restore_model(engines, loaded)
    restore_optimizers(engines, optimizers)


def restore_model(engines: Engines, loaded: Optional[Dict[str, Any]]) -> None:
    """Each replica's masters, the anchors, the outer momentum and the step count, from what ``targets`` read (after
    the model's load); the inner optimizer's part is kept for ``restore_optimizers``. A DiLoCo engine with nothing to
    take starts its outer loop again from the loaded masters."""
    taken = (loaded or {}).get(KEY, {})
    for key, engine in engines.items():
        if engine is None or engine.outer is None:
            continue
        mine = next(iter(taken[key].values()), None) if key in taken else None
        engine.outer.loaded_inner = None
        if mine is None:
            engine.outer.forget()
            continue
        with torch.no_grad():
            for i, m in enumerate(engine.outer.masters):
                m.copy_(mine["masters"][str(i)].view_as(m))
        n = len(engine.outer.masters)
        engine.outer.load_state({"anchors": [mine["anchors"][str(i)] for i in range(n)],
                                 "momentum": [mine["momentum"][str(i)] for i in range(n)],
                                 "has_momentum": mine["has_momentum"], "steps": mine["steps"],
                                 "in_flight": mine.get("in_flight")})
        engine.outer.loaded_inner = mine.get("inner", {})


@torch.no_grad()
def restore_optimizers(engines: Engines, optimizers: Optimizers) -> None:
    """Each replica's own inner optimizer state (its local tensors), after the optimizers' load."""
    for key, engine in engines.items():
        if engine is None or engine.outer is None or engine.outer.loaded_inner is None:
            continue
        for i, o in enumerate(optimizers.get(key, ())):
            params = _params(o)
            for j, st in engine.outer.loaded_inner.get(str(i), {}).items():
                for name, t in st.items():
                    local(o.state[params[int(j)]][name]).copy_(t)
        engine.outer.loaded_inner = None


def forget(engines: Engines, where: Any = "the checkpoint") -> None:
    """A load that carries no DiLoCo state (a full checkpoint): the outer loops start again from the loaded masters."""
    if any(e is not None and e.outer is not None for e in engines.values()):
        _restart(where, "a full checkpoint holds one copy of the model and the optimizer (state_dict_type='sharded' "
                        "carries each replica group's own)")
    restore_model(engines, None)


def _restart(where: Any, why: str) -> None:
    rank_zero_warn(f"MiCSStrategy(replica_sync='diloco'): {where} gives no DiLoCo state for this run: {why}. Every "
                   "replica group starts from the checkpoint's copy and the outer loop from its masters "
                   "([Note: DiLoCo in checkpoints] in lightning_mics/checkpoint/diloco.py).")
