"""``lightning_mics.fabric.MiCSStrategy``: the Fabric front end (``lightning_mics/frontends/fabric.py``)."""

from lightning_mics.frontends.fabric import MiCSStrategy

__all__ = ["MiCSStrategy"]
