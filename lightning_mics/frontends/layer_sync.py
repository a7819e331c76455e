"""Lightning's layer sync (``Trainer(sync_batchnorm=True)``, or a ``LayerSync`` plugin) over a sharded module.

[Note: layer sync]
Lightning hands a parallel strategy its ``LayerSync`` in ``strategy._layer_sync``; DDP and FSDP apply it when a fit
sets up (``BatchNorm`` -> ``SyncBatchNorm``: batch statistics over every data-parallel rank) and revert it at the
fit's teardown. Under MiCS the swap must come before the engine shards the module: each unit holds the module of
every parameter it gathers into (``sharding.ParamRef``), so a layer swapped afterwards is one the engine never fills.
- A plain module is converted, then sharded; the fit's teardown reverts it once the module is plain again
  ([Note: after fit] in frontends/shared.py), as DDP's does.
- A module a previous fit left sharded (larger than ``max_live_parameters``) cannot have its layers swapped: it keeps
  the layers that fit left it, converted if that fit synced them (remembered here), which a next fit syncing layers
  continues with; a fit asked to sync layers it holds unconverted is refused.
- torch's ``SyncBatchNorm`` computes on cuda, xpu and hpu tensors only (DDP refuses it on CPU too): on another
  device the fit is refused at setup, naming the option.
Each check reads only the module and the device, alike on every rank, before the engine's first collective: the
ranks refuse together.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm

# modules converted by a layer sync and not reverted yet (left sharded by their fit)
_CONVERTED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _sync_batchnorm_devices() -> tuple:
    """The device types torch's SyncBatchNorm forward accepts (``nn.SyncBatchNorm.forward``'s own list)."""
    return ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def _would_convert(layer_sync: LayerSync, module: nn.Module) -> bool:
    if isinstance(layer_sync, TorchSyncBatchNorm):
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
                   for m in module.modules())
    return True  # another plugin's apply cannot be read: assume it swaps layers


def apply(layer_sync: LayerSync, module: nn.Module, sharded: bool, device: torch.device) -> nn.Module:
    """The module with its layers synced for a fit ([Note: layer sync]); ``sharded``: a previous fit left it so."""
    if sharded:
        if module not in _CONVERTED and _would_convert(layer_sync, module):
            raise ValueError(
                f"MiCSStrategy: {_named(layer_sync)} cannot swap the layers of a module a previous fit left sharded "
                "(larger than max_live_parameters) without syncing them: the engine holds its layers. Allowed: "
                "the same layer sync in both fits, a module that fits max_live_parameters (plain again after "
                "each fit), or the layers converted before the first fit.")
    else:
        module = layer_sync.apply(module)
        _CONVERTED.add(module)
    if device.type not in _sync_batchnorm_devices() \
            and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        if not sharded:  # the user's module as it came
            revert(layer_sync, module)
        raise ValueError(
            f"MiCSStrategy: {_named(layer_sync)} made the model's BatchNorm layers torch's SyncBatchNorm, which "
            f"computes on {', '.join(_sync_batchnorm_devices()[:3])} devices only, not on {device.type} (DDP "
            f"refuses it on CPU as well). Allowed on {device.type}: sync_batchnorm=False (each rank normalizes "
            "with its own batch's statistics), or a LayerSync plugin whose layers compute there.")
    return module


def revert(layer_sync: LayerSync, module: nn.Module) -> nn.Module:
    """The module with the layers ``apply`` swapped put back; a module it did not convert is returned as is. Only for
    a plain module."""
    if module not in _CONVERTED:
        return module
    _CONVERTED.discard(module)
    return layer_sync.revert(module)


def _named(layer_sync: LayerSync) -> str:
    if type(layer_sync) is TorchSyncBatchNorm:
        return "Trainer(sync_batchnorm=True)"
    return f"the layer sync plugin {type(layer_sync).__name__}"
