"""The control of a ``bf16-mixed`` run: the plain strategy (DDP, one process) under MiCS's precision policy.

MiCS gathers bf16 copies of its fp32 masters (``param_dtype``), runs the forward on them under autocast, and reduces
their bf16 gradients in fp32 (``reduce_dtype``), as FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``. DDP under ``bf16-mixed`` runs autocast alone, which casts only some ops' weights (a
LayerNorm's and an embedding's stay fp32): a bf16 run then ends 1e-3 to 1e-2 from DDP's for the forward's rounding
alone, too loose a control to see a defect in. Under this policy it ends where DDP ends, bit for bit or within the
summation order.
"""

from __future__ import annotations

import lightning as L
import torch


def on_bf16_copies(module, args, kwargs=None, cast=None):
    """``module(*args, **kwargs)`` under MiCS's bf16-mixed policy: under autocast, on bf16 copies of its parameters
    named in ``cast`` (all of them by default; MiCS casts the ones it gathers). Each call makes its own copies, so
    their gradients reach the fp32 parameters cast to fp32 and are summed there."""
    copies = {n: p.to(torch.bfloat16) for n, p in module.named_parameters() if cast is None or n in cast}
    with torch.autocast(next(module.parameters()).device.type, dtype=torch.bfloat16):
        return torch.func.functional_call(module, copies, args, kwargs or {})


class Bf16Copies(L.Callback):
    """A Trainer callback for the control run: inside the precision's autocast (Lightning's step contexts) the
    module's ``forward`` runs on bf16 copies of its fp32 parameters (``torch.func.functional_call``), whose gradients
    autograd casts back to fp32 before DDP's fp32 all-reduce; outside it (a callback) on the fp32 parameters, as DDP.

    What it does not cover, so the tests that use it avoid it:
    - reads that do not pass the module's ``forward`` (a submodule called directly from ``training_step``, a GAN's
      two towers) read the fp32 parameters, autocast's alone;
    - a ``torch.utils.checkpoint`` inside the forward recomputes on the fp32 parameters, which checkpoint's metadata
      check refuses;
    - every parameter is cast: the control of a MiCS run that gathers every parameter
      (``param_persistence_threshold=0``, or ZeRO-1's one unit). Parameters MiCS keeps replicated stay fp32 there,
      as under autocast alone (with all of them replicated, Rprop's run equals DDP under autocast bit for bit and
      ends 0.041 from this control);
    - a parameter a pass reads twice: MiCS (as FSDP2) lends one bf16 copy per gather, and autograd sums the two
      gradients in bf16, where copies made per read here are summed in fp32 (a GAN's critic read on the real and the
      fake batch ends 4.9e-3 away after 2 epochs of SGD with momentum, 0.0 once it reads both in one call)."""

    def setup(self, trainer, pl_module, stage):
        forward, inside = type(pl_module).forward, []

        def on_copies(*args, **kwargs):
            if inside or not torch.is_autocast_enabled(pl_module.device.type):  # functional_call's own call
                return forward(pl_module, *args, **kwargs)
            inside.append(True)
            try:
                return on_bf16_copies(pl_module, args, kwargs)
            finally:
                inside.pop()
        pl_module.forward = on_copies

    def teardown(self, trainer, pl_module, stage):
        pl_module.__dict__.pop("forward", None)
