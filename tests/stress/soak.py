"""The soak: a long fit on 4 CPU ranks, sampled every ``--sample-every`` optimizer steps.

Run as a user does: ``python tests/stress/soak.py --out DIR`` (Lightning's launcher starts ranks 1-3). Defaults:
2,000 optimizer steps, accumulation 4, validation every 100 optimizer steps (``val_check_interval`` counts
micro-batches: 400), a sharded checkpoint every 500 steps (``ModelCheckpoint(every_n_train_steps=500)``), a CSV
logger, s = 2 (r = 2: both the shard and the replica groups work), every parameter sharded
(``param_persistence_threshold=0``) so every unit is gathered and released on every micro-batch.

At each sample (after the optimizer step, between steps) every rank records:
  rss_kib         its resident set (``VmRSS`` of /proc/self/status), after ``gc.collect()``
  gathered        the engine's count of gathered parameter elements alive (``engine.log.gathered_elements``)
  plain_bytes     bytes of plain (non-DTensor) parameter storages the modules hold, counted from the storages
                  themselves (tests/helpers/live.py): a gathered parameter that leaked would show here
  groups          live process groups (``_world.pg_map``), and ``threads``: the process's thread count
Rank r writes ``DIR/soak{r}.json``; tests/stress/test_soak.py checks them.
"""

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.nn as nn  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.live import LiveMeter  # noqa: E402
from tests.stress.abort_repro import SEQ, VOCAB, Module  # noqa: E402


class SoakModule(Module):
    def training_step(self, batch, idx):
        loss = super().training_step(batch, idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss, sync_dist=True)


def rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


class Sampler(L.Callback):
    def __init__(self, every: int) -> None:
        self.every = every
        self.samples = []
        self.t0 = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 0 or step % self.every or (self.samples and self.samples[-1]["step"] == step):
            return  # once per sampled step, right after its optimizer step (the boundary micro-batch)
        gc.collect()
        engine = trainer.strategy.engine
        meter = LiveMeter(pl_module, trainer.optimizers)
        meter.sample()
        self.samples.append(dict(step=step, t=round(time.monotonic() - self.t0, 1), rss_kib=rss_kib(),
                                 gathered=engine.log.gathered_elements, plain_bytes=meter.peak_param_bytes,
                                 groups=len(c10d._world.pg_map), threads=threading.active_count(),
                                 os_threads=len(os.listdir("/proc/self/task"))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--val-every", type=int, default=100, help="optimizer steps")
    ap.add_argument("--ckpt-every", type=int, default=500, help="optimizer steps")
    ap.add_argument("--sample-every", type=int, default=100, help="optimizer steps")
    ap.add_argument("--devices", type=int, default=4)
    args = ap.parse_args()
    out = Path(args.out)
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (1024, SEQ + 1))  # 256 micro-batches of 4 per epoch over 4 ranks
    v = torch.randint(0, VOCAB, (64, SEQ + 1))
    train = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4, shuffle=True)
    val = DataLoader(TensorDataset(v[:, :-1], v[:, 1:]), batch_size=4)
    sampler = Sampler(args.sample_every)
    ckpt = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=args.ckpt_every, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, accumulate_grad_batches=args.accumulation,
        val_check_interval=args.val_every * args.accumulation, check_val_every_n_epoch=None,
        num_sanity_val_steps=0, callbacks=[sampler, ckpt], logger=CSVLogger(out, name="csv"),
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0))
    t0 = time.monotonic()
    trainer.fit(SoakModule(), train, val)
    wall = time.monotonic() - t0
    rank = trainer.global_rank
    result = dict(rank=rank, wall_s=round(wall, 1), global_step=trainer.global_step, samples=sampler.samples,
                  checkpoints=sorted(p.name for p in (out / "ckpts").iterdir()) if rank == 0 else None,
                  val_loss=float(trainer.callback_metrics.get("val_loss", float("nan"))))
    (out / f"soak{rank}.json").write_text(json.dumps(result))
    print(f"[rank {rank}] soak done: {trainer.global_step} steps in {wall:.0f} s; RSS KiB "
          f"{[s['rss_kib'] for s in sampler.samples]}", flush=True)


if __name__ == "__main__":
    main()
