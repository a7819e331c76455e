"""Lightning's ``WeightAveraging`` callbacks (EMA, SWA) over the shards.

[Note: weight averaging over the shards]
``WeightAveraging.setup`` wraps a deep copy of the LightningModule, made before sharding, in torch's
``AveragedModel`` and after every optimizer step averages ``pl_module.parameters()`` into it in order. Those are
DTensor shards (ZeRO-1's pinned unit: plain copies), so the plain copy would fail at its first update (DTensor's
mixed-tensor error) and hold the whole model on every rank. Once the module is sharded the strategy swaps in an
``AveragedModel`` of a *shadow*: a module of the LightningModule's own names (submodules in order, parameters and
buffers registered as in the original, tied ones tied) holding clones of its parameters as they are between
steps. Each rank averages its own shards with the callback's ``avg_fn`` / ``multi_avg_fn`` and holds 1/s of the
average; the rest is the callback's code. Validation's swap of average and parameters (``.data.copy_``, and back)
is a write between steps ([Note: writes between steps] in user_code/write_back.py, [Note: rows between steps] in
optimizer_rows.py); the end of fit copies the average into the parameters. Under ZeRO-1 with mixed precision the
parameters between steps are ``param_dtype`` copies of the fp32 masters (DDP's are fp32), so that swap would round
the average at every validation: refused at setup, with a ``ValueError`` on every rank.

[Note: averages in checkpoints]
``on_save_checkpoint`` puts the shadow's state dict (the module's keys, DTensors of the module's placements) in
``state_dict``, which the sharded save writes as the model's, and the module's own in ``current_model_state``
([Note: DTensors beside the model] in checkpoint/beside.py); the full format gathers both. ``on_load_checkpoint``
copies ``state_dict`` into the shadow and ``current_model_state`` into the module with ``load_state_dict``: a load
pre-hook on both puts each entry in the layout of the tensor it goes into (a full file's tensors sliced, the
checkpoint's DTensors redistributed to the optimizer's rows, gathered for ZeRO-1's plain copies); loads that place
tensors (``assign=True``: the engine's own full load) pass untouched.

[Note: SWA over the shards]
``StochasticWeightAveraging`` (Lightning's older callback, refused by Lightning under FSDP) deep-copies the whole
LightningModule at setup and averages ``parameters()`` into the copy's, in order, once per epoch. Its copy is
swapped for a shadow as in [Note: weight averaging over the shards], its state dict (the module's keys, DTensors of
the module's placements) kept in the callback's checkpoint state ([Note: DTensors beside the model] in
checkpoint/beside.py). The rest is its code: the ``SWALR`` schedule put in place of the user's, the average copied
into the parameters (writes between steps) and, for a model with batch norm, the extra epoch of forwards without
backward that recomputes the running statistics, whose closing step reuses the last gradients
([Note: evaluations inside a step] in user_code/boundary.py). ZeRO-1 with mixed precision is refused as for
``WeightAveraging``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

import torch.nn as nn
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from torch.optim.swa_utils import AveragedModel

from lightning_mics.checkpoint import beside as beside

if TYPE_CHECKING:
    import lightning.pytorch as pl


def averaging_callbacks(trainer: "pl.Trainer") -> List[WeightAveraging]:
    return [cb for cb in trainer.callbacks if isinstance(cb, WeightAveraging)]


def _swa_callbacks(trainer: "pl.Trainer") -> List[StochasticWeightAveraging]:
    return [cb for cb in trainer.callbacks if isinstance(cb, StochasticWeightAveraging)]


def shadow(module: nn.Module) -> nn.Module:
    """A module of ``module``'s names holding detached clones of its parameters and buffers (no gradient): the same
    submodule order, so ``parameters()`` and ``buffers()`` come in the same order, tied parameters tied, buffers as
    persistent as they were."""
    copies: Dict[str, nn.Module] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if name in copies:
            continue
        copies[name] = nn.Module()
        if name:
            parent, _, leaf = name.rpartition(".")
            copies[parent].add_module(leaf, copies[name])
    clones: Dict[int, nn.Parameter] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        target = copies[name]
        for leaf, p in sub._parameters.items():
            if p is not None and leaf not in target._parameters:
                if id(p) not in clones:
                    clones[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=False)
                target.register_parameter(leaf, clones[id(p)])
        for leaf, b in sub._buffers.items():
            if b is not None and leaf not in target._buffers:
                target.register_buffer(leaf, b.detach().clone(), persistent=leaf not in sub._non_persistent_buffers_set)
    return copies[""]


def shard_averages(trainer: "pl.Trainer", module: nn.Module, units: List[Any]) -> List[Any]:
    """Replaces each ``WeightAveraging`` callback's plain ``AveragedModel`` by one over a shadow of the sharded
    module (the callback's averaging function and ``use_buffers`` kept; its ``device`` applied to the plain copy it
    made before sharding only: the average's shards live beside the module's), and each ``StochasticWeightAveraging``
    callback's copy by a shadow. Returns the hooks to remove when the
    fit ends. Refuses, on every rank alike, a unit kept gathered in a lower dtype than its masters (ZeRO-1 under
    mixed precision): the callback swaps the average in and out through those copies, which would round it."""
    lower = sorted({str(u.param_dtype) for u in units if u.pinned and u.param_dtype != u.dtype})
    averaging = averaging_callbacks(trainer) + _swa_callbacks(trainer)
    if averaging and lower:
        raise ValueError(f"MiCSStrategy: {type(averaging[0]).__name__} with the optimizer-state-"
                         f"only layout (sharded_data_parallel_degree=1, shard_optimizer_state=True) under a precision "
                         f"whose parameters between steps are {lower[0]} copies of the fp32 masters: the callback "
                         "swaps the average in and out through them and would round it. Allowed: a '-true' "
                         "precision ('32-true', 'bf16-true'), or sharded_data_parallel_degree > 1.")
    hooks = []
    for cb in averaging_callbacks(trainer):
        if cb._average_model is None:
            continue
        device = cb._average_model.n_averaged.device
        cb._average_model = None  # the plain copy: freed before the shadow is made
        average = AveragedModel(nn.Module(), device=device, use_buffers=cb._use_buffers, **cb._kwargs)
        average.module = shadow(module)
        average.register_load_state_dict_pre_hook(_in_layout)
        cb._average_model = average
    for cb in _swa_callbacks(trainer):
        cb._average_model = None  # its deep copy of the LightningModule: freed before the shadow is made
        cb._average_model = shadow(module)
        cb._average_model.register_load_state_dict_pre_hook(_in_layout)
    if any(cb._average_model is not None for cb in averaging):
        hooks.append(module.register_load_state_dict_pre_hook(_in_layout))
    return hooks


def _in_layout(module: nn.Module, state_dict: Dict, prefix: str, local_metadata: Dict, *args: Any) -> None:
    """``load_state_dict`` of the average or of the module (the callback's ``on_load_checkpoint``) with the state
    in another layout than the tensors it goes into: full tensors (a full checkpoint) sliced, DTensors of the
    checkpoint's placements redistributed (the module's might be the optimizer's rows, or ZeRO-1's plain copies,
    by the time the callback loads), a DTensor into a plain tensor gathered ([Note: DTensors beside the model]).
    A state in the tensors' own layout passes as it is."""
    if local_metadata.get("assign_to_params_buffers"):  # the engine's own full load (full_state.py) places them
        return
    own = module.state_dict(prefix=prefix, keep_vars=True)
    for k in [k for k in state_dict if k in own]:
        state_dict[k] = beside.like(own[k], state_dict[k])
