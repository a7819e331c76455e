"""Model and optimizer state for checkpoints: full (gathered) and sharded (torch.distributed.checkpoint).

*Full*: exactly the layout a plain, unsharded run of the same module and optimizer would have (optimizer state
keyed by parameter index, tensors of the full parameter's shape), gathered from the fp32 masters unit by unit
onto rank 0, so a checkpoint can be resumed under any layout (s, r), by a single process or another strategy.

*Sharded*: the module's own state dict with the DTensor shards in it ([Note: placement] in placement.py) and
each optimizer's state keyed by parameter name, written and read through DCP ([Note: checkpoint layout] in
checkpoint/files.py). Nothing is gathered: every rank writes its rows, reads the rows its own layout needs
([Note: resharding]), and ``consolidate`` turns a directory into the full form in one process.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import uuid
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_mics.checkpoint import beside as beside
from lightning_mics.checkpoint import files as files
from lightning_mics.checkpoint.files import CheckpointError, set_element
from lightning_mics.layout.placement import as_dtensor, is_sharded, local
from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.engine.full_state import ReusedBuffers, gather_rows


def _slots(engine: MiCSEngine) -> Dict[int, Any]:
    return {id(p.sharded): p for u in engine.units for p in u.all_params()}


@torch.no_grad()
def full_optimizer_state(engine: MiCSEngine, optimizer: torch.optim.Optimizer,
                         dst: Optional[int] = 0) -> Dict[str, Any]:
    """The optimizer's state dict with full-shape CPU tensors, as one plain process would have it.

    Collective over the shard group of ``dst`` (a global rank; ``None``: every rank, all of them take part; with
    tensor parallelism every rank takes part, and the tensor-parallel parts are gathered too, as in
    ``MiCSEngine.full_state_dict``; with the optimizer's rows over replicas every rank takes part, each first
    gathering its chunk over its replica group). Sharded state (DTensors with a Shard placement) is gathered
    unit by unit and key by key, so no rank holds more than one unit's worth of one state key beyond its shards;
    returns {} on ranks other than ``dst``.
    """
    engine.release_idle(pinned=False)  # the rows settled; a pinned unit stays (the state is the optimizer's own)
    rank = dist.get_rank()
    keep = dst is None or rank == dst
    tp = engine.topo.layout.tp_size > 1
    in_group = tp or dst is None or rank in engine.topo.layout.shard_group_of(dst)
    # with optimizer rows over replicas every rank first gathers its chunk over its replica group
    over_replicas = any(u.optimizer_rows is not None for u in engine.units)
    takes_part = in_group or over_replicas
    sd = optimizer.state_dict()  # state keyed by position in param_groups order
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index_of = {id(p): k for k, p in enumerate(params)}
    slots = _slots(engine)
    out: Dict[int, Dict[str, Any]] = defaultdict(dict)
    done = set()  # (index, state key) gathered with the units
    buffers = ReusedBuffers(engine.units)
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
                if unit.optimizer_rows is not None:  # [Note: optimizer rows over replicas]
                    locals_ = unit.optimizer_rows.chunks(locals_, dtype, unit.device)
                if not in_group:
                    continue
                fulls = gather_rows(unit, locals_, dtype, None if tp else dst, buffers)
                for sp, f in zip(unit.params, fulls or ()):
                    if f is None:
                        continue
                    k = index_of[id(sp.sharded)]
                    done.add((k, name))
                    if sp.tp_spec is not None:  # collective over the tensor-parallel group
                        f = as_dtensor(f, sp.tp_spec).full_tensor()
                    if keep:
                        out[k][name] = f.cpu()
    if not (keep or tp):
        return {}
    for k, st in sorted(sd["state"].items()):  # the same order on every rank
        slot = slots.get(id(params[k]))
        for name, v in st.items():
            if (k, name) in done:
                continue
            if tp and slot is not None and slot.tp_spec is not None and isinstance(v, Tensor) and v.dim() > 0:
                v = as_dtensor(local(v), slot.tp_spec).full_tensor()  # a replicated parameter's tensor-parallel parts
            if keep:
                out[k][name] = local(v).detach().cpu().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
    groups = copy.deepcopy(sd["param_groups"]) if keep else None
    return {"state": {k: out[k] for k in sorted(sd["state"])}, "param_groups": groups} if keep else {}


@torch.no_grad()
def load_full_optimizer_state(engine: MiCSEngine, optimizer: torch.optim.Optimizer, full: Dict[str, Any]) -> None:
    """Slices this rank's rows out of a consolidated optimizer state (by position, or by name as torch's and
    Lightning's consolidations key it) and loads it as DTensors."""
    if any(isinstance(n, str) for g in full.get("param_groups", []) for n in g["params"]):
        full = _by_index(full)
    slots = _slots(engine)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for k, st in full["state"].items():
        p = params[int(k)]
        slot = slots.get(id(p))
        new = {}
        for name, v in st.items():
            if isinstance(v, Tensor) and slot is not None and v.dim() > 0 and v.shape == slot.global_shape:
                v = slot.wrap(slot.local_rows_of(v.to(engine.device)).clone())
            new[name] = v
        state[int(k)] = new
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


# -- sharded -------------------------------------------------------------------------------------------------------
# [Note: resharding]
# A saved chunk is a box of a global tensor (DCP's index records its offsets and sizes). On load every rank asks
# for the boxes of its *own* layout: its module's DTensor shards ((Replicate, Shard(0)) rows on the new mesh, or
# whole tensors where the new layout replicates them) and optimizer state of the same placement, allocated from
# the index; DCP reads exactly the overlapping bytes of the saved chunks into them. So a checkpoint written at
# (world, s) loads at any (world', s'), one process included, without a gather, and no rank holds more than its
# own rows (plus replicated tensors) at any time.
#
# [Note: optimizer state by name]
# On disk an optimizer's state is keyed by parameter name (the layout torch's get_optimizer_state_dict produces),
# because indices mean nothing across models and names survive resharding. The re-keying is done here rather than
# by torch's get/set_optimizer_state_dict: both first *initialize* an empty optimizer state by stepping once with
# zero gradients, which on a save before the first step would create state a plain run does not have (Adam's step
# counter), and on a load allocates a whole second copy of the state before loading over it. Loading instead
# allocates the targets from DCP's index, in this rank's placement, and hands them to ``optimizer.load_state_dict``.


def _named(module: nn.Module, engine: Optional[MiCSEngine] = None) -> List[tuple]:
    """(name, parameter) for every name of every parameter, the optimizer's DTensor in place of the full twin the
    module holds while a unit is gathered (a save from inside a step)."""
    shard_of = {id(p.full): p.sharded for u in engine.units for p in u.all_params()} if engine else {}
    return [(n, shard_of.get(id(p), p)) for n, p in module.named_parameters(remove_duplicate=False)]


def _names(module: nn.Module, engine: Optional[MiCSEngine] = None) -> Dict[int, str]:
    """id(parameter) -> its name (the first one, for a parameter registered under several)."""
    return {id(p): n for n, p in reversed(_named(module, engine))}  # reversed: the first name written last


def model_state(module: nn.Module, engine: Optional[MiCSEngine] = None, settle: bool = True) -> Dict[str, Any]:
    """The module's state dict for a sharded save: the DTensor shards themselves (no copy). A unit that happens to
    be gathered (a save from inside a step) contributes its fp32 master shards, never the gathered param_dtype
    tensors the module holds at that moment. ``settle``: what user code wrote into a gathered unit's parameters is
    taken into the masters, and the optimizer's rows written or stepped since the replicas last agreed on them are
    exchanged first (collective); not once a load has written the chunks."""
    sd = get_model_state_dict(module)
    if engine is not None:
        if settle:  # [Note: writes between steps] in user_code/write_back.py, [Note: rows between steps] in optimizer_rows.py
            engine.settle_masters()
        # the chunks as saved without optimizer rows over replicas (``checkpoint_view``): checkpoints do not depend on it
        views = {id(q): p.checkpoint_view for u in engine.units for p in u.all_params() for q in (p.full, p.sharded)}
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in views:
                sd[name] = views[id(t)].detach()
    return sd


@torch.no_grad()
def apply_model_state(module: nn.Module, state: Dict[str, Any], engine: Optional[MiCSEngine] = None,
                      strict: bool = False) -> None:
    """Puts a sharded model state (``model_state``'s layout, e.g. read in place and edited by a hook) into the
    module: a DTensor entry of its target's placement is copied shard to shard (the chunk also where the
    optimizer's rows are cut over replicas, [Note: optimizer rows over replicas]); the rest through
    ``set_model_state_dict``. The load may have written the chunks in place already: nothing is exchanged before
    they are taken as what the replicas agree on."""
    target = model_state(module, engine, settle=False)
    if strict:
        missing, unexpected = [k for k in target if k not in state], [k for k in state if k not in target]
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                               f"{missing}, unexpected keys {unexpected}")
    rest = {}
    for k, v in state.items():
        t = target.get(k)
        if isinstance(t, DTensor) and isinstance(v, DTensor) and (t.placements, t.shape) == (v.placements, v.shape):
            if local(t).data_ptr() != local(v).data_ptr():
                local(t).copy_(local(v))
        else:
            rest[k] = v
    if rest:
        set_model_state_dict(module, rest, options=StateDictOptions(strict=False))
    for u in engine.units if engine is not None else ():
        u.rows_written()  # [Note: rows between steps] in optimizer_rows.py


def optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer,
                            engine: Optional[MiCSEngine] = None) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of indices ([Note: optimizer state by name]).
    The tensors are the optimizer's own (DTensor shards while the module is sharded): nothing is copied."""
    names = _names(module, engine)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    strangers = [tuple(p.shape) for p in params if id(p) not in names]
    if strangers:
        raise ValueError(f"MiCSStrategy: an optimizer holds parameters that are not the module's (shapes "
                         f"{strangers[:4]}); a checkpoint keys optimizer state by the module's parameter names.")
    sd = optimizer.state_dict()
    keys = [names[id(p)] for p in params]
    return {"state": {keys[k]: v for k, v in sd["state"].items()},
            "param_groups": [dict(g, params=[keys[i] for i in g["params"]]) for g in sd["param_groups"]]}


def _saved(index: Metadata, key: str):
    """(path below ``key``, index entry) for every leaf DCP saved under the top-level ``key``."""
    for flat, md in index.state_dict_metadata.items():
        where = index.planner_data.get(flat)
        if where and where[0] == key:
            yield tuple(where[1:]), md


def _optimizer_target(module: nn.Module, index: Metadata, key: str, path: Path,
                      engine: Optional[MiCSEngine] = None) -> Dict[str, Any]:
    """Empty tensors in this rank's layout for every optimizer-state entry saved under ``key`` (a tensor of its
    parameter's shape takes the parameter's placement; others, e.g. ``step``, are read whole); placeholders for
    non-tensor values, which DCP replaces."""
    params = dict(_named(module, engine))
    target: Dict[str, Any] = {}
    for where, md in _saved(index, key):
        value = None
        if isinstance(md, TensorStorageMetadata):
            if where[0] != "state" or len(where) != 3:
                raise CheckpointError(f"{path}: unexpected tensor {'.'.join(map(str, (key, *where)))} in the "
                                      "optimizer state.")
            p = params.get(where[1])
            if p is None:
                raise CheckpointError(f"{path}: holds optimizer state for parameter {where[1]!r}, which the module "
                                      "does not have.")
            dtype = md.properties.dtype
            if tuple(md.size) == tuple(p.shape):
                value = torch.empty_like(p.detach(), dtype=dtype)  # a DTensor of p's placement, or a plain tensor
            else:
                value = torch.empty(tuple(md.size), dtype=dtype)
        set_element(target, where, value)
    target.setdefault("state", {})
    return target


def load_sharded(path: Path, index: Metadata, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 strict: bool, weights_only: Optional[bool], engine: Optional[MiCSEngine] = None,
                 extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Reads this rank's part of a sharded checkpoint ([Note: resharding]). The module's own shards are read in
    place; optimizer state into new tensors, returned by name for ``load_optimizer_by_name``; ``extra``: more
    top-level entries to read (this rank's own tensors). Key mismatches are raised before DCP's collectives
    (every rank sees the same index). Collective over the world."""
    state: Dict[str, Any] = {"state_dict": _model_target(path, index, "state_dict", module, strict, engine)}
    for i in range(len(optimizers)):
        state[f"optimizer_{i}"] = _optimizer_target(module, index, f"optimizer_{i}", path, engine)
    state.update(extra or {})
    dcp.load(state, storage_reader=files.SafeReader(path),
             planner=files.LoadPlanner(weights_only=weights_only is not False))
    return state


def _model_target(path: Path, index: Metadata, key: str, module: nn.Module, strict: bool,
                  engine: Optional[MiCSEngine]) -> Dict[str, Any]:
    """The module's own state (its shards, read in place) for the entries saved under ``key``. Every unit is
    released first (collective): a unit kept gathered (ZeRO-1's pinned one) would go on computing with, and later
    take back, parameters from before the load ([Note: writes between steps] in user_code/write_back.py)."""
    saved = {where[0]: md for where, md in _saved(index, key)}
    if engine is not None:
        engine.release_idle()  # the rows settled too: the target needs no second exchange
    target = model_state(module, engine, settle=False)
    files.check_against_module(path, key, saved, target, strict)
    return {k: v for k, v in target.items() if k in saved}


def load_sharded_entries(path: Path, index: Metadata, modules: Dict[str, tuple], optimizers: Dict[str, tuple],
                         strict: bool, weights_only: Optional[bool], extra: Optional[Dict[str, Any]] = None) -> None:
    """Fabric's sharded checkpoint: ``modules`` = {key: (module, engine)} read in place, ``optimizers`` =
    {key: (module, optimizer, engine)} loaded by name, each from the entries saved under its key (any saved
    layout: [Note: resharding]); ``extra``: more top-level entries, read in place. Collective over the world."""
    state: Dict[str, Any] = {k: _model_target(path, index, k, m, strict, e) for k, (m, e) in modules.items()}
    for key, (module, _, engine) in optimizers.items():
        state[key] = _optimizer_target(module, index, key, path, engine)
    state.update(extra or {})
    dcp.load(state, storage_reader=files.SafeReader(path),
             planner=files.LoadPlanner(weights_only=weights_only is not False))
    for key, (module, optimizer, engine) in optimizers.items():
        load_optimizer_by_name(module, optimizer, state[key], path, engine)


@torch.no_grad()
def load_optimizer_by_name(module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any],
                           path: Any = "checkpoint", engine: Optional[MiCSEngine] = None) -> None:
    """Loads a by-name optimizer state (tensors already in this rank's placement) into ``optimizer``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    position = {id(p): k for k, p in enumerate(params)}
    index_of = {n: position[id(p)] for n, p in _named(module, engine) if id(p) in position}
    saved_groups = state.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: the optimizer was saved with {len(saved_groups)} parameter groups; this one "
                              f"has {len(optimizer.param_groups)}.")
    groups, start = [], 0
    for k, (now, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        ids = list(range(start, start + len(now["params"])))
        if sorted(index_of.get(n, -1) for n in saved["params"]) != ids:
            raise CheckpointError(f"{path}: parameter group {k} was saved with parameters {list(saved['params'])[:6]}"
                                  "..., which are not the ones of this optimizer's group.")
        groups.append({**{h: v for h, v in saved.items() if h != "params"}, "params": ids})
        start += len(ids)
    by_index = {}
    for name, st in state.get("state", {}).items():
        if name not in index_of:
            raise CheckpointError(f"{path}: holds optimizer state for {name!r}, which this optimizer does not hold.")
        by_index[index_of[name]] = st
    optimizer.load_state_dict({"state": by_index, "param_groups": groups})


def save_sharded(checkpoint: Dict[str, Any], path: Path, token: str, *, coordinator: bool,
                 layout: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> None:
    """Writes ``checkpoint`` (Lightning's dict; its ``state_dict`` and ``optimizer_states`` by name, in shards) as
    a sharded checkpoint at ``path`` ([Note: checkpoint layout], [Note: crash-safe save]); ``extra``: more
    top-level entries (tensors) through DCP. Collective over the world; ``coordinator`` (global rank 0) writes
    Lightning's metadata and publishes."""
    state: Dict[str, Any] = {"state_dict": checkpoint.pop("state_dict"), **(extra or {})}
    optimizer_states = checkpoint.pop("optimizer_states", None)
    for i, osd in enumerate(optimizer_states or []):
        state[f"optimizer_{i}"] = osd
    meta = dict(checkpoint)
    meta[files.MARKER] = files.marker("sharded", optimizers=None if optimizer_states is None else len(optimizer_states),
                                      **layout)
    write_sharded(state, meta, path, token, coordinator=coordinator)


def write_sharded(state: Dict[str, Any], meta: Dict[str, Any], path: Path, token: str, *, coordinator: bool) -> None:
    """``state`` (tensors: DTensor shards or whole) through DCP and ``meta`` (the rest, with the marker) as
    ``meta.pt``, into a temporary directory published at ``path`` by the coordinator. Collective over the world."""
    tmp = files.temporary(path, token)
    if coordinator:
        files.prepare(path, token)
    tmp.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
             planner=DefaultSavePlanner())
    if coordinator:  # DCP has returned: every rank's shards are synced and .metadata is written
        part = tmp / (files.META_FILE + ".part")
        torch.save(meta, part)
        files.fsync_path(part)
        os.replace(part, tmp / files.META_FILE)
        files.publish(tmp, path, token)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


# -- consolidate ---------------------------------------------------------------------------------------------------
def _by_index(state: Dict[str, Any]) -> Dict[str, Any]:
    """A by-name optimizer state as ``optimizer.state_dict()`` of a plain run (state keyed by position)."""
    groups, index, start = [], {}, 0
    for g in state.get("param_groups", []):
        names = list(g["params"])
        index.update({n: start + k for k, n in enumerate(names)})
        groups.append({**g, "params": list(range(start, start + len(names)))})
        start += len(names)
    by_index = {index[n]: st for n, st in state.get("state", {}).items()}
    return {"state": dict(sorted(by_index.items())), "param_groups": groups}


def consolidate(path: Any) -> Dict[str, Any]:
    """A checkpoint written by MiCSStrategy as one plain dict: Lightning's usual full checkpoint, with a full
    ``state_dict`` (the module's own keys) and each optimizer's state as a plain run's ``state_dict()`` (from
    ``fabric.save``: the dict one plain process saves with Fabric).

    A sharded directory is read in this process, without a process group; a full file is returned as read. Both
    are read with ``weights_only=True`` (a checkpoint is untrusted input) and DCP's index with an allow-list
    unpickler. The result loads with ``torch.load(..., weights_only=True)`` once saved, into the plain module
    with ``strict=True``, and resumes under any strategy (``fit(ckpt_path=...)``). Raises ``CheckpointError``
    (a ``RuntimeError``) naming the path if the checkpoint is truncated, foreign or of another version.
    """
    path = files.resolve(Path(path))
    if path.is_file():
        return files.load_full(path, weights_only=True, lightning=False)
    meta, index = files.check_sharded(path, weights_only=True)
    state = files.empty_state(index)
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=files.SafeReader(path), planner=files.LoadPlanner(weights_only=True),
                     no_dist=True)
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be read: {type(err).__name__}: {err}") from err
    out = dict(meta)
    info = out.pop(files.MARKER)
    kept = beside.put_back(out, state, skip=())  # [Note: DTensors beside the model]: their full tensors
    if (fabric := info.get("fabric")) is not None:  # written by fabric.save: each module and optimizer by key
        out.update({k: state.get(k, {}) for k in fabric["modules"]})
        out.update({k: _by_index(state.get(k, {})) for k in fabric["optimizers"]})
        return out  # no marker: what one plain process saves with Fabric (as fabric.save's full format)
    out["state_dict"] = state.get("state_dict", {})
    if info.get("optimizers") is not None:
        out["optimizer_states"] = [_by_index(state.get(f"optimizer_{i}", {})) for i in range(info["optimizers"])]
    out[files.MARKER] = files.marker("full", consolidated_from={k: v for k, v in info.items() if k != "version"},
                                     beside=kept)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """``lightning-mics-consolidate DIR OUT.pt``: a sharded checkpoint as one full checkpoint file."""
    ap = argparse.ArgumentParser(prog="lightning-mics-consolidate",
                                 description="Turn a sharded MiCSStrategy checkpoint (a directory) into one full "
                                             "checkpoint file, without a process group.")
    ap.add_argument("checkpoint", help="the sharded checkpoint directory (a full checkpoint file is copied as is)")
    ap.add_argument("output", help="the full checkpoint file to write")
    args = ap.parse_args(argv)
    try:
        full = consolidate(args.checkpoint)
    except CheckpointError as err:
        print(f"lightning-mics-consolidate: {err}", file=sys.stderr)
        return 2
    out, token = Path(args.output), new_token()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = files.temporary(out, token)
    torch.save(full, tmp)
    files.fsync_path(tmp)
    files.publish(tmp, out, token)
    sd = full["state_dict"]
    nbytes = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, Tensor))
    print(f"{out}: {len(sd)} tensors in the state dict ({nbytes / 2**20:.2f} MiB), "
          f"{len(full.get('optimizer_states', []))} optimizer state(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
