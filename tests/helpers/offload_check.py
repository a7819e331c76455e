"""Activation offload replays the forward's dropout masks on any device ([Note: offload and the RNG] in
activations.py): ``offload_dropout_check(device)`` runs a small stack of blocks with ``Dropout(0.5)`` three ways,
plain, checkpointed in groups of 2 (``ActivationCheckpointing``, as the engine installs it) and checkpointed with
the groups' inputs offloaded, each from the same seeds for two forward/backward passes (the second's masks come from
the RNG state the first left), and compares the gradients and the RNG states after them (the CPU's and, on CUDA, the
device's) bit for bit. On CPU it is what the suite runs; on a GPU it is the check only a GPU can make:

    python -c "from tests.helpers.offload_check import offload_dropout_check as c; print(c('cuda'))"
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as Fn

from lightning_mics.engine.activations import ActivationCheckpointing, plan_groups
from lightning_mics.comm.telemetry import CommLog

D, BATCH, BLOCKS = 32, 16, 4


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.fc2(self.drop(Fn.gelu(self.fc1(x))))


class DropoutStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(DropoutBlock() for _ in range(BLOCKS))
        self.drop, self.head = nn.Dropout(0.5), nn.Linear(D, 1)  # a draw after the groups: shifted if they leak

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.drop(x))


def _rng(device: torch.device) -> List[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _run(device: torch.device, checkpointed: bool, offload: bool) -> Dict[str, object]:
    torch.manual_seed(0)
    model = DropoutStack().to(device)
    log = CommLog()
    ac = ActivationCheckpointing(plan_groups(model, [DropoutBlock], 2), offload, log) if checkpointed else None
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(2)  # the CPU's generator and every CUDA device's
    try:
        for _ in range(2):
            model(x).square().mean().backward()
    finally:
        if ac is not None:
            ac.remove()
    return {"grads": [p.grad.detach().cpu() for p in model.parameters()], "rng": [s.cpu() for s in _rng(device)],
            "offloaded_bytes": log.offloaded_bytes}


def offload_dropout_check(device="cpu") -> dict:
    """``{"device", "offloaded_bytes", "grads_equal_<case>", "rng_equal_<case>", "ok"}``: each case (``plain``,
    ``offloaded``) against the checkpointed run without offload; ``ok`` when all are equal and something was
    offloaded."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ref = _run(device, checkpointed=True, offload=False)
    out: Dict[str, object] = {"device": str(device)}
    for name, (ckpt, offload) in {"plain": (False, False), "offloaded": (True, True)}.items():
        run = _run(device, ckpt, offload)
        out[f"grads_equal_{name}"] = all(torch.equal(a, b) for a, b in zip(run["grads"], ref["grads"]))
        out[f"rng_equal_{name}"] = all(torch.equal(a, b) for a, b in zip(run["rng"], ref["rng"]))
        if offload:
            out["offloaded_bytes"] = run["offloaded_bytes"]
    out["ok"] = all(v for k, v in out.items() if k.startswith(("grads_equal", "rng_equal"))) and \
        out["offloaded_bytes"] > 0
    return out


if __name__ == "__main__":
    import sys
    print(offload_dropout_check(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
