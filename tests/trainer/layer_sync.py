"""BatchNorm and Lightning's layer sync under a strategy, one case after another in one process (one rank).

    python layer_sync.py --out DIR --strategy mics|mics_os|ddp --cases batchnorm,layer_sync,...

Torch's SyncBatchNorm computes on GPUs only, so the syncing itself runs through a LayerSync plugin of this script
(``plugins=[AllReduceBatchNorm()]``, as Lightning allows): it swaps each BatchNorm1d for ``AllReducedBatchNorm1d``,
which sums the batch statistics over every rank with torch.distributed.nn's differentiable all_reduce, and swaps
them back. Cases (rank 0 saves ``<case>.pt``):

- ``batchnorm``: a model with BatchNorm in a block (a unit of its own) and in the root, no sync;
- ``layer_sync``: the same with the plugin: the layer types seen during the fit and after it;
- ``sync_batchnorm_cpu``: ``Trainer(sync_batchnorm=True)`` on CPU (torch's SyncBatchNorm): the error, the layer
  types after it, then a fit without it in the same processes;
- ``layer_sync_sharded``: with the plugin, a model left sharded (``max_live_parameters``) fits twice; then a
  model left sharded without syncing asked to sync in its second fit (refused under MiCS).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.plugins.layer_sync import LayerSync  # noqa: E402

from lightning_mics.frontends.shared import engine_of  # noqa: E402

from tests.helpers.models import D, H, Block  # noqa: E402
from tests.helpers.trainer_cases import BATCH, Base, classification_data, loader, main, params, strategy_for, trainer_for  # noqa: E402


class AllReducedBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d over the union of every rank's batch (what torch's SyncBatchNorm computes, on CPU)."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor(float(x.numel() // x.shape[1]))
        dist.all_reduce(count)
        mean = dist_nn.all_reduce(x.sum(dims)) / count
        var = dist_nn.all_reduce((x * x).sum(dims)) / count - mean * mean
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
            self.num_batches_tracked += 1
        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def _swap(module, old, new):
    for name, child in list(module.named_children()):
        if type(child) is old:
            swapped = new(child.num_features, child.eps, child.momentum)
            swapped.weight, swapped.bias = child.weight, child.bias
            for b in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(swapped, b, getattr(child, b))
            setattr(module, name, swapped)
        else:
            _swap(child, old, new)
    return module


class AllReduceBatchNorm(LayerSync):
    def apply(self, model):
        return _swap(model, nn.BatchNorm1d, AllReducedBatchNorm1d)

    def revert(self, model):
        return _swap(model, AllReducedBatchNorm1d, nn.BatchNorm1d)


class BNBlock(Block):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(H)

    def forward(self, x):
        h = self.bn(self.fc1(self.ln(x)).transpose(1, 2)).transpose(1, 2)
        return x + self.fc2(F.gelu(h))


class BatchNormNet(Base):
    """BatchNorm inside each block (a unit of its own) and in the root unit, before the head. Trained with Base's
    SGD: the biases just before a BatchNorm have no gradient but rounding noise, which Adam would blow up to
    steps of the learning rate in directions that depend on the order of the reduction's sums."""

    def __init__(self):
        super().__init__()
        self.net.blocks = nn.ModuleList(BNBlock() for _ in range(2))
        self.bn = nn.BatchNorm1d(D)
        self.types_in_fit = None

    def forward(self, idx):
        x = self.net.emb(idx)
        for b in self.net.blocks:
            x = b(x)
        return self.net.head(self.bn(x.mean(1)))

    def on_train_start(self):
        self.types_in_fit = norm_types(self)


def norm_types(module):
    return sorted({type(m).__name__ for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})


def every_rank(module):
    """[each rank's buffers]: the running statistics as each rank holds them."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {n: b.detach().clone() for n, b in module.named_buffers()})
    return out


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    data = loader(classification_data(4 * world * BATCH), kind, world, rank)
    result = {}
    if case in ("batchnorm", "layer_sync"):
        m = BatchNormNet()
        plugins = [AllReduceBatchNorm()] if case == "layer_sync" else []
        trainer_for(kind, world, max_epochs=2, plugins=plugins).fit(m, data)
        result.update(types_in_fit=m.types_in_fit, types_after=norm_types(m), buffers=every_rank(m))
    elif case == "sync_batchnorm_cpu":
        m = BatchNormNet()
        try:
            trainer_for(kind, world, max_steps=2, sync_batchnorm=True).fit(m, data)
            result["error"] = None
        except Exception as err:  # noqa: BLE001
            result["error"] = f"{type(err).__name__}: {err}"
        result["types_after"] = norm_types(m)
        result["errors"] = [None] * world
        dist.all_gather_object(result["errors"], result["error"])
        L.seed_everything(0, verbose=False)
        m = BatchNormNet()
        trainer_for(kind, world, max_steps=4).fit(m, data)
    elif case == "layer_sync_sharded":
        mics = kind.startswith("mics")
        small = {"max_live_parameters": 1000} if mics else {}
        m = BatchNormNet()
        for fit in range(2):
            trainer_for(kind, world, max_steps=3, plugins=[AllReduceBatchNorm()],
                        strategy=strategy_for(kind, **small)).fit(m, data)
            result[f"types_after_{fit}"] = norm_types(m)
        result["stayed_sharded"] = any(type(p) is not nn.Parameter for p in m.parameters())
        names = {n for n, _ in m.named_parameters()}
        result["params"] = {n: t for n, t in _full_state(m, kind).items() if n in names}
        result["buffers"] = every_rank(m)
        unsynced = BatchNormNet()  # left sharded without syncing, then asked to sync
        trainer_for(kind, world, max_steps=1, strategy=strategy_for(kind, **small)).fit(unsynced, data)
        try:
            trainer_for(kind, world, max_steps=1, plugins=[AllReduceBatchNorm()],
                        strategy=strategy_for(kind, **small)).fit(unsynced, data)
            result["refused"] = None
        except ValueError as err:
            result["refused"] = str(err)
        return result
    else:
        raise ValueError(case)
    result["params"] = params(m)
    return result


def _full_state(module, kind):
    if kind.startswith("mics"):
        engine = engine_of(module)
        if engine is not None:
            return engine.full_state_dict(dst=None)
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


if __name__ == "__main__":
    main(run_case)
