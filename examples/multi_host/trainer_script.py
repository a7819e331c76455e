"""A Trainer script on several hosts: the script that runs on one machine, started on every host by torchrun (or by
srun, one task per rank). Commands: README.md beside this file.

The script itself only has to name its folder from the job, so that every host writes into the same one
(``lightning_mics.app.hosts.job_name``: torchrun's --rdzv-id, SLURM_JOB_ID, or --run-id), and to take
``devices`` / ``num_nodes`` from the launcher. The sharded checkpoint in that folder is written by every rank (its
own shard files): on several hosts the folder must be on a filesystem they all write to.

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 --rdzv-id $JOB_ID \\
        examples/multi_host/trainer_script.py --root /shared/runs --shard 4
    python examples/multi_host/trainer_script.py --devices 2 --run-id local   # one machine, Lightning's launcher
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mics import MiCSStrategy
from lightning_mics.app.hosts import detect, job_name


class Blocks(L.LightningModule):
    """A residual MLP: each block is one unit the strategy gathers and releases."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs", help="the folder of the job folders (shared by every host)")
    parser.add_argument("--run-id", default=None, help="the job's name; default: the launcher's job id")
    parser.add_argument("--devices", type=int, default=1, help="ranks on this machine, without torchrun or srun")
    parser.add_argument("--shard", type=int, default=None, help="sharded_data_parallel_degree (default: ranks per node)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    name = job_name(args.run_id)  # the same on every host, without talking to the others
    if name is None:
        raise SystemExit("no launcher names this job: give --run-id NAME (the same on every rank)")
    folder = Path(args.root) / name
    launch = detect()  # torchrun or srun: their layout, else this machine's --devices
    devices, nodes = (launch.ranks_per_host, launch.hosts) if launch else (args.devices, 1)

    L.seed_everything(0)
    x = torch.randn(1024, 64)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, max_steps=args.steps,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=args.shard, param_persistence_threshold=100),
                        default_root_dir=folder, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Blocks()
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    trainer.save_checkpoint(folder / "last.ckpt")  # a directory: every rank writes its shards into it
    full = trainer.strategy.lightning_module_state_dict()  # the whole model on rank 0
    if trainer.is_global_zero:
        torch.save(full, folder / "final.pt")
        print(f"[trainer_script] {trainer.world_size} ranks, {trainer.global_step} steps; wrote {folder}")


if __name__ == "__main__":
    main()
