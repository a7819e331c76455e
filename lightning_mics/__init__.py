"""lightning-mics: MiCS sharded data parallelism as a PyTorch Lightning strategy."""

from lightning_mics.config import MiCSConfig

__all__ = ["MiCSConfig"]
