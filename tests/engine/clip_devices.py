"""One rank of tests/engine/test_clip_devices.py: ``clip_grad_norm_`` (clip.py) on a (replicate 2, shard 2) gloo mesh of 4
ranks, called directly on DTensor parameters laid out as the engine lays them out (a sharded one, Shard(0) over the
shard dimension, and a replicated one), in three cases: every rank holds its gradients; the ranks of shard 1 hold
none at all; no rank holds any. A dispatch mode records the device of every tensor the collectives reduce."""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_mics.frontends.clip import clip_grad_norm_  # noqa: E402

MAX_NORM = 0.5


class Reduced(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.devices = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "reduce" in func._schema.name:
            ts = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.devices += [t.device.type for t in ts if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def _dt(t, mesh, placement, shape):
    """A DTensor from this rank's local tensor, without a collective (a rank may build one its peers do not)."""
    return DTensor.from_local(t.clone(), mesh, [Replicate(), placement], run_check=False, shape=shape,
                              stride=torch.empty(shape).stride())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard = mesh.get_local_rank(1)
    g = torch.Generator().manual_seed(0)
    w_full, w_grad = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    b_full, b_grad = torch.randn(5, generator=g), torch.randn(5, generator=g)
    out = {}
    for case in ("all", "shard1_none", "none"):
        w = torch.nn.Parameter(_dt(w_full.chunk(2)[shard], mesh, Shard(0), w_full.shape))
        b = torch.nn.Parameter(_dt(b_full, mesh, Replicate(), b_full.shape))
        has = case == "all" or (case == "shard1_none" and shard == 0)
        if has:
            w.grad = _dt(w_grad.chunk(2)[shard], mesh, Shard(0), w_full.shape)
        if case != "none":
            b.grad = _dt(b_grad, mesh, Replicate(), b_full.shape)
        # the unsharded gradient: the rows of shard 1 count as zeros where that shard holds none
        seen_w = w_grad if case == "all" else (w_grad[:4] if case == "shard1_none" else w_grad[:0])
        seen_b = b_grad if case != "none" else b_grad[:0]
        expected = math.sqrt(float(seen_w.square().sum() + seen_b.square().sum()))
        with Reduced() as red:
            total = clip_grad_norm_([w, b], MAX_NORM, mesh)
        coef = min(1.0, MAX_NORM / (expected + 1e-6))
        clipped_ok = True
        if has:
            clipped_ok &= torch.allclose(w.grad.to_local(), w_grad.chunk(2)[shard] * coef, rtol=1e-6, atol=1e-7)
        if b.grad is not None:
            clipped_ok &= torch.allclose(b.grad.to_local(), b_grad * coef, rtol=1e-6, atol=1e-7)
        out[case] = {"total": float(total), "expected": expected, "total_device": total.device.type,
                     "reduced_devices": red.devices, "mesh_device": mesh.device_type, "clipped_ok": bool(clipped_ok),
                     "had_grad": has}
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
