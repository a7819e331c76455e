"""Lightning precision plugins that know gradients are sharded.

Two things change against Lightning's own plugins: clipping by norm reduces the norm over the shard group
(``clip.py``), and with ``16-mixed`` the loss scaler checks for inf/NaN across *all* ranks, so a step that
overflows on one rank's shard is skipped on every rank (``ShardedGradScaler``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision


class _OverShards:
    """Clipping by norm over the sharded gradients; the step's closure bracketed for the engine."""
    _mics_clip = None  # set by the strategy: callable(optimizer, max_norm)
    _mics_engine = None  # set by the strategy: the engine whose masters the optimizers step

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:  # type: ignore[override]
        self._mics_clip(optimizer, float(clip_val))

    # [Note: evaluations inside a step] in user_code/boundary.py: every step Lightning runs evaluates a closure (the training
    # step and its backward, then the hooks before the step and clipping: ``_after_closure``), inside the step
    def optimizer_step(self, optimizer, model, closure, **kwargs):  # type: ignore[override]
        with self._mics_engine.user_code.closure_step() if self._mics_engine is not None else nullcontext():
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    def _wrap_closure(self, model, optimizer, closure):  # type: ignore[override]
        if self._mics_engine is not None:
            self._mics_engine.user_code.evaluating()
        return super()._wrap_closure(model, optimizer, closure)

    def _after_closure(self, model, optimizer) -> None:  # type: ignore[override]
        super()._after_closure(model, optimizer)
        if self._mics_engine is not None:
            self._mics_engine.user_code.evaluated()


class MiCSPrecision(_OverShards, Precision):
    pass


class MiCSMixedPrecision(_OverShards, MixedPrecision):
    pass


class MiCSHalfPrecision(_OverShards, HalfPrecision):
    pass


def sharded_scaler(user: Optional[torch.amp.GradScaler], device: str) -> torch.amp.GradScaler:
    """A ``ShardedGradScaler`` (inf/NaN reduced over all ranks) with the settings of the scaler the user passed
    (init_scale, growth/backoff factors, growth interval, enabled), so that those settings act."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if user is None:
        return ShardedGradScaler(device=device)
    return ShardedGradScaler(device=device, init_scale=user._init_scale, growth_factor=user._growth_factor,
                             backoff_factor=user._backoff_factor, growth_interval=user._growth_interval,
                             enabled=user._enabled)


def to_mics_precision(plugin: Precision, device: torch.device) -> Precision:
    """Maps Lightning's generic plugin to ours; any other plugin is refused with a clear message."""
    if isinstance(plugin, _OverShards):
        return plugin
    if type(plugin) is Precision:
        return MiCSPrecision()
    if type(plugin) is MixedPrecision:
        scaler = sharded_scaler(plugin.scaler, device.type) if plugin.precision == "16-mixed" else None
        return MiCSMixedPrecision(plugin.precision, device.type, scaler=scaler)
    if type(plugin) is HalfPrecision:
        return MiCSHalfPrecision(plugin.precision)
    raise ValueError(
        f"Trainer precision plugin {type(plugin).__name__} (precision={getattr(plugin, 'precision', '?')!r}) is "
        "not supported by MiCSStrategy: allowed precision is '32-true', 'bf16-mixed', '16-mixed', 'bf16-true' "
        "or '16-true'."
    )


