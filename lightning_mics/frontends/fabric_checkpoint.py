"""The Fabric strategy's checkpoints, as functions (``fabric.py`` calls them from ``save_checkpoint`` /
``load_checkpoint``).

[Note: Fabric checkpoints]
``fabric.save(path, state)`` writes by default (``state_dict_type="sharded"``) a directory in the layout of
[Note: checkpoint layout] (checkpoint/files.py): each module's and each optimizer's state (by parameter name), under
their own keys, go through DCP as the DTensor shards themselves, nothing gathered; the rest of ``state`` (numbers,
``state_dict()`` of stateful objects such as schedulers) goes to ``meta.pt`` with the marker, whose ``fabric`` entry
names the module and optimizer keys. With ``state_dict_type="full"`` rank 0 writes the one file a plain process
would save with Fabric (each module's full state dict of fp32 masters, gathered unit by unit; each optimizer's
``state_dict()`` keyed by position) and no marker: ``fabric.load`` returns a plain process's remainder from it.
Both load into any layout (s, r) with the same keys; ``lightning_mics.consolidate`` turns a directory into the full
form in one process. A load checks the files and the keys on every rank, and the ranks agree before any collective
([Note: checks before collectives]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from lightning.fabric.utilities.types import _Stateful
from torch.optim import Optimizer

from lightning_mics.checkpoint import state as ckpt
from lightning_mics.checkpoint import beside as beside
from lightning_mics.checkpoint import files as files
from lightning_mics.checkpoint import steps as steps
from lightning_mics.checkpoint import feedback as feedback
from lightning_mics.checkpoint import diloco as diloco
from lightning_mics.frontends.shared import engine_holding, engine_of

Strategy = Any  # lightning_mics.fabric.MiCSStrategy (not imported: that module imports this one)


def _split(state: Dict[str, Any]) -> Tuple[Dict[str, nn.Module], Dict[str, Optimizer], Dict[str, Any]]:
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return modules, optimizers, rest


def _owner(optimizer: Optimizer, modules: Dict[str, nn.Module]) -> Tuple[nn.Module, Any]:
    """(the module whose parameter names key the optimizer's state, its engine or None)."""
    engine = engine_holding(optimizer)
    if engine is not None:
        return engine.root, engine
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in modules.values():
        if ids <= {id(p) for p in m.parameters()}:
            return m, None
    raise ValueError("MiCSStrategy: fabric.save/load got an optimizer whose module is neither set up nor in the "
                     "state: allowed are optimizers set up with fabric.setup / setup_optimizers.")


def _check_filter(filter: Dict[str, Any], modules: Dict[str, nn.Module], meta: Dict[str, Any]) -> None:
    """Before any collective: a filter names modules or dict entries of the state, each with a callable."""
    allowed = [*modules, *(k for k, v in meta.items() if isinstance(v, dict))]
    for key, fn in filter.items():
        if key not in allowed or not callable(fn):
            raise ValueError(f"MiCSStrategy: fabric.save(filter={{{key!r}: {fn!r}}}) is invalid: allowed are keys "
                             f"of the state's modules and dicts {allowed}, each with a callable (name, value) -> "
                             "bool (an optimizer's state is saved whole).")


def _optimizers_of(engines: Dict[str, Any], optimizers: Dict[str, Tuple[Optimizer, Any]]) -> Dict[str, List[Optimizer]]:
    """Per module key, the optimizers (in the state's order) that step its engine's shards."""
    return {k: [o for o, owner in optimizers.values() if owner is e] for k, e in engines.items() if e is not None}


def _kept(fn: Any, entries: Dict[str, Any], decide: bool = True) -> Dict[str, Any]:
    """Lightning's filter: the entries for which ``fn(name, value)`` is true (``decide``: this rank calls it)."""
    return {k: v for k, v in entries.items() if fn(k, v)} if decide else entries


def save(strategy: Strategy, path: Any, state: Dict[str, Any], storage_options: Optional[Any],
         filter: Optional[Dict[str, Any]]) -> None:
    """``fabric.save``; ``filter`` ({key: fn(name, value) -> bool}, Lightning's) keeps the entries of a module's
    state dict (or of a dict in the state) it is true for: with the sharded format it is called on rank 0 with the
    parameters' DTensors and every rank writes the names rank 0 keeps; with the full format, on rank 0 with the
    gathered tensors. A filtered checkpoint loads with ``fabric.load(..., strict=False)``."""
    filter = filter or {}
    modules, optimizers, rest = _split(state)
    meta = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in rest.items()}
    _check_filter(filter, modules, meta)
    path, token = steps.path_and_token(path)
    owners = {k: _owner(o, modules) for k, o in optimizers.items()}
    info = {"modules": list(modules), "optimizers": list(optimizers)}
    meta = {k: _kept(filter[k], v) if k in filter else v for k, v in meta.items()}
    with torch.inference_mode(False):
        if strategy.options.state_dict_type == "sharded":
            steps.refuse_remote_sharded(path, storage_options)
            engines = {k: engine_of(m) for k, m in modules.items()}  # [Note: residuals in checkpoints]
            tensors = {k: ckpt.model_state(m, engines[k]) for k, m in modules.items()}
            for k in [k for k in tensors if k in filter]:  # every rank writes the names rank 0's filter keeps
                names = steps.broadcast(list(_kept(filter[k], tensors[k], strategy.is_global_zero)))
                tensors[k] = {n: tensors[k][n] for n in names}
            tensors.update({k: ckpt.optimizer_state_by_name(owners[k][0], o, owners[k][1])
                            for k, o in optimizers.items()})
            tensors.update(feedback.entries(engines, strategy.global_rank))
            tensors.update(beside.take(meta, skip=()))  # [Note: DTensors beside the model]
            inner = _optimizers_of(engines, {k: (o, owners[k][1]) for k, o in optimizers.items()})
            tensors.update(diloco.entries(engines, inner, strategy.global_rank))  # [Note: DiLoCo in checkpoints]
            meta[files.MARKER] = files.marker("sharded", fabric=info, world_size=strategy.world_size,
                                              shard_size=strategy.topology.layout.shard_size,
                                              error_feedback=feedback.layouts(engines),
                                              diloco=diloco.layouts(engines, inner))
            ckpt.write_sharded(tensors, meta, Path(path), token, coordinator=strategy.is_global_zero)
            return
        beside.gather_full(meta, skip=())
        for k, m in modules.items():
            engine = engine_of(m)
            meta[k] = engine.full_state_dict(dst=0) if engine is not None else m.state_dict()
            if k in filter:
                meta[k] = _kept(filter[k], meta[k], strategy.is_global_zero)
        for k, o in optimizers.items():
            engine = owners[k][1]
            meta[k] = ckpt.full_optimizer_state(engine, o, dst=0) if engine is not None else o.state_dict()
    io = strategy.checkpoint_io  # no marker: the file is the dict one plain process saves
    steps.write_full(meta, path, token, io, storage_options, strategy.is_global_zero)


def _check_keys(state: Dict[str, Any], keys: Any, path: Path, strict: bool) -> None:
    """Under ``strict``, every key of ``state`` is in the checkpoint: a ``KeyError`` on every rank otherwise, as
    Lightning's strategies raise it. Collective."""
    missing = sorted(set(state) - set(keys)) if strict else []
    error = None
    if missing:
        which = f"a key {missing[0]!r} that does" if len(missing) == 1 else f"keys {missing} that do"
        error = (f"{path}: the requested state contains {which} not exist in the checkpoint (it holds "
                 f"{sorted(k for k in keys if k != files.MARKER)}); fabric.load(..., strict=False) loads the "
                 "common keys.")
    steps.agree(error, files.MissingKeyError)


def load(strategy: Strategy, path: Any, state: Union[None, nn.Module, Optimizer, Dict[str, Any]], strict: bool,
         weights_only: Optional[bool]) -> Dict[str, Any]:
    """``fabric.load``: restores ``state`` in place and returns what the checkpoint holds beyond it; with no
    state, the whole checkpoint (a directory consolidated in this process). ``fabric.load_raw``: ``state`` is a
    module or an optimizer and the file its plain ``state_dict()``."""
    if isinstance(state, (nn.Module, Optimizer)):
        return _load_raw(strategy, path, state, strict, weights_only)
    state = state or {}

    def check(p: Path, meta: Dict[str, Any]) -> Optional[str]:
        if meta[files.MARKER].get("fabric") is None:
            return f"{p}: written by the Trainer strategy (trainer.save_checkpoint); fabric.load reads fabric.save's."
        return None

    path, full, meta, index = steps.read_checked(path, weights_only, loader=_plugin_loader(strategy, weights_only),
                                                 check=check, lightning=False)
    if not state:
        return full if full is not None else ckpt.consolidate(path)
    present: List[str] = []  # a sharded checkpoint's module and optimizer keys
    if full is None:
        assert meta is not None
        present = [*meta[files.MARKER]["fabric"]["modules"], *meta[files.MARKER]["fabric"]["optimizers"]]
    _check_keys(state, full if full is not None else [*present, *meta], path, strict)
    modules, optimizers, rest = _split(state)
    with torch.inference_mode(False):
        if full is not None:
            feedback.warn_full({k: engine_of(m) for k, m in modules.items()}, path)
            diloco.forget({k: engine_of(m) for k, m in modules.items()}, path)
            for k, m in modules.items():
                if k in full:
                    _load_module(m, full.pop(k), strict)
            for k, o in optimizers.items():
                if k in full:
                    _load_optimizer(o, _owner(o, modules)[1], full.pop(k))
            remainder = full
        else:
            assert meta is not None and index is not None
            mods = {k: (m, engine_of(m)) for k, m in modules.items() if k in present}
            opts = {}
            for k, o in optimizers.items():
                if k in present:
                    module, engine = _owner(o, modules)
                    opts[k] = (module, o, engine)
            engines = {k: e for k, (_, e) in mods.items()}
            residuals = feedback.targets(index, engines, meta[files.MARKER].get("error_feedback"),
                                         strategy.global_rank, path)
            kept = beside.targets(meta, strategy.topology.mesh, skip=(files.MARKER,))
            inner = _optimizers_of(engines, {k: (o, e) for k, (_, o, e) in opts.items()})
            outer = diloco.targets(index, engines, inner, meta[files.MARKER].get("diloco"), strategy.global_rank, path)
            ckpt.load_sharded_entries(path, index, mods, opts, strict, weights_only,
                                      extra={**residuals, **kept, **outer})
            feedback.restore(engines, residuals)
            beside.put_back(meta, kept, skip=(files.MARKER,))
            for m, e in mods.values():  # the shards were read in place; buffers and plain modules through this
                ckpt.apply_model_state(m, ckpt.model_state(m, e, settle=False), e)
            diloco.restore(engines, inner, outer)
            remainder = dict(meta)
    remainder.pop(files.MARKER, None)
    for k, v in rest.items():
        if k in remainder:
            if isinstance(v, _Stateful):
                v.load_state_dict(remainder.pop(k))
            else:  # a full file's tensors sliced back where the live state holds DTensors
                state[k] = beside.like(v, remainder.pop(k))
    return remainder


def _plugin_loader(strategy: Strategy, weights_only: Optional[bool]) -> Optional[Callable[[Path], Any]]:
    """A user's CheckpointIO plugin reads the full files it wrote (``frontend.check_checkpoint_io``); without one,
    ``torch.load`` as the checks choose it."""
    io = strategy.checkpoint_io
    return (lambda p: io.load_checkpoint(p, weights_only=weights_only)) if steps.users_plugin(io) else None


def _load_raw(strategy: Strategy, path: Any, obj: Union[nn.Module, Optimizer], strict: bool,
              weights_only: Optional[bool]) -> Dict:
    path, full, _, _ = steps.read_checked(path, weights_only, loader=_plugin_loader(strategy, weights_only),
                                          lightning=False)
    if full is None:
        raise files.CheckpointError(f"{path}: fabric.load_raw reads one file holding a plain state_dict(), not a "
                                    "directory; fabric.load(path, {{...}}) reads a sharded checkpoint.")
    with torch.inference_mode(False):
        if isinstance(obj, nn.Module):
            _load_module(obj, full, strict)
        else:
            _load_optimizer(obj, engine_holding(obj), full)
    return {}


def _load_module(module: nn.Module, full: Dict[str, Any], strict: bool) -> None:
    engine = engine_of(module)
    if engine is not None:
        engine.load_full_state_dict(full, strict=strict)
    else:
        module.load_state_dict(full, strict=strict)


def _load_optimizer(optimizer: Optimizer, engine: Any, full: Dict[str, Any]) -> None:
    if engine is not None:
        ckpt.load_full_optimizer_state(engine, optimizer, full)
    else:
        optimizer.load_state_dict(full)
