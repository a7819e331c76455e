"""Sharded initialization: a model built on the meta device becomes shards without ever being whole.

[Note: sharded initialization]
A model created under ``trainer.init_module(empty_init=True)`` or on the meta device in ``configure_model`` has
shapes and no storage. The units allocate their flat shards (and replicated parameters) on the device; then, as
Lightning's FSDP strategy does, modules are initialized one at a time in module order: each module holding meta
parameters or buffers gets fresh full tensors for just its own, runs its ``reset_parameters()``, and its sharded
parameters keep this rank's rows. So a rank holds its shards plus one module's parameters, and draws the random
numbers in the order construction on a real device with the same seed would: the values equal non-sharded
initialization whenever the model's initialization is its modules' ``reset_parameters`` (nn.Linear, nn.Embedding,
nn.LayerNorm, ...). A tied parameter ends as the later module's ``reset_parameters`` leaves it, where construction
keeps what the tie assigned last. Initialization written elsewhere (``self.apply(init_fn)`` in a parent's
``__init__``) never runs on meta tensors: put it in ``reset_parameters``. A module with meta tensors and no
``reset_parameters``, or whose ``reset_parameters`` leaves one unwritten (the fresh tensors start as NaN), is refused.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from lightning_mics.layout.placement import ShardedParam


def has_meta(root: nn.Module) -> bool:
    return any(t.is_meta for t in (*root.parameters(), *root.buffers()))


@torch.no_grad()
def materialize(root: nn.Module, slots: Dict[Tuple[int, str], object], device: torch.device) -> None:
    """Initializes every meta parameter's shard and every meta buffer ([Note: sharded initialization]).

    ``slots`` maps (id(module), attribute) to the ShardedParam / ReplicatedParam holding that parameter; its
    storage is already allocated, the modules hold the DTensor parameters."""
    for name, module in root.named_modules():
        params = [(attr, slots[(id(module), attr)]) for attr, p in module._parameters.items()
                  if p is not None and (id(module), attr) in slots and getattr(slots[(id(module), attr)], "meta", False)]
        buffers = [attr for attr, b in module._buffers.items() if b is not None and b.is_meta]
        if not params and not buffers:
            continue
        reset = getattr(module, "reset_parameters", None)
        what = [a for a, _ in params] + buffers
        if not callable(reset):
            raise ValueError(
                f"MiCSStrategy: module {name or '<root>'} ({type(module).__name__}) has tensors on the meta device "
                f"({what}) and no reset_parameters() to initialize them. Give it one (sharded initialization "
                "calls reset_parameters() module by module), or create the model on a real device.")
        held: List[Tuple[str, object, torch.Tensor]] = []
        for attr, slot in params:
            full = torch.full(slot.shape, float("nan"), dtype=slot.local.dtype, device=device) \
                if isinstance(slot, ShardedParam) else slot.local.fill_(float("nan"))
            module._parameters[attr] = nn.Parameter(full, requires_grad=slot.requires_grad)
            held.append((attr, slot, full))
        for attr in buffers:
            b = module._buffers[attr]
            module._buffers[attr] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=device) \
                if b.is_floating_point() else torch.zeros(b.shape, dtype=b.dtype, device=device)
        reset()
        for attr, slot, full in held:
            written = module._parameters[attr]
            if written is not None and written is not full and written.data_ptr() != full.data_ptr():
                full = written.detach()  # reset_parameters assigned a new tensor
            if torch.isnan(full).any():
                raise ValueError(
                    f"MiCSStrategy: {name or '<root>'}.reset_parameters() ({type(module).__name__}) left parameter "
                    f"{attr!r} uninitialized; sharded initialization needs it to write every meta tensor.")
            if isinstance(slot, ShardedParam):
                slot.copy_rows_from_full(full)
            elif full.data_ptr() != slot.local.data_ptr():
                slot.local.copy_(full)
            module._parameters[attr] = slot.sharded
        for attr in buffers:
            b = module._buffers[attr]
            if b.is_floating_point() and torch.isnan(b).any():
                raise ValueError(
                    f"MiCSStrategy: {name or '<root>'}.reset_parameters() ({type(module).__name__}) left buffer "
                    f"{attr!r} uninitialized; sharded initialization needs it to write every meta tensor.")
    for slot in {id(s): s for s in slots.values()}.values():
        slot.meta = False

