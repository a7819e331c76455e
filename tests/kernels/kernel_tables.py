"""One rank of ``tests/kernels/test_kernel_tables.py``: a Fabric loop under MiCS with ``kernels="triton"`` (the kernels
interpreted on CPU) over a model of many units of distinct shapes, so that more distinct buckets are copied per
step than the old 64-entry table cache held. Records, per step, the descriptor tables the Triton copies looked up,
built and the per-call pointer arrays they sent (``lightning_mics_kernels.table_stats()``), and the parameters at the end.

``--int8``: the gather's cross-node hop in int8 blocks (``quantize_allgather``, each rank its own node), so the
quantize / dequantize kernels run as well.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

import lightning_mics_kernels  # noqa: E402
from lightning_mics_kernels import _table  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402


class Net(nn.Module):
    """``units`` Linear blocks, block i of width 8 + i: every unit's buckets have their own shapes."""

    def __init__(self, units: int) -> None:
        super().__init__()
        widths = [8 + i for i in range(units + 1)]
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--units", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kernels", default="triton")
    ap.add_argument("--int8", action="store_true")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    options = dict(sharded_data_parallel_degree=world, param_persistence_threshold=0, kernels=args.kernels)
    if args.int8:
        options.update(ranks_per_node=1, hierarchical_allgather=True, quantize_allgather=True,
                       quantization_block_size=64)
    fabric = L.Fabric(accelerator="cpu", devices=world, precision="bf16-mixed", strategy=MiCSStrategy(**options))
    fabric.launch()
    torch.manual_seed(0)
    model = Net(args.units)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(args.steps):
        x = torch.randn(world, 2, 8, generator=g)[rank]
        y = torch.randn(world, 2, 8 + args.units, generator=g)[rank]
        lightning_mics_kernels.reset_table_stats()
        known = set(_table._CACHE)
        loss = (model(x).float() - y).pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        built = [str(k)[:300] for k in _table._CACHE if k not in known]  # what a failing assertion shows
        steps.append(dict(lightning_mics_kernels.table_stats()._asdict(), built=built if len(built) < 10 else len(built)))
    params = {k: v.full_tensor().float().tolist() if hasattr(v, "full_tensor") else v.float().tolist()
              for k, v in fabric.strategy.get_module_state_dict(model).items()}
    result = {"rank": rank, "steps": steps, "units": len(fabric.strategy._engines[0].units), "params": params}
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
