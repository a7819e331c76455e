"""Run as a plain script: Trainer(devices=2, strategy="mics") launches the second rank itself, as for DDP."""

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mics  # noqa: E402,F401  registers "mics"
from tests.helpers.models import gpt  # noqa: E402


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt()

    def training_step(self, batch, idx):
        return self.model.loss(*batch)

    def validation_step(self, batch, idx):
        self.log("val_loss", self.model.loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randint(0, 61, (64, 13))
    dl = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mics", max_steps=3, limit_val_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0)
    module = Module()
    trainer.fit(module, dl, dl)
    trainer.validate(module, dl)  # a second setup on the restored module
    full = trainer.strategy.lightning_module_state_dict()
    (out / f"result{trainer.global_rank}.json").write_text(json.dumps({
        "world": trainer.world_size, "steps": trainer.global_step, "keys": len(full),
        "s": trainer.strategy.config.sharded_data_parallel_degree,
        "val": float(trainer.callback_metrics["val_loss"]),
    }))
