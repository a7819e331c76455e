"""The peer table: this strategy against DDP and FSDP2, same GPT, batches and optimizer, interleaved in one run.

    python benchmarks/peers.py                       # 4 CPU ranks (gloo), accumulation 1 and 4, a few minutes
    python benchmarks/peers.py --width 192 --vocab 50257 --rounds 8

Cases, each built once from the same initial weights in the same 4 processes and run in rounds (one optimizer
step of each per round, so a loaded machine slows all of them alike):

- ``ddp``: torch's DistributedDataParallel (what Lightning's DDP strategy wraps), ``no_sync`` inside a window;
- ``fsdp2 hsdp``: ``fully_shard`` per block and on the root over a (2, 2) (replicate, shard) mesh, its defaults
  (reduce-scatter and replica all-reduce every micro-batch);
- ``fsdp2 hsdp ar-acc``: the same with ``set_requires_all_reduce(False)`` on the micro-batches before the
  boundary, so the replica all-reduce runs once per optimizer step;
- ``mics s=2`` and ``mics s=4``: the strategy's engine (``MiCSEngine``, what ``MiCSStrategy`` drives) in the same
  plain loop, every parameter sharded (``param_persistence_threshold=0``, as FSDP2 does), prefetch 1.

Per case and accumulation: median step time after warm-up; model-state bytes per rank (parameters, gradients and
optimizer state, counted from storages after the optimizer step: each storage once, the local shard of a
DTensor); peak memory per rank = the resident memory the case keeps between steps (measured across its build and
first step) + the largest rise during one of its steps (VmHWM reset through /proc/self/clear_refs; glibc's mmap
threshold is fixed at 64 KiB so that freed tensors leave the resident set); bytes per group per optimizer step
from a TorchDispatchMode that sees every c10d op with its group (tests/helpers/comm_mode.py). The largest rank
is reported. Ratios are against ``fsdp2 hsdp``. Writes ``benchmarks/out/peers.md``, ``peers.json`` and
``peers.png``. A shared 2-core machine times the whole run more than the cases: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402
from lightning_mics.layout.placement import local  # noqa: E402
from lightning_mics.plan import Settings, comm_per_step, model_state_bytes  # noqa: E402
from lightning_mics.plan.models import from_module  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

CASES = ["ddp", "fsdp2 hsdp", "fsdp2 hsdp ar-acc", "mics s=2", "mics s=4"]
BASE = "fsdp2 hsdp"


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def fsdp2_shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 as its users wrap a GPT: ``fully_shard`` per block, then on the root (embeddings, final norm, head).
    A 1-D mesh shards over all its ranks; a 2-D (replicate, shard) mesh is HSDP. Also used by
    ``benchmarks/cluster_rank.py``."""
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build(case: str, cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg)
    world = dist.get_world_size()
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), None
    if case.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        return fsdp2_shard(model, mesh), None
    from lightning_mics.options import MiCSConfig
    from lightning_mics.engine.engine import MiCSEngine
    from lightning_mics.layout.topology import build_topology, plan_layout

    s = int(case.split("=")[1])
    topo = build_topology(plan_layout(world, s), "cpu")
    options = MiCSConfig(param_persistence_threshold=0, kernels="torch").freeze()
    engine = MiCSEngine(model, topo, options.resolved("32-true", False), torch.device("cpu"))
    return model, engine


def state_bytes(model, opt) -> int:
    seen, total = set(), 0
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    for t in tensors:
        st = local(t).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def step(case, model, engine, opt, batches, after_step=None) -> None:
    accum = len(batches)
    for m, x in enumerate(batches):
        last = m == accum - 1
        if engine is not None:
            engine.sync_replicas = last
        if case == "fsdp2 hsdp ar-acc":
            model.set_requires_all_reduce(last)
        with model.no_sync() if case == "ddp" and not last else nullcontext():
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            (loss / accum).backward()
    opt.step()
    if after_step is not None:
        after_step()
    opt.zero_grad()


def _group_name(op: str, group, world: int) -> str:
    """shard (contiguous ranks: gathers and reduce-scatters), replicate (strided), world (all-reduce over all)."""
    g = list(group)
    if op == "all_reduce" and g == list(range(world)):
        return "world"
    return "shard" if g == list(range(g[0], g[0] + len(g))) else "replicate"


def worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    g = torch.Generator().manual_seed(100 + rank)
    data = {a: torch.randint(0, args.vocab, (a, args.batch, args.seq + 1), generator=g) for a in args.accum}
    cases, kept = {}, {}
    for case in CASES:  # one at a time: what each keeps resident between steps
        dist.barrier()
        rss0 = _status("VmRSS")
        model, engine = build(case, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step(case, model, engine, opt, data[args.accum[0]])
        cases[case] = (model, engine, opt)
        kept[case] = _status("VmRSS") - rss0
    results = {}
    for accum in args.accum:
        batches = data[accum]
        times = defaultdict(list)
        for rnd in range(args.warmup + args.rounds):
            for case, (model, engine, opt) in cases.items():
                dist.barrier()
                t0 = time.perf_counter()
                step(case, model, engine, opt, batches)
                dist.barrier()
                if rnd >= args.warmup:
                    times[case].append(time.perf_counter() - t0)
        for case, (model, engine, opt) in cases.items():  # one more step each, counted and measured
            dist.barrier()
            state = {}
            counter = CommCounter()
            _reset_peak()
            rss = _status("VmRSS")
            with counter:
                step(case, model, engine, opt, batches, after_step=lambda: state.update(b=state_bytes(model, opt)))
            rise = _status("VmHWM") - rss
            groups = defaultdict(int)
            for op, group, nbytes in counter.events:
                if op in ("all_gather", "reduce_scatter", "all_reduce") and group is not None:
                    groups[f"{op}/{_group_name(op, group, world)}"] += nbytes
            results.setdefault(accum, {})[case] = dict(
                step_s=statistics.median(times[case]), state=state["b"], peak=kept[case] + rise, groups=dict(groups))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _cross(groups) -> int:
    return sum(v for k, v in groups.items() if k.endswith(("/replicate", "/world")))


def _shard(groups) -> int:
    return sum(v for k, v in groups.items() if k.endswith("/shard"))


def report(per_rank, args, n_params):
    accums = list(per_rank[0])
    merged = {a: {} for a in accums}
    for a in accums:
        for case in per_rank[0][a]:
            rows = [r[a][case] for r in per_rank]
            merged[a][case] = dict(step_s=max(r["step_s"] for r in rows), state=max(r["state"] for r in rows),
                                   peak=max(r["peak"] for r in rows), groups=rows[0]["groups"])
    MiB = 2 ** 20
    lines = [f"4 CPU ranks (gloo), GPT {args.width} wide x {args.layers} blocks, vocab {args.vocab}, "
             f"{n_params / 1e6:.2f}M parameters, micro-batch {args.batch}x{args.seq} per rank, AdamW, fp32; median of "
             f"{args.rounds} rounds after {args.warmup}; largest rank. Ratios: case / {BASE}.", ""]
    for a in accums:
        m = merged[a]
        base = m[BASE]
        lines += [f"**Accumulation {a}**", "",
                  "| case | step s | / HSDP | peak MiB/rank | / HSDP | model state MiB/rank | / HSDP | "
                  "shard-group MB/step | cross-replica MB/step | / HSDP |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for case, r in m.items():
            cross = _cross(r["groups"])
            lines.append(f"| {case} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | {r['peak'] / MiB:.1f} | "
                         f"{r['peak'] / base['peak']:.2f} | {r['state'] / MiB:.1f} | "
                         f"{r['state'] / base['state']:.2f} | "
                         f"{_shard(r['groups']) / 1e6:.2f} | {cross / 1e6:.2f} | "
                         f"{cross / max(_cross(base['groups']), 1):.2f} |")
        lines.append("")
    keys = ["all_gather/shard", "reduce_scatter/shard", "all_reduce/replicate", "all_reduce/world"]
    lines += ["**Bytes per group and collective, one optimizer step (MB, rank 0)**", "",
              "| case | accumulation | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for case in merged[accums[0]]:
        for a in accums:
            g = merged[a][case]["groups"]
            lines.append(f"| {case} | {a} | " + " | ".join(f"{g.get(k, 0) / 1e6:.2f}" for k in keys) + " |")
    lines += ["", "**The planner's figures for the mics cases** (`lightning_mics.plan` on the same GPT, no process "
              "started) against the measured ones above", "",
              "| case | accumulation | model state MiB: planned / measured | shard-group MB: planned / measured | "
              "cross-replica MB: planned / measured |", "|---|---|---|---|---|"]
    spec = from_module(GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4,
                                     n_embd=args.width)))
    for case in merged[accums[0]]:
        if not case.startswith("mics"):
            continue
        s = int(case.split("=")[1])
        for a in accums:
            st = Settings(nodes=1, gpus_per_node=4, precision="32-true", optimizer="adamw", accumulation=a,
                          param_persistence_threshold=0, prefetch=1)
            comm = {k: v["bytes"] for k, v in comm_per_step(spec, st, s).items()}
            r = merged[a][case]
            planned = model_state_bytes(spec, st, s)["total"]
            lines.append(f"| {case} | {a} | {planned / MiB:.2f} / {r['state'] / MiB:.2f} | "
                         f"{_shard(comm) / 1e6:.2f} / {_shard(r['groups']) / 1e6:.2f} | "
                         f"{_cross(comm) / 1e6:.3f} / {_cross(r['groups']) / 1e6:.3f} |")
    return "\n".join(lines), merged


def plot(merged, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accums = list(merged)
    cases = list(merged[accums[0]])
    metrics = [("step time", lambda r: r["step_s"]), ("peak memory per rank", lambda r: r["peak"]),
               ("model state per rank", lambda r: r["state"]),
               ("cross-replica bytes per step", lambda r: _cross(r["groups"]))]
    fig, axes = plt.subplots(1, len(metrics), figsize=(14, 3.8), sharey=True)
    width = 0.8 / len(accums)
    for ax, (title, get) in zip(axes, metrics):
        for i, a in enumerate(accums):
            base = max(get(merged[a][BASE]), 1e-12)
            ax.barh([k + i * width for k in range(len(cases))], [get(merged[a][c]) / base for c in cases], width,
                    label=f"accumulation {a}")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{title} / {BASE}", fontsize=9)
    axes[0].set_yticks([k + width / 2 for k in range(len(cases))], cases)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(accums), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the ranks: freed tensors leave the resident set
    from tests.helpers.launch import free_port

    t0 = time.perf_counter()
    raw = out / "peers.json"
    mp.start_processes(worker, args=(4, free_port(), args, str(raw)), nprocs=4, start_method="spawn")
    per_rank = [{int(a): v for a, v in r.items()} for r in json.loads(raw.read_text())]
    n_params = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4,
                             n_embd=args.width)).num_params()
    text, merged = report(per_rank, args, n_params)
    text += f"\n\nWall time of the run: {time.perf_counter() - t0:.0f} s."
    print(text)
    (out / "peers.md").write_text(text + "\n")
    plot(merged, out / "peers.png")


if __name__ == "__main__":
    main()
