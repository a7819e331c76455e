"""Bytes across replica groups per optimizer step: MiCS vs FSDP2 HSDP (fully_shard on a 2-D mesh) vs DDP.

    python benchmarks/comm_bytes.py                 # 4 CPU ranks (gloo), s=2 x r=2, accumulation 1 and 4

Bytes are counted by a TorchDispatchMode (every c10d op with its process group), not by our own counters.
"Cross-replica" = collectives whose group is a replica group {j, j+s, ...} or the whole world (every byte
there crosses the replica boundary). Step time is wall time per optimizer step on this machine's CPU, mean
of the measured steps (a shared 2-core box: read the ratios, not the absolute figures). Writes
``benchmarks/out/comm_bytes.md`` and ``comm_bytes.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _batches(rank, n, b=4):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, 256, (n, b, CFG.block_size + 1), generator=g)
    return x


def _build(kind, s, accum):
    torch.manual_seed(0)
    model = GPT(CFG)
    if kind == "mics":
        from lightning_mics.runtime import MiCSEngine
        from lightning_mics.topology import build_topology, plan_layout

        topo = build_topology(plan_layout(dist.get_world_size(), s), "cpu")
        engine = MiCSEngine(model, topo, shard_units=None, persistence_threshold=1024, bucket_size=int(5e8),
                            param_dtype=None, reduce_dtype=torch.float32, kernels="torch",
                            device=torch.device("cpu"))

        def set_sync(last):
            engine.sync_replicas = last
        replica_groups = [tuple(g) for g in topo.layout.replica_groups()]
        return model, set_sync, replica_groups
    if kind == "fsdp2_hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size() // s, s), mesh_dim_names=("replicate", "shard"))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        replica_groups = [tuple(range(j, dist.get_world_size(), s)) for j in range(s)]
        return model, (lambda last: None), replica_groups  # defaults: sync every micro-batch
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        state = {"ctx": None}

        def set_sync(last):
            state["last"] = last
        ddp._mics_state = state
        return ddp, set_sync, []
    raise ValueError(kind)


def _worker(rank, world, port, kind, s, accum, steps, warmup, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, set_sync, replica_groups = _build(kind, s, accum)
    world_group = tuple(range(world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _batches(rank, (steps + warmup) * accum)
    cross, times = [], []
    for step in range(warmup + steps):
        counter = CommCounter()
        dist.barrier()
        t0 = time.perf_counter()
        with counter:
            for m in range(accum):
                x = data[step * accum + m]
                last = m == accum - 1
                set_sync(last)
                ctx = model.no_sync() if kind == "ddp" and not last else torch.enable_grad()
                with ctx:
                    inner = model.module if kind == "ddp" else model
                    logits = model(x[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
                    (loss / accum).backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
        cross.append(sum(n for op, g, n in counter.events
                         if g is not None and (tuple(g) in replica_groups or tuple(g) == world_group)))
    def local(t):  # FSDP2 parameters and their optimizer state are DTensors: count the local shard
        return t.to_local() if hasattr(t, "to_local") else t

    state_bytes = sum(local(p).numel() * p.element_size() for p in model.parameters())
    state_bytes += sum(local(v).numel() * v.element_size() for st in opt.state.values() for v in st.values()
                       if torch.is_tensor(v) and v.dim() > 0)
    if rank == 0:
        Path(out).write_text(json.dumps({"cross_bytes": sum(cross[warmup:]) / steps,
                                         "step_s": sum(times[warmup:]) / steps, "state_bytes": state_bytes}))
    dist.destroy_process_group()


def run(kind, world, s, accum, steps, warmup, tmp):
    from tests.helpers.launch import free_port

    out = Path(tmp) / f"{kind}_{accum}.json"
    mp.start_processes(_worker, args=(world, free_port(), kind, s, accum, steps, warmup, str(out)), nprocs=world,
                       start_method="spawn")
    return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for accum in (1, 4):
        res = {k: run(k, args.world, args.s, accum, args.steps, args.warmup, args.out)
               for k in ("mics", "fsdp2_hsdp", "ddp")}
        rows.append((accum, res))
    lines = [f"# Cross-replica bytes per optimizer step ({args.world} CPU ranks, gloo, s={args.s}, "
             f"r={args.world // args.s}, GPT {sum(p.numel() for p in GPT(CFG).parameters())/1e6:.2f}M params)", "",
             "| accumulation | MiCS MB | FSDP2 HSDP MB | MiCS / HSDP | MiCS step s | HSDP step s | DDP step s "
             "| MiCS / HSDP time | MiCS / DDP time | state MB/rank MiCS / HSDP / DDP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for accum, r in rows:
        m, h, d = r["mics"], r["fsdp2_hsdp"], r["ddp"]
        lines.append(f"| {accum} | {m['cross_bytes']/1e6:.3f} | {h['cross_bytes']/1e6:.3f} | "
                     f"{m['cross_bytes']/h['cross_bytes']:.3f} | {m['step_s']:.3f} | {h['step_s']:.3f} | "
                     f"{d['step_s']:.3f} | {m['step_s']/h['step_s']:.2f} | {m['step_s']/d['step_s']:.2f} | "
                     f"{m['state_bytes']/1e6:.2f} / {h['state_bytes']/1e6:.2f} / {d['state_bytes']/1e6:.2f} |")
    text = "\n".join(lines)
    print(text)
    (Path(args.out) / "comm_bytes.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [r["mics"]["cross_bytes"] / 1e6 for _, r in rows], 0.4, label="MiCS")
        ax.bar([i + 0.2 for i in xs], [r["fsdp2_hsdp"]["cross_bytes"] / 1e6 for _, r in rows], 0.4,
               label="FSDP2 HSDP")
        ax.set_xticks(list(xs), [f"accumulation {a}" for a, _ in rows])
        ax.set_ylabel("MB across replica groups / step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(args.out) / "comm_bytes.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
