"""Step time of the communication schedule against its peers, interleaved in one run (4 CPU ranks, gloo).

    python benchmarks/schedule.py                    # GPT-2 shape: 192 wide, 4 blocks, vocab 50257, AdamW
    python benchmarks/schedule.py --rounds 8 --accum 1 4 --profile

One set of 4 processes builds every configuration from the same initial weights and runs them in rounds, one
optimizer step of each per round, so a loaded machine slows all of them alike; the table gives the median step
time after warm-up and its ratio to FSDP2 HSDP (``fully_shard`` per block and on the root, (2, 2) mesh, its
defaults) and to DDP. MiCS runs its engine in the same plain training loop (every parameter sharded:
``param_persistence_threshold=0``), at s = 2 (r = 2, the layout HSDP has) with prefetch 0/1/2 and with the
root/last-unit keep on and off, and at s = 4 over 2 simulated nodes of 2 ranks, flat and two-hop in either hop
order. Writes ``benchmarks/out/schedule.md`` and ``schedule.png``. A second table gives the CPU seconds per
step summed over the ranks (``getrusage``: user + system, gloo's threads and page-fault handling included) and
the minor page faults: on a shared machine the wall time also measures the neighbours, the CPU time much less.
``--profile`` also writes a torch.profiler table of rank 0's ops by self CPU time, grouped by input shape, for
MiCS (prefetch 1), FSDP2 HSDP and DDP (``profile_*.txt``), and per step the self time, calls and MB written per
op (``profile.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mics.comm import collectives  # noqa: E402
from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402

S2 = dict(s=2, ranks_per_node=None)
PROFILED = ("mics p1", "fsdp2_hsdp", "ddp")  # --profile: rank 0, 3 steps each, after the timed rounds
CONFIGS = {
    "ddp": {},
    "fsdp2_hsdp": {},
    "mics p0": dict(S2, prefetch=0),
    "mics p1": dict(S2, prefetch=1),
    "mics p2": dict(S2, prefetch=2),
    "mics p1 no-keep": dict(S2, prefetch=1, keep_for_backward=False),
    "mics s4 flat": dict(s=4, ranks_per_node=2, prefetch=1, hierarchical=False),
    "mics s4 two-hop": dict(s=4, ranks_per_node=2, prefetch=1, hierarchical=True, order="inter_first"),
    "mics s4 two-hop intra-first": dict(s=4, ranks_per_node=2, prefetch=1, hierarchical=True, order="intra_first"),
}


def build(name, cfg, mp_cfg):
    torch.manual_seed(0)
    model = GPT(mp_cfg)
    world = dist.get_world_size()
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), None
    if name == "fsdp2_hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, None
    from lightning_mics.options import MiCSConfig
    from lightning_mics.engine.engine import MiCSEngine
    from lightning_mics.layout.topology import build_topology, plan_layout

    topo = build_topology(plan_layout(world, cfg["s"], cfg["ranks_per_node"]), "cpu")
    options = MiCSConfig(param_persistence_threshold=0, kernels="torch", prefetch=cfg["prefetch"]).freeze()
    engine = MiCSEngine(model, topo, options.resolved("32-true", cfg.get("hierarchical", False)), torch.device("cpu"),
                        keep_for_backward=cfg.get("keep_for_backward", True))
    return model, engine


def step(name, model, engine, opt, batches, order):
    accum = len(batches)
    collectives.HOP_ORDER = order or collectives.HOP_ORDER
    for m, x in enumerate(batches):
        last = m == accum - 1
        if engine is not None:
            engine.sync_replicas = last
        ctx = model.no_sync() if name == "ddp" and not last else torch.enable_grad()
        with ctx:
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            (loss / accum).backward()
    opt.step()
    opt.zero_grad()


def op_summary(events, steps):
    """Per op: self CPU ms, calls and MB written (first tensor argument: the destination of copy_, fill_,
    zero_, the in-place ops), per step."""
    sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1}
    out = {}
    for e in events:
        row = out.setdefault(e.name, [0.0, 0.0, 0.0])
        row[0] += e.self_cpu_time_total / 1e3 / steps
        row[1] += 1 / steps
        shapes, dtypes = e.input_shapes or [], getattr(e, "input_dtypes", None) or []
        if shapes and shapes[0] and dtypes and dtypes[0] in sizes:
            n = 1
            for d in shapes[0]:
                n *= d
            row[2] += n * sizes[dtypes[0]] / 1e6 / steps
    return out


def worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mcfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    names = [n for n in CONFIGS if not args.only or n in args.only]
    models = {}
    for name in names:
        model, engine = build(name, CONFIGS[name], mcfg)
        models[name] = (model, engine, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(100 + rank)
    results, profiles, cpu_results = {}, {}, {}
    for accum in args.accum:
        data = torch.randint(0, args.vocab, (accum, args.batch, args.seq + 1), generator=g)
        times = {n: [] for n in names}
        cpu = torch.zeros(len(names), 2, dtype=torch.float64)  # this process's CPU seconds and minor faults
        for rnd in range(args.warmup + args.rounds):
            for k, name in enumerate(names):
                model, engine, opt = models[name]
                dist.barrier()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                step(name, model, engine, opt, data, CONFIGS[name].get("order"))
                dist.barrier()
                if rnd >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                    r1 = resource.getrusage(resource.RUSAGE_SELF)
                    cpu[k, 0] += r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
                    cpu[k, 1] += r1.ru_minflt - r0.ru_minflt
        dist.all_reduce(cpu)  # summed over the ranks, outside the timed region
        results[accum] = {n: statistics.median(t) for n, t in times.items()}
        cpu_results[accum] = {n: [cpu[k, 0].item() / args.rounds, cpu[k, 1].item() / args.rounds]
                              for k, n in enumerate(names)}
        if args.profile and rank == 0:
            from torch.profiler import ProfilerActivity, profile

            for name in PROFILED:
                if name not in models:
                    continue
                model, engine, opt = models[name]
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    for _ in range(3):
                        step(name, model, engine, opt, data, None)
                (Path(out).parent / f"profile_{name.replace(' ', '_')}_accum{accum}.txt").write_text(
                    prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=60))
                profiles.setdefault(accum, {})[name] = op_summary(prof.events(), 3)
        elif args.profile:
            for name in PROFILED:
                if name in models:
                    model, engine, opt = models[name]
                    for _ in range(3):
                        step(name, model, engine, opt, data, None)
    if rank == 0:
        Path(out).write_text(json.dumps({"time": results, "cpu": cpu_results}))
        if profiles:
            (Path(out).parent / "profile.json").write_text(json.dumps(profiles))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tests.helpers.launch import free_port

    raw = out / "schedule.json"
    mp.start_processes(worker, args=(4, free_port(), args, str(raw)), nprocs=4, start_method="spawn")
    raw_results = json.loads(raw.read_text())
    results = {int(k): v for k, v in raw_results["time"].items()}
    cpu = {int(k): v for k, v in raw_results["cpu"].items()}
    n_params = sum(p.numel() for p in GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                                                     n_head=4, n_embd=args.width)).parameters())
    lines = [f"# Step time, interleaved (4 CPU ranks, gloo, GPT {args.width} wide x {args.layers} blocks, vocab "
             f"{args.vocab}, {n_params / 1e6:.2f}M params, batch {args.batch}x{args.seq} per rank, AdamW; median of "
             f"{args.rounds} rounds after {args.warmup})", "",
             "| configuration | " + " | ".join(f"accum {a}: s/step | / HSDP | / DDP" for a in results) + " |",
             "|---|" + "---|---|---|" * len(results)]
    for name in next(iter(results.values())):
        cells = []
        for a, r in results.items():
            cells += [f"{r[name]:.3f}", f"{r[name] / r['fsdp2_hsdp']:.2f}" if "fsdp2_hsdp" in r else "-",
                      f"{r[name] / r['ddp']:.2f}" if "ddp" in r else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "CPU time per step, summed over the 4 ranks (user + system, compute and gloo threads alike: what the "
              "ranks compete for on a shared machine), and minor page faults (fresh memory touched)", "",
              "| configuration | " + " | ".join(f"accum {a}: CPU s/step | / HSDP | / DDP | faults/step"
                                               for a in cpu) + " |",
              "|---|" + "---|---|---|---|" * len(cpu)]
    for name in next(iter(cpu.values())):
        cells = []
        for a, c in cpu.items():
            cells += [f"{c[name][0]:.2f}", f"{c[name][0] / c['fsdp2_hsdp'][0]:.2f}" if "fsdp2_hsdp" in c else "-",
                      f"{c[name][0] / c['ddp'][0]:.2f}" if "ddp" in c else "-", f"{c[name][1] / 1e3:.0f}k"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    (out / "schedule.md").write_text(text + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(next(iter(results.values())))
    width = 0.8 / len(results)
    for i, (a, r) in enumerate(results.items()):
        ax.barh([k + i * width for k in range(len(names))], [r[n] / r["fsdp2_hsdp"] for n in names], width,
                label=f"accumulation {a}")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(0.7, color="g", lw=0.8, ls="--", label="goal 0.70")
    ax.set_yticks([k + width / 2 for k in range(len(names))], names)
    ax.set_xlabel("step time / FSDP2 HSDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "schedule.png", dpi=110)


if __name__ == "__main__":
    main()
