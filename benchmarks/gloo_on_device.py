"""Which gloo all-gather on a device's tensors works, each variant in its own pair of processes (a crash ends one
variant, not the run).

    python benchmarks/gloo_on_device.py                    # CUDA: two processes on the one GPU
    python benchmarks/gloo_on_device.py --device cpu       # the same variants on CPU (a dry run)

Why: two ranks on one GPU cannot use NCCL (one rank per GPU), so `gpu_checks.py`'s `two_triton` / `two_torch`
run the engine over gloo on CUDA tensors, and on torch 2.11 both die with a segfault in ``gloo::allgather``
copying from a device address (benchmarks/LOG.md, "Not run: two ranks on the one GPU"). Gloo stages a CUDA
all-gather through pinned host memory (``AsyncAllgatherCUDAWork``); its coalesced all-gather has no CUDA path and
hands gloo the device pointers (pytorch/pytorch#152645), and torch's functional all-gather, which DTensor's
redistribution uses, goes through the coalesced one. On an H200 (2026-11-28) the engine's own calls passed on the
default group: `all_gather_into_tensor` sync and async, into and from views, two in flight, bf16, 16 MB, on a side
stream; `reduce_scatter_tensor` and `all_reduce` async. These variants separate the rest: the group (the default
one, a DeviceMesh dimension, `new_group`) and the path (c10d, functional, DTensor's `full_tensor`). One JSON line
per variant: ``{"variant": ..., "rc": [rank 0, rank 1], "ok": ..., "error": first failing lines}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

N = 1 << 12
VARIANTS = ("default_c10d", "mesh_c10d", "new_group_c10d", "default_funcol", "mesh_full_tensor")


def worker(variant: str, device_type: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    x = torch.full((N,), float(rank + 1), device=device)
    want = torch.cat([torch.full((N,), float(r + 1)) for r in range(world)])
    if variant.endswith("_c10d"):
        group = {"default_c10d": lambda: None,
                 "mesh_c10d": lambda: init_device_mesh(device_type, (1, world),
                                                       mesh_dim_names=("replicate", "shard")).get_group("shard"),
                 "new_group_c10d": lambda: dist.new_group(list(range(world)))}[variant]()
        out = torch.empty(world * N, device=device)
        dist.all_gather_into_tensor(out, x, group=group, async_op=True).wait()
    elif variant == "default_funcol":
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait()
    else:  # mesh_full_tensor
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        out = DTensor.from_local(x, mesh, [Shard(0)]).full_tensor()
    if device_type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want), (variant, out)
    dist.destroy_process_group()
    # The variant's subject ends here. The interpreter's finalization is not it: a gloo worker still holding a Work
    # when it begins aborts the exit (-6, "terminate called without an active exception"; [Note: groups at exit]
    # in lightning_mics/layout/topology.py), which a DeviceMesh's groups met about once in 20 runs of `mesh_full_tensor`.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(variant: str, device_type: str, port: int, timeout: float) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    cmd = [sys.executable, __file__, "--device", device_type, "--worker", variant]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        outs.append((p.returncode, text))
    row = {"variant": variant, "rc": [rc for rc, _ in outs], "ok": all(rc == 0 for rc, _ in outs)}
    failed = next((text for rc, text in outs if rc != 0), None)
    if failed is not None:
        lines = [ln for ln in failed.splitlines() if ln.strip() and "warn" not in ln.lower()]
        row["error"] = " | ".join(lines[-16:])[-2000:]  # a traceback's error, or a crash's frames
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per variant")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.device)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.helpers.launch import free_port

    for variant in args.variants:
        print(json.dumps(run(variant, args.device, free_port(), args.timeout)), flush=True)


if __name__ == "__main__":
    main()
