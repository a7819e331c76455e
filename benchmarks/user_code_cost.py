"""The step with nothing lent to user code: what the user-code boundary ([Note: the user-code boundary] in
lightning_mics/engine/user_code/boundary.py) costs a plain training loop, to compare two trees of the package.

A byte-level GPT whose root unit is large (a ``--vocab`` x ``--width`` embedding tied to the head, the blocks as units)
trains with MiCS at s = ``WORLD_SIZE`` under Fabric or the Trainer (automatic optimization), ``--accumulation`` micro-
batches per step; after ``--warmup`` steps, ``--steps`` are timed on every rank (a barrier at each end). Rank 0 prints
one JSON line: the median and the minimum step (ms of wall time, and of this process's CPU time, which another load
on the machine moves less), and the bytes the root's write-back keeps beside its shard
(``snapshot``; 0 where no unit keeps one).

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 benchmarks/user_code_cost.py --frontend fabric

Compare two trees by alternating runs of each (``git worktree add /tmp/before <commit>``, then ``PYTHONPATH=/tmp/before``):
the machine's load moves between runs.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()  # the head tied to the embedding: both in the root


def batches(args, n):
    g = torch.Generator().manual_seed(1234 + int(os.environ.get("RANK", 0)))
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(n)]


def loss_of(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def snapshot_bytes(engine) -> int:
    """Bytes the root's write-back keeps beside its shard: the current tree's ``snapshot``, or an older tree's
    ``Unit.lent.base``."""
    root = engine.units[0]
    if hasattr(engine, "user_code"):
        wb = engine.user_code.write_back_of(root)
        t = None if wb is None else wb.snapshot
    else:
        t = getattr(getattr(root, "lent", None), "base", None)
    return 0 if t is None else t.numel() * t.element_size()


def run_fabric(args, steps):
    import lightning as L

    from lightning_mics.fabric import MiCSStrategy
    from lightning_mics.frontends.shared import engine_of

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)),
                      strategy=MiCSStrategy(param_persistence_threshold=0))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(args.vocab, args.width, args.depth))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = batches(args, steps * args.accumulation)
    engine = engine_of(model.module)
    times, cpu, peak = [], [], 0
    for step in range(steps):
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for k in range(args.accumulation):
            batch = data[step * args.accumulation + k]
            with fabric.no_backward_sync(model, enabled=k < args.accumulation - 1):
                loss = loss_of(model, batch) / args.accumulation
                peak = max(peak, snapshot_bytes(engine))  # the root is kept from its forward into its backward
                fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        cpu.append(time.process_time() - start_cpu)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    return fabric.global_rank, times[args.warmup:], cpu[args.warmup:], peak


def run_trainer(args, steps):
    import lightning as L

    from lightning_mics import MiCSStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = GPT(args.vocab, args.width, args.depth)
            self.times, self.cpu_times, self.peak, self._start = [], [], 0, None

        def training_step(self, batch, batch_idx):
            self.peak = max(self.peak, snapshot_bytes(self.trainer.strategy.engine))
            return loss_of(self.net, batch[0])

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx % args.accumulation == 0:
                torch.distributed.barrier()
                self._start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx % args.accumulation == args.accumulation - 1:
                self.cpu_times.append(time.process_time() - self._start[1])
                torch.distributed.barrier()
                self.times.append(time.perf_counter() - self._start[0])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = Module()
    data = torch.utils.data.TensorDataset(torch.cat(batches(args, steps * args.accumulation)))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 1)), max_steps=steps,
                        strategy=MiCSStrategy(param_persistence_threshold=0), accumulate_grad_batches=args.accumulation,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, loader)
    return trainer.global_rank, module.times[args.warmup:], module.cpu_times[args.warmup:], module.peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frontend", choices=["fabric", "trainer"], default="fabric")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = run_fabric if args.frontend == "fabric" else run_trainer
    rank, times, cpu, peak = run(args, args.warmup + args.steps)
    if rank == 0:
        times.sort()
        cpu.sort()
        print(json.dumps({"frontend": args.frontend, "accumulation": args.accumulation,
                          "world": int(os.environ.get("WORLD_SIZE", 1)), "steps": len(times),
                          "median_ms": round(1e3 * times[len(times) // 2], 2), "min_ms": round(1e3 * times[0], 2),
                          "cpu_median_ms": round(1e3 * cpu[len(cpu) // 2], 2),
                          "root_snapshot_bytes": peak}), flush=True)


if __name__ == "__main__":
    main()
