"""Sharded initialization (one rank of a launch): a model built on the meta device, in configure_model or under
``trainer.init_module(empty_init=True)``, is materialized as shards at setup.

Rank 0 reports: the initial values (gathered after setup) against the same model built on a real device with the
same seed, the parameters after training against one plain process on the same global batches, and, from the
profiler's memory events between the callbacks' ``setup`` and ``on_fit_start`` (configure_model, sharding and
initialization), the peak this rank allocated, against the full model and against 1/s of it plus one unit.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.models import Net  # noqa: E402

V, D, H, C, T, BLOCKS = 97, 128, 512, 61, 5, 6


class Module(L.LightningModule):
    def __init__(self, build_in_configure_model):
        super().__init__()
        self.net = None if build_in_configure_model else Net(V, D, H, C, BLOCKS)

    def configure_model(self):
        if self.net is None:
            with torch.device("meta"):
                self.net = Net(V, D, H, C, BLOCKS)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        return F.cross_entropy(self.net(idx), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


class Watch(L.Callback):
    def setup(self, trainer, pl_module, stage):
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self.prof.__exit__(None, None, None)
        evs = sorted((e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
        cur = self.peak = 0
        for e in evs:
            cur += e.nbytes()
            self.peak = max(self.peak, cur)
        self.init = trainer.strategy.lightning_module_state_dict()  # full, rank 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--where", choices=["configure_model", "init_module"], required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    steps, b = 3, 2
    g = torch.Generator().manual_seed(5)
    ds = TensorDataset(torch.randint(0, V, (steps * world * b, T), generator=g),
                       torch.randint(0, C, (steps * world * b,), generator=g))
    watch = Watch()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0),
                        callbacks=[watch])
    torch.manual_seed(0)
    if args.where == "init_module":
        with trainer.init_module(empty_init=True):
            module = Module(build_in_configure_model=False)
        meta_before = all(p.is_meta for p in module.parameters())
    else:
        module = Module(build_in_configure_model=True)
        meta_before = module.net is None
    trainer.fit(module, DataLoader(ds, batch_size=b, sampler=DistributedSampler(ds, world, rank, shuffle=False)))
    result = {"rank": rank, "meta_before": meta_before, "setup_peak": watch.peak}
    if rank == 0:
        torch.manual_seed(0)
        ref = Net(V, D, H, C, BLOCKS)  # the same seed on a real device
        init = {k[len("net."):]: v for k, v in watch.init.items()}
        result["init_max_abs"] = max((init[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        full_bytes = sum(p.numel() * 4 for p in ref.parameters())
        shard_bytes = sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for p in ref.parameters())  # 1/s, rows padded
        unit_bytes = max(sum(p.numel() * 4 for p in ref.blocks[0].parameters()),
                         sum(p.numel() * 4 for n, p in ref.named_parameters() if not n.startswith("blocks")))
        result.update(full_bytes=full_bytes, shard_bytes=shard_bytes, unit_bytes=unit_bytes)
        opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
        x, y = ds.tensors
        for step in range(steps):  # the union of the ranks' batches (DistributedSampler without shuffle)
            idx = torch.cat([torch.arange(k, len(ds), world)[step * b:(step + 1) * b] for k in range(world)])
            F.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
        got = {n[len("net."):]: p for n, p in module.named_parameters()}
        result["trained_max_abs"] = max((got[n] - p).abs().max().item() for n, p in ref.named_parameters())
        result["trained_ref_max"] = max(p.abs().max().item() for p in ref.parameters())
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
