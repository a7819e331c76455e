"""Error-feedback residuals in sharded checkpoints: what is saved, and when a load may take it back.

[Note: residuals in checkpoints]
With ``quantize_gradients="error_feedback"`` every rank keeps, per gradient bucket, the rounding error of its last
quantized contribution and of its reduced chunk ([Note: error feedback] in quantized.py). They are this rank's
own: laid out like its shard of the bucket, and different on every replica. A sharded checkpoint holds them under
``KEY``::

    {KEY: {<module key>: {"rank<k>": {"u<unit>_<slots>": {"contribution": tensor, "reduced": tensor}}}}}

each rank writing only its own keys (so DCP writes each once), and the layout that made them (``layouts``: world
size, s, t, bucket size, block size, reduce dtype, units) in the checkpoint's marker. A load into the same layout
takes them back, so a resumed run is the uninterrupted one. A load into another layout, from a full checkpoint
(which holds what one plain process has: nothing per rank) or from a checkpoint saved without error feedback
starts them from zero with a warning. That costs the rounding error of one quantization once, within the bound of
[Note: error feedback]; it does not accumulate.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Optional, Tuple

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mics.comm import quantized
from lightning_mics.checkpoint.files import empty_entries_under
from lightning_mics.engine.engine import MiCSEngine

KEY = "mics_error_feedback"
Engines = Dict[str, Optional[MiCSEngine]]  # a checkpoint's modules by their key ("model" under the Trainer)


def layouts(engines: Engines) -> Dict[str, Optional[Dict[str, Any]]]:
    """For the checkpoint's marker: per module key, what its residuals depend on (None: it keeps none)."""
    return {k: _layout(e) for k, e in engines.items()}


def entries(engines: Engines, rank: int) -> Dict[str, Any]:
    """This rank's residuals (the tensors themselves) as top-level entries of a sharded save; {} if none."""
    mine = {k: st for k, e in engines.items() if (st := _state(e, rank))}
    return {KEY: mine} if mine else {}


def targets(index: Metadata, engines: Engines, saved: Dict[str, Any], rank: int, where: Any) -> Dict[str, Any]:
    """Top-level entries of empty tensors to read this rank's residuals into (``restore`` takes them back after
    the load); {} if there are none to take. ``saved``: the marker's ``layouts``. A module that keeps residuals
    the checkpoint cannot give back is warned about once (see the note)."""
    found = {}
    for key, engine in engines.items():
        target = _targets(index, key, engine, (saved or {}).get(key), rank, where)
        if target is not None:
            found[key] = target
    return {KEY: found} if found else {}


def restore(engines: Engines, loaded: Dict[str, Any]) -> None:
    """Takes back what ``targets`` read, once the load has filled it."""
    for key, residuals in loaded.get(KEY, {}).items():
        _restore(engines[key], residuals)


def warn_full(engines: Engines, where: Any) -> None:
    """A full checkpoint loaded into modules that keep residuals: they restart from zero."""
    if any(_layout(e) is not None for e in engines.values()):
        _restart(where, "a full checkpoint holds only what one plain process has (state_dict_type='sharded' "
                        "carries them)")


def _layout(engine: Optional[MiCSEngine]) -> Optional[Dict[str, Any]]:
    if engine is None or engine.options.quantize_gradients != "error_feedback":
        return None
    lay, o = engine.topo.layout, engine.options
    out = {"world_size": lay.world_size, "shard_size": lay.shard_size, "tp_size": lay.tp_size,
           "bucket_size": o.reduce_bucket_size, "block_size": o.quantization_block_size,
           "reduce_dtype": str(o.reduce_dtype), "units": len(engine.units)}
    if any(u.optimizer_rows is not None for u in engine.units):  # [Note: quantized optimizer rows]
        out["optimizer_rows"] = True
    return out


def _state(engine: Optional[MiCSEngine], rank: int) -> Dict[str, Any]:
    if _layout(engine) is None:
        return {}
    mine = {f"u{i}_{'-'.join(map(str, slots))}": {"contribution": res.contribution, "reduced": res.reduced}
            for i, g in enumerate(engine.grads.all) for slots, res in g.residual_state().items()}
    return {f"rank{rank}": mine} if mine else {}


def _targets(index: Metadata, key: str, engine: Optional[MiCSEngine], saved: Optional[Dict[str, Any]], rank: int,
             where: Any) -> Optional[Dict[str, Any]]:
    want = _layout(engine)
    if want is None:
        return None
    if saved != want:
        why = ("it was saved without quantize_gradients='error_feedback'" if saved is None
               else f"they were made in another layout ({_diff(saved, want)})")
        _restart(where, why)
        return None
    return empty_entries_under(index, (KEY, key, f"rank{rank}"), engine.device)


def _restore(engine: MiCSEngine, loaded: Dict[str, Any]) -> None:
    by_unit: Dict[int, Dict[Tuple[int, ...], quantized.Residual]] = defaultdict(dict)
    for name, parts in (item for mine in loaded.values() for item in mine.items()):
        unit, slots = name[1:].split("_", 1)
        by_unit[int(unit)][tuple(int(i) for i in slots.split("-"))] = quantized.Residual(parts["contribution"],
                                                                                 parts["reduced"])
    for i, g in enumerate(engine.grads.all):  # every size checked before any is taken
        for slots, res in by_unit.get(i, {}).items():
            n = g.residual_numel(slots) if max(slots) < len(g.params) else -1
            if res.contribution.numel() != n:
                raise ValueError(f"an error-feedback residual of {res.contribution.numel()} elements was saved for "
                                 f"parameters {list(slots)[:6]} of unit {i} ({type(g.unit.module).__name__}), whose "
                                 f"shards hold {n} elements here: the checkpoint is of another model")
    for i, g in enumerate(engine.grads.all):
        g.restore_residuals(by_unit.get(i, {}))


def _restart(where: Any, why: str) -> None:
    rank_zero_warn(f"MiCSStrategy(quantize_gradients='error_feedback'): {where} gives no error-feedback residuals "
                   f"for this run: {why}. They start from zero: the next step carries one quantization's rounding "
                   "error, once ([Note: residuals in checkpoints] in lightning_mics/checkpoint/feedback.py).")


def _diff(saved: Dict[str, Any], want: Dict[str, Any]) -> str:
    return ", ".join(f"{k} {saved.get(k)} -> {want.get(k)}" for k in sorted(set(saved) | set(want))
                     if saved.get(k) != want.get(k))
