"""The Trainer strategy's checkpoint handling, as functions of the strategy (as Lightning keeps its DCP helpers
beside ``FSDPStrategy``). ``frontends/trainer.py`` overrides Lightning's hooks with one-line calls to these.

[Note: checkpoint state]
``lightning_module_state_dict()`` is the full state dict on rank 0 whatever ``state_dict_type`` is (DESIGN's
public contract). A checkpoint takes its model state from ``checkpoint_model_state`` instead: ``route`` points
Lightning's checkpoint connector at it, so with "sharded" a save gathers nothing (the DTensor shards themselves go
to DCP) and with "full" it is ``lightning_module_state_dict()``. ``optimizer_state()`` follows
``state_dict_type``, as in Lightning's ModelParallelStrategy: by parameter name with the shards, or full.
Loading reads either format whatever ``state_dict_type`` is; see checkpoint/state.py and checkpoint/files.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mics.checkpoint import state as ckpt
from lightning_mics.checkpoint import beside as beside
from lightning_mics.checkpoint import files as files
from lightning_mics.checkpoint import steps as steps
from lightning_mics.checkpoint import feedback as feedback
from lightning_mics.checkpoint import diloco as diloco
from lightning_mics.frontends.shared import unwrap

if TYPE_CHECKING:
    import lightning.pytorch as pl

Strategy = Any  # lightning_mics.frontends.trainer.MiCSStrategy (not imported: that module imports this one)


def route(strategy: Strategy, trainer: "pl.Trainer") -> None:
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is not None and hasattr(connector, "_get_lightning_module_state_dict"):
        connector._get_lightning_module_state_dict = strategy._checkpoint_model_state


def checkpoint_model_state(strategy: Strategy) -> Dict[str, Any]:
    if strategy.options.state_dict_type == "sharded":
        return ckpt.model_state(strategy.lightning_module, strategy._live_engine())
    return strategy.lightning_module_state_dict()


def load_model_state_dict(strategy: Strategy, checkpoint: Mapping[str, Any], strict: bool) -> None:
    if steps.checkpoint_format(checkpoint) == "sharded":  # read in place by load_checkpoint; this applies edits
        ckpt.apply_model_state(strategy.lightning_module, checkpoint["state_dict"], strategy._live_engine(), strict)
        diloco.restore_model({"model": strategy._live_engine()}, checkpoint.get(diloco.KEY + "_loaded"))
        return
    engine = strategy._live_engine()
    if engine is None:
        return ParallelStrategy.load_model_state_dict(strategy, checkpoint, strict)
    engine.load_full_state_dict(checkpoint["state_dict"], strict=strict)


def optimizer_state(strategy: Strategy, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    optimizer = unwrap(optimizer)
    if strategy.options.state_dict_type == "sharded":
        return ckpt.optimizer_state_by_name(strategy.lightning_module, optimizer, strategy._live_engine())
    engine = strategy._engine
    if engine is None or not any(id(p) in {id(q) for q in engine.sharded_params()}
                                 for g in optimizer.param_groups for p in g["params"]):
        # after fit the optimizer is plain again: full on rank 0, {} elsewhere (as the sharded case)
        return ParallelStrategy.optimizer_state(strategy, optimizer) if strategy.global_rank == 0 else {}
    return ckpt.full_optimizer_state(engine, optimizer, dst=0)


def load_optimizer_state_dict(strategy: Strategy, checkpoint: Mapping[str, Any]) -> None:
    optimizers = [unwrap(o) for o in strategy.optimizers]
    engine = strategy._live_engine()
    if steps.checkpoint_format(checkpoint) == "sharded":
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            ckpt.load_optimizer_by_name(strategy.lightning_module, optimizer, state, strategy._loaded_from, engine)
        diloco.restore_optimizers({"model": engine}, {"model": optimizers})  # [Note: DiLoCo in checkpoints]
        return
    if engine is None:
        return ParallelStrategy.load_optimizer_state_dict(strategy, checkpoint)
    for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
        ckpt.load_full_optimizer_state(engine, optimizer, state)


def save_checkpoint(strategy: Strategy, checkpoint: Dict[str, Any], filepath: Any,
                    storage_options: Optional[Any]) -> None:
    """"sharded": every rank writes its shards into a directory through DCP; "full": rank 0 writes one file.
    Either is written under a temporary name and published by one rename ([Note: crash-safe save] in
    checkpoint/files.py)."""
    path, token = steps.path_and_token(filepath)
    if strategy.options.state_dict_type == "sharded":
        steps.refuse_remote_sharded(path, storage_options)
        checkpoint["state_dict"] = _as_sharded_state(strategy, checkpoint.get("state_dict"))
        engines = {"model": strategy._live_engine()}  # [Note: residuals in checkpoints]
        optimizers = {"model": [unwrap(o) for o in strategy.optimizers]}  # [Note: DiLoCo in checkpoints]
        layout = {"world_size": strategy.world_size, "shard_size": strategy._shard_size,
                  "error_feedback": feedback.layouts(engines), "diloco": diloco.layouts(engines, optimizers)}
        ckpt.save_sharded(checkpoint, Path(path), token, coordinator=strategy.is_global_zero, layout=layout,
                          extra={**feedback.entries(engines, strategy.global_rank), **beside.take(checkpoint),
                                 **diloco.entries(engines, optimizers, strategy.global_rank)})
        return
    # [Note: DTensors beside the model] in checkpoint/beside.py; a DTensor in state_dict (WeightAveraging's average)
    # is gathered too, but loads as the full state dict it then is: only the others are sliced back
    kept = [r for r in beside.gather_full(checkpoint, skip=("optimizer_states",)) if r["where"][0] != "state_dict"]
    checkpoint[files.MARKER] = files.marker("full", beside=kept)
    io = strategy.checkpoint_io
    steps.write_full(checkpoint, path, token, io, storage_options, strategy.is_global_zero)


def _as_sharded_state(strategy: Strategy, state_dict: Any) -> Dict[str, Any]:
    """The state dict Lightning's dump handed over, as the ``on_save_checkpoint`` hooks left it, for a sharded save,
    as DDP saves it: an entry of the module's in the module's sharded layout (``checkpoint_model_state``'s shards,
    or ``WeightAveraging``'s average in their place: under ZeRO-1 plain copies, sliced here;
    [Note: averages in checkpoints] in weight_averaging.py); an entry a hook removed stays out (a finetuning
    run saving its trainable weights only) and one it added is saved as given. DCP needs the same names on every rank
    (the hooks run on every rank); if the ranks disagree (a hook that edited on rank 0 alone), the module's shards are
    saved instead, with a warning. Collective."""
    own = ckpt.model_state(strategy.lightning_module, strategy._live_engine())
    names = hashlib.sha1("\n".join(sorted(map(str, state_dict))).encode()).hexdigest() \
        if isinstance(state_dict, Mapping) else None
    if not steps.same_on_every_rank(names) or names is None:
        if names is not None:
            rank_zero_warn("MiCSStrategy: the checkpoint's state_dict holds other names on some ranks than on rank "
                           "0 (an on_save_checkpoint hook that edits it on one rank only); the module's shards are "
                           "saved instead of the edited dict.")
        return own
    return {k: beside.like(own[k], v) if k in own else v for k, v in state_dict.items()}


def load_checkpoint(strategy: Strategy, checkpoint_path: Any, weights_only: Optional[bool]) -> Dict[str, Any]:
    """A sharded directory (read into this rank's shards from any saved layout: [Note: resharding] in
    checkpoint/state.py) or a full file. Every rank checks the files first, and all agree on the verdict before any
    collective touches the checkpoint ([Note: checks before collectives] in checkpoint/files.py)."""
    io = strategy.checkpoint_io
    path, full, meta, index = steps.read_checked(
        checkpoint_path, weights_only, loader=lambda p: io.load_checkpoint(p, weights_only=weights_only),
        check=lambda p, m: _check_optimizer_count(strategy, p, m))
    strategy._loaded_from = str(path)
    engine = strategy._live_engine()
    engines = {"model": engine}
    if full is not None:
        feedback.warn_full(engines, path)
        diloco.forget(engines, path)
        beside.slice_back(full, (full.get(files.MARKER) or {}).get("beside") or [], strategy.topology.mesh)
        return full
    assert meta is not None and index is not None
    optimizers = _optimizers_to_restore(strategy, meta)
    module = strategy.lightning_module
    residuals = feedback.targets(index, engines, meta[files.MARKER].get("error_feedback"), strategy.global_rank,
                                 path)
    kept = beside.targets(meta, strategy.topology.mesh)
    outer = diloco.targets(index, engines, {"model": [unwrap(o) for o in strategy.optimizers]},
                           meta[files.MARKER].get("diloco"), strategy.global_rank, path)
    state = ckpt.load_sharded(path, index, module, optimizers, strict=module.strict_loading,
                              weights_only=weights_only, engine=engine, extra={**residuals, **kept, **outer})
    feedback.restore(engines, residuals)
    beside.put_back(meta, kept)
    meta["state_dict"] = state["state_dict"]
    meta[diloco.KEY + "_loaded"] = state.get(diloco.KEY) and {diloco.KEY: state[diloco.KEY]}  # for load_model_state_dict
    if meta[files.MARKER].get("optimizers") is not None:
        meta["optimizer_states"] = [state[f"optimizer_{i}"] for i in range(len(optimizers))]
    return meta


def _optimizers_to_restore(strategy: Strategy, meta: Mapping[str, Any]) -> List[torch.optim.Optimizer]:
    trainer = strategy.lightning_module._trainer
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    if not fitting or meta[files.MARKER].get("optimizers") is None:
        return []
    return [unwrap(o) for o in strategy.optimizers]


def _check_optimizer_count(strategy: Strategy, path: Path, meta: Mapping[str, Any]) -> Optional[str]:
    saved = meta[files.MARKER].get("optimizers")
    wanted = len(_optimizers_to_restore(strategy, meta))
    if saved is not None and wanted and wanted != saved:
        return f"{path}: holds the state of {saved} optimizer(s); configure_optimizers returned {wanted}."
    return None


def remove_checkpoint(strategy: Strategy, filepath: Any) -> None:
    """Rank 0 removes a checkpoint file or directory (and the temporaries of dead saves to it)."""
    if not strategy.is_global_zero:
        return
    if "://" in str(filepath):
        return ParallelStrategy.remove_checkpoint(strategy, filepath)
    files.remove(Path(filepath))
