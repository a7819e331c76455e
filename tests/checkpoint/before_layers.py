"""One rank of tests/checkpoint/test_checkpoints_before_layers.py: a Trainer (2 ranks, s = 2, AdamW) on a tiny module.

``--write DIR --kind sharded|full`` trains 3 steps and saves (how tests/checkpoint/before_layers/ was made, with the
package as it was before its folders by layer, commit 11b1c00); ``--resume CKPT`` resumes that checkpoint for one
more step and reports the parameters after it and the step it resumed at.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mics  # noqa: E402,F401
from lightning_mics import MiCSStrategy  # noqa: E402


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 10), nn.Linear(10, 6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--write", default=None)
    ap.add_argument("--kind", default="sharded")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 6), torch.randn(16, 3))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4 if args.resume else 3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0,
                                              state_dict_type=args.kind))
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=4), ckpt_path=args.resume)
    if args.write:
        trainer.save_checkpoint(Path(args.write) / f"{args.kind}.ckpt")
    full = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank == 0:
        (Path(args.out) / "result0.json").write_text(json.dumps(
            {"global_step": trainer.global_step, "state": {k: v.tolist() for k, v in full.items()}}))
    else:
        (Path(args.out) / f"result{trainer.global_rank}.json").write_text("{}")


if __name__ == "__main__":
    main()
