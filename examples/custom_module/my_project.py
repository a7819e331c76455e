"""A user's own LightningModule and data module, trained by the main job from the command line.

Nothing here knows about the strategy: MiCS, DDP or a single process train it unchanged. The task is a
synthetic regression (targets from a fixed random "teacher" network), so it needs no download.

    python -m lightning_mics.app.train --config-dir conf model=regressor data=teacher \\
        strategy.sharded_data_parallel_degree=2 trainer.devices=2 trainer.max_steps=200

(``python -m`` puts this folder on ``sys.path``, so Hydra can import ``my_project``; with the
``lightning-mics-train`` command, set ``PYTHONPATH=.`` or install your code instead.)
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Regressor(L.LightningModule):
    """An MLP with residual blocks in an ``nn.ModuleList`` (the strategy's default gather/release units)."""

    def __init__(self, in_features: int = 32, width: int = 256, depth: int = 4, out_features: int = 8,
                 lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TeacherData(L.LightningDataModule):
    """``num_samples`` inputs ~ N(0, 1) and the outputs of a fixed random two-layer network, from ``seed``."""

    def __init__(self, in_features: int = 32, out_features: int = 8, num_samples: int = 8192,
                 batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        hp = self.hparams
        g = torch.Generator().manual_seed(hp.seed)
        w1 = torch.randn(hp.in_features, 64, generator=g) / hp.in_features**0.5
        w2 = torch.randn(64, hp.out_features, generator=g) / 8.0
        x = torch.randn(hp.num_samples, hp.in_features, generator=g)
        y = torch.tanh(x @ w1) @ w2
        n_val = hp.num_samples // 8
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, drop_last=True)
