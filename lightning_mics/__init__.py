"""lightning-mics: MiCS sharded data parallelism as a PyTorch Lightning strategy.

``import lightning_mics`` registers ``"mics"`` in Lightning's StrategyRegistry, so
``Trainer(strategy="mics")`` works; ``MiCSStrategy(...)`` takes the options of :class:`MiCSConfig`.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mics.checkpoint import consolidate
from lightning_mics.checkpoint_files import CheckpointError
from lightning_mics.config import MiCSConfig
from lightning_mics.plan import plan  # the function; the module stays importable as lightning_mics.plan (python -m)
from lightning_mics.sharding import register_parameter
from lightning_mics.strategy import MiCSStrategy

if "mics" not in StrategyRegistry:
    MiCSStrategy.register_strategies(StrategyRegistry)

__all__ = ["CheckpointError", "MiCSConfig", "MiCSStrategy", "consolidate", "plan", "register_parameter"]
