"""lightning-mics: MiCS sharded data parallelism as a PyTorch Lightning strategy.

``import lightning_mics`` registers ``"mics"`` in Lightning's StrategyRegistry and in Fabric's, so
``Trainer(strategy="mics")`` and ``Fabric(strategy="mics")`` (:class:`lightning_mics.fabric.MiCSStrategy`) work; ``MiCSStrategy(...)`` takes the options of :class:`MiCSConfig`.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_mics.checkpoint.state import consolidate
from lightning_mics.frontends.clip import grad_norm
from lightning_mics.checkpoint.files import CheckpointError
from lightning_mics import fabric
from lightning_mics.options import MiCSConfig
from lightning_mics.plan import plan  # the function; the module stays importable as lightning_mics.plan (python -m)
from lightning_mics.layout.sharding import register_parameter
from lightning_mics.frontends.trainer import MiCSStrategy

if "mics" not in StrategyRegistry:
    MiCSStrategy.register_strategies(StrategyRegistry)
if "mics" not in FABRIC_STRATEGY_REGISTRY:  # L.Fabric(strategy="mics"): lightning_mics.fabric.MiCSStrategy
    fabric.MiCSStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = ["CheckpointError", "MiCSConfig", "MiCSStrategy", "consolidate", "fabric", "grad_norm", "plan",
           "register_parameter"]
