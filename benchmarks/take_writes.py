"""The time of one write-back of what user code wrote (``UserCodeBoundary.masters_read``, [Note: writes between steps]
in lightning_mics/engine/user_code/write_back.py): the optimizer's pre-step hook comparing the module's plain parameters with the masters it was handed, under ZeRO-1
(``sharded_data_parallel_degree=1, shard_optimizer_state=True``) and a mixed precision, where the plain parameters
are ``param_dtype`` copies of every parameter. A stack of ``--layers`` Linear(width, width) in Fabric, one step, then
``--repeat`` timed calls on every rank; rank 0 prints the median and the minimum (ms) as one JSON line.

    PYTHONPATH=$PWD torchrun --nproc-per-node 4 benchmarks/take_writes.py --layers 24 --width 1024

Compare two trees by alternating runs of each (the machine's load moves between runs).
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import lightning as L

    from lightning_mics.fabric import MiCSStrategy
    from lightning_mics.frontends.shared import engine_of

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), precision=args.precision,
                      strategy=MiCSStrategy(sharded_data_parallel_degree=1, shard_optimizer_state=True,
                                            param_persistence_threshold=0))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    fabric.backward(model(torch.randn(4, args.width)).float().pow(2).mean())
    opt.step()
    opt.zero_grad()
    engine = engine_of(model.module)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        engine.user_code.masters_read()
        times.append(time.perf_counter() - start)
    times.sort()
    if fabric.global_rank == 0:
        print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "world": fabric.world_size,
                          "precision": args.precision, "median_ms": round(1e3 * times[len(times) // 2], 2),
                          "min_ms": round(1e3 * times[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
