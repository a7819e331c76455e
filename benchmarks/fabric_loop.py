"""The Fabric loop: MiCS under Lightning Fabric beside FSDP2 HSDP, same GPT, batches and optimizer, interleaved.

    python benchmarks/fabric_loop.py                 # 4 CPU ranks (gloo), accumulation 4, a few minutes

Cases, built once from the same initial weights in the same 4 processes and run in rounds (one optimizer step
of each per round, so a loaded machine slows all of them alike):

- ``fabric mics s=2``: ``L.Fabric(strategy=lightning_mics.fabric.MiCSStrategy(sharded_data_parallel_degree=2))``
  in litgpt's loop pattern: ``fabric.no_backward_sync(model, enabled=is_accumulating)``, ``fabric.backward``;
- ``fabric mics s=2 sync-every``: the same without ``no_backward_sync`` (the replica all-reduce every micro-batch);
- ``engine mics s=2``: the same engine driven by hand in a plain loop (as ``benchmarks/peers.py`` runs it): what
  the Fabric glue costs on top;
- ``fsdp2 hsdp``: ``fully_shard`` per block and on the root over a (2, 2) (replicate, shard) mesh, its defaults;
- ``fsdp2 hsdp ar-acc``: the same with ``set_requires_all_reduce(False)`` before the boundary micro-batch;
- Fabric's own ``FSDPStrategy(sharding_strategy="HYBRID_SHARD")``: refused on CPU by Fabric itself (its message is
  recorded in the table); it runs on CUDA only.

Per case: median step time after warm-up and bytes per group per optimizer step (a TorchDispatchMode that sees
every c10d op with its group: tests/helpers/comm_mode.py). Ratios are against ``fsdp2 hsdp``. Writes
``benchmarks/out/fabric_loop.md`` and ``.json``. A shared 2-core machine times the whole run more than the
cases: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

BASE = "fsdp2 hsdp"


def worker(args) -> None:
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mics.app.models import GPT, GPTConfig
    from lightning_mics.fabric import MiCSStrategy
    import peers
    from peers import _group_name, fsdp2_shard
    from tests.helpers.comm_mode import CommCounter

    torch.set_num_threads(1)
    strategy = MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0, kernels="torch")
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    g = torch.Generator().manual_seed(100 + rank)
    batches = torch.randint(0, args.vocab, (args.accum, args.batch, args.seq + 1), generator=g)

    def loss_of(model, x):
        logits = model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    torch.manual_seed(0)
    model = fabric.setup_module(GPT(cfg))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    mics = (model, opt)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    fsdp = fsdp2_shard(GPT(cfg), mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)
    engine_model, engine = peers.build("mics s=2", cfg)  # the engine in a plain loop, as benchmarks/peers.py runs it
    engine_opt = torch.optim.AdamW(engine_model.parameters(), lr=1e-4)

    def step(case: str) -> None:
        accum = args.accum
        if case == "engine mics s=2":
            peers.step(case, engine_model, engine, engine_opt, batches)
            return
        if case.startswith("fabric"):
            m, o = mics
            for i, x in enumerate(batches):
                accumulating = i < accum - 1 and not case.endswith("sync-every")
                with fabric.no_backward_sync(m, enabled=accumulating):
                    fabric.backward(loss_of(m, x) / accum)
            o.step()
            o.zero_grad()
            return
        for i, x in enumerate(batches):
            if case.endswith("ar-acc"):
                fsdp.set_requires_all_reduce(i == accum - 1)
            (loss_of(fsdp, x) / accum).backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad()

    names = ["fabric mics s=2", "fabric mics s=2 sync-every", "engine mics s=2", "fsdp2 hsdp", "fsdp2 hsdp ar-acc"]
    times = defaultdict(list)
    for rnd in range(args.warmup + args.rounds):
        for case in names:
            dist.barrier()
            t0 = time.perf_counter()
            step(case)
            dist.barrier()
            if rnd >= args.warmup:
                times[case].append(time.perf_counter() - t0)
    results = {}
    for case in names:
        counter = CommCounter()
        dist.barrier()
        with counter:
            step(case)
        groups = defaultdict(int)
        for op, group, nbytes in counter.events:
            if op in ("all_gather", "reduce_scatter", "all_reduce") and group is not None:
                groups[f"{op}/{_group_name(op, group, world)}"] += nbytes
        results[case] = {"step_s": statistics.median(times[case]), "groups": dict(groups)}
    try:
        from lightning.fabric.strategies import FSDPStrategy

        L.Fabric(accelerator="cpu", devices=4, strategy=FSDPStrategy(sharding_strategy="HYBRID_SHARD",
                                                                     auto_wrap_policy={type(fsdp.h[0])}))
        results["fabric fsdp hybrid"] = {"refused": None}
    except Exception as err:  # Fabric refuses FSDP on CPU
        results["fabric fsdp hybrid"] = {"refused": f"{type(err).__name__}: {err}"}
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(results))


def report(per_rank, args) -> str:
    names = [k for k in per_rank[0] if "step_s" in per_rank[0][k]]
    base = max(r[BASE]["step_s"] for r in per_rank)
    mib = 2.0 ** 20
    lines = [f"GPT width {args.width}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}, micro-batch "
             f"{args.batch}, accumulation {args.accum}, 4 CPU ranks (gloo), (replicate 2, shard 2); AdamW; "
             f"{args.rounds} rounds after {args.warmup} warm-up, interleaved.", "",
             "| case | step s (slowest rank, median) | vs fsdp2 hsdp | MiB per step: shard group | replica/world |",
             "|---|---|---|---|---|"]
    for case in names:
        step = max(r[case]["step_s"] for r in per_rank)
        groups = per_rank[0][case]["groups"]
        shard = sum(v for k, v in groups.items() if k.endswith("/shard")) / mib
        cross = sum(v for k, v in groups.items() if k.endswith(("/replicate", "/world"))) / mib
        lines.append(f"| {case} | {step:.3f} | {step / base:.2f}x | {shard:.2f} | {cross:.2f} |")
    lines += ["", f"Fabric's FSDPStrategy(sharding_strategy='HYBRID_SHARD') on CPU: "
                  f"{per_rank[0]['fabric fsdp hybrid']['refused']}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    from tests.helpers.launch import run_ranks

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rest = [a for a in sys.argv[1:] if a != "--out" and a != args.out]
    per_rank = run_ranks(Path(__file__).resolve(), 4, rest, out, timeout=3600)
    text = report(per_rank, args) + f"\n\nWall time of the run: {time.perf_counter() - t0:.0f} s."
    print(text)
    (out / "fabric_loop.md").write_text(text + "\n")
    (out / "fabric_loop.json").write_text(json.dumps(per_rank))


if __name__ == "__main__":
    main()
