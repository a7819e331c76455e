"""The planner: which sharding degree s, and what it costs, before a job starts.

    python -m lightning_mics.plan --model gpt-neox-20b --instance p4d.24xlarge --nodes 2 --seq-len 2048 \\
        --micro-batch 4 --activation-checkpointing --png plan.png
    lightning_mics.plan("gpt-neox-20b", instance="p4d.24xlarge", nodes=2, micro_batch=4, ...) -> Plan

The modules, each importing only those above it:

- ``models``: a model as the planner sees it (units of parameter shapes), from a name, a Hugging Face config, a
  count or an ``nn.Module``;
- ``settings``: everything but the model (cluster presets, precision, optimizer, batch shape, the strategy's
  options with :class:`~lightning_mics.options.MiCSConfig`'s defaults), validated;
- ``estimate``: the arithmetic for one layout ([Note: planner arithmetic] and the Notes after it there);
- ``report``: :func:`plan`, estimating every valid degree, and its result :class:`Plan` with the explanation, the
  table and the chart;
- ``cli``: the command line.
"""

from lightning_mics.plan.models import ModelSpec, ParamShape, UnitShapes, resolve
from lightning_mics.plan.settings import GiB, INSTANCES, OPTIMIZER_STATES, PRECISIONS, Instance, Settings
from lightning_mics.plan.estimate import (LINKS, Estimate, activation_bytes, comm_per_step, estimate,
                                          model_state_bytes)
from lightning_mics.plan.report import Plan, plan
from lightning_mics.plan.cli import main

__all__ = ["GiB", "INSTANCES", "LINKS", "OPTIMIZER_STATES", "PRECISIONS", "Estimate", "Instance", "ModelSpec",
           "ParamShape", "Plan", "Settings", "UnitShapes", "activation_bytes", "comm_per_step", "estimate", "main",
           "model_state_bytes", "plan", "resolve"]
