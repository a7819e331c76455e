"""Memory at the end of fit and during state-dict saves, measured from the allocator, not the engine.

A model of 6 blocks whose full size exceeds ``max_live_parameters`` (so it is one that "only fits because it
is sharded") trains for 2 steps with AdamW. The profiler's memory events (every CPU allocation and free, with
its size) are recorded around (a) the end of fit (from on_train_end until fit returns), (b)
``lightning_module_state_dict()`` and (c) ``trainer.save_checkpoint`` (a full checkpoint); the peak of the
running sum over each window is what this rank allocated on top of what it already held.
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
from tests.helpers.models import Block  # noqa: E402

D, H, V, C, N_BLOCKS = 64, 256, 61, 61, 6


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(D, H, norm=False) for _ in range(N_BLOCKS))
        self.head = nn.Linear(D, C)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x.mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def peak_of(prof) -> int:
    evs = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                 key=lambda e: e.start_ns())
    cur = peak = 0
    for e in evs:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


class EndOfFit(L.Callback):
    def on_train_end(self, trainer, pl_module):
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-live", type=int, required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    model = Model()
    numel = sum(p.numel() for p in model.parameters())
    unit_bytes = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
    root_bytes = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks")) * 4
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randint(0, V, (world * 4, 5), generator=g), torch.randint(0, C, (world * 4,), generator=g))
    dl = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    end = EndOfFit()
    strategy = MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0,
                            max_live_parameters=args.max_live, state_dict_type="full")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[end])
    trainer.fit(model, dl)
    end.prof.__exit__(None, None, None)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p_sd:
        sd = trainer.strategy.lightning_module_state_dict()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p_ckpt:
        trainer.save_checkpoint(Path(args.out) / "full.ckpt")
    from torch.distributed.tensor import DTensor

    result = {
        "rank": rank, "param_bytes": numel * 4, "unit_bytes": max(unit_bytes, root_bytes),
        "end_of_fit": peak_of(end.prof), "state_dict": peak_of(p_sd), "save_checkpoint": peak_of(p_ckpt),
        "stays_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "state_dict_keys": len(sd), "model_keys": len(model.state_dict()),
    }
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
