"""What the Trainer's case scripts share (``tests/trainer/compat.py`` and its siblings in trainer/, user_code/,
checkpoint/, ...): the classification data and the ``Base`` LightningModule around ``models.Net``, the strategy
and Trainer of each kind (``mics``, ``mics_os``, ``zero1``, ``ddp``, ``single``: one plain Lightning process on the
union of the ranks' batches), and ``main``, which runs one case after another in one process (one rank of a launch;
``tests/helpers/cases.py`` launches it and reads the results back).

    python <script>.py --out DIR --strategy KIND --cases case1,case2,...
"""

import argparse
import contextlib
import json
import os
import traceback
from pathlib import Path
from typing import Iterator

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mics import MiCSStrategy
from tests.helpers.bf16_policy import Bf16Copies
from tests.helpers.models import C, V, Net

T = 5  # sequence length
BATCH = 4  # per rank


def classification_data(n):
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, V, (n, T), generator=g), torch.randint(0, C, (n,), generator=g))


class Base(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, idx):
        return self.net(idx)

    def loss(self, batch):
        idx, y = batch
        return F.cross_entropy(self(idx), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def strategy_for(kind, **options):
    if kind in ("mics", "mics_os"):  # mics_os: [Note: optimizer rows over replicas] (r = 2 on 4 ranks)
        return MiCSStrategy(**{"sharded_data_parallel_degree": 2, "param_persistence_threshold": 0,
                               "shard_optimizer_state": kind == "mics_os", **options})
    if kind == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    return "auto"


def loader(ds, kind, world, rank, batch=BATCH):
    if kind == "single":  # the union of the ranks' batches: DistributedSampler(shuffle=False) is strided
        return DataLoader(ds, batch_size=batch * world)
    return DataLoader(ds, batch_size=batch, sampler=DistributedSampler(ds, world, rank, shuffle=False))


def trainer_for(kind, world, **kwargs):
    strategy = kwargs.pop("strategy", None) or strategy_for(kind)
    if kind == "ddp" and kwargs.get("precision") == "bf16-mixed":
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), Bf16Copies()]
    base = dict(accelerator="cpu", devices=1 if kind == "single" else world, strategy=strategy,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, num_sanity_val_steps=0)
    base.update(kwargs)
    return L.Trainer(**base)


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def strategy_of(kind):
    """A fresh strategy of ``kind`` (one per fit)."""
    if kind == "zero1":
        return MiCSStrategy(sharded_data_parallel_degree=1, shard_optimizer_state=True, param_persistence_threshold=0)
    if kind in ("mics_os_q8", "mics_os_q8_exact"):  # exact: one scale per element, int8 without rounding
        return strategy_for("mics_os", quantize_gradients="error_feedback",
                            quantization_block_size=1 if kind == "mics_os_q8_exact" else 2048)
    return strategy_for(kind)


def whole(p):
    """A parameter as one full tensor on every rank: a released unit's DTensor through ``full_tensor``."""
    return p.full_tensor() if isinstance(p, DTensor) else p


@contextlib.contextmanager
def groups_kept_between_fits() -> Iterator[None]:
    """Within it, a fit's teardown leaves its layout's process groups and mesh in place when nothing uses them any
    more, so the next fit of that layout in this process takes them up again ([Note: one topology per layout]
    in lightning_mics/layout/topology.py), and with them DTensor's caches of sharding decisions, which a release
    empties. Without it every fit of a case script created its sub-groups anew and propagated every op's sharding
    again: measured on ``compat.py``'s 24 cases under MiCS on 2 ranks, one rank's cases took 26 CPU-seconds, 16 with
    the groups kept (the launch, 63 -> 40), most of it ``torch_optim``'s 15 fits (8.5 -> 4.4). What each
    case compares is the same either way (a reused group sums in the same order); the release itself, and a
    layout trained again after its groups were released, are checked in ``tests/layout/test_lifecycle.py``; the
    first fit of each layout in a launch still creates its groups, and every group goes at exit
    ([Note: groups at exit] in lightning_mics/layout/topology.py)."""
    from lightning_mics.frontends import shared

    release = shared.release_topology  # the one call that destroys a layout's groups (shared.release_unused)
    shared.release_topology = lambda topology: None
    try:
        yield
    finally:
        shared.release_topology = release


def main(run):
    """Runs each of ``--cases`` through ``run(case, strategy, world, rank, out)``, rank 0 saving each result as
    ``<case>.pt``, and records every case's traceback in ``result<rank>.json``. A layout's process groups are
    kept from one case's fit to the next (``groups_kept_between_fits``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--cases", required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    world_data = int(os.environ.get("DATA_WORLD", world))  # "single" reads the batches of this many ranks
    errors = {}
    with groups_kept_between_fits():
        for case in args.cases.split(","):
            try:
                result = run(case, args.strategy, world_data, rank, args.out)
                if rank == 0:
                    torch.save(result, Path(args.out) / f"{case}.pt")
            except Exception:
                errors[case] = traceback.format_exc()
                print(errors[case], flush=True)
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({"errors": errors}))
