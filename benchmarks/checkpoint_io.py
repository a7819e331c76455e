"""Checkpoint save and load: time and peak host memory per rank, state_dict_type="full" vs "sharded".

    python benchmarks/checkpoint_io.py                          # 4 CPU ranks (gloo), s=2 x r=2, a 50M-parameter GPT
    python benchmarks/checkpoint_io.py --ranks 2 --s 2 --n-layer 4 --n-embd 512 --out /tmp/ckpt_io   # smaller

Each mode gets its own Trainer: ``fit`` runs one AdamW step (so optimizer state exists) with a model larger
than ``max_live_parameters`` (it stays sharded after fit, as a large model does), then ``--reps`` times:
``trainer.save_checkpoint(path)`` and a load through the strategy's own resume path (``load_checkpoint``, then
``load_model_state_dict`` and ``load_optimizer_state_dict``, what ``fit(ckpt_path=...)`` runs). Time is wall time
(median of the repetitions, the slowest rank); peak host memory is the rise of the process's resident set
(VmHWM, reset through /proc/self/clear_refs before each operation, after malloc_trim) above its size before it,
the largest over the repetitions. Files go to ``--out`` (default: a folder under /tmp). Prints the table and the
full/sharded ratios, and writes them into benchmarks/LOG.md (section "Checkpoint IO") with the machine and the
command.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTION = "## Checkpoint IO (`benchmarks/checkpoint_io.py`)"


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _measure(fn):
    """(seconds, peak resident bytes above the size before) of ``fn()``. Freed heap memory is given back to the
    OS first (malloc_trim), so that what the operation allocates shows as growth instead of reusing it unseen."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, _status("VmHWM") - before


def worker(args) -> None:
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_mics import MiCSStrategy
    from lightning_mics.app.models import GPT, GPTConfig

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = Path(args.out)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(cfg)

        def training_step(self, batch, idx):
            x = batch[0]
            logits = self.model(x[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randint(0, 256, (world, cfg.block_size + 1), generator=g))
    dl = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    results = {}
    for mode in ("full", "sharded"):
        module = Lit()
        n_params = sum(p.numel() for p in module.parameters())
        trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            strategy=MiCSStrategy(sharded_data_parallel_degree=args.s, state_dict_type=mode,
                                                  max_live_parameters=1, param_persistence_threshold=10_000))
        trainer.fit(module, dl)
        st = trainer.strategy
        path = out / f"{mode}.ckpt"
        saves, loads = [], []

        def load():  # as fit(ckpt_path=...) does; its optimizer holds no state yet (cleared below)
            ck = st.load_checkpoint(path)
            st.load_model_state_dict(ck)
            st.load_optimizer_state_dict(ck)

        for rep in range(args.reps + 1):  # the first is a warm-up
            dist.barrier()
            s = _measure(lambda: trainer.save_checkpoint(path))
            dist.barrier()
            for opt in trainer.optimizers:
                opt.state.clear()
            ld = _measure(load)
            if rep:
                saves.append(s)
                loads.append(ld)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        results[mode] = {"save_s": statistics.median(t for t, _ in saves), "save_peak": max(m for _, m in saves),
                         "load_s": statistics.median(t for t, _ in loads), "load_peak": max(m for _, m in loads),
                         "bytes": size, "n_params": n_params}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (out / "result0.json").write_text(json.dumps(gathered))
    else:
        (out / f"result{rank}.json").write_text("{}")


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():
        m = re.search(r"model name\s*:\s*(.+)", info.read_text())
        cpu = m.group(1).strip() if m else cpu
    mem = _status_total()
    return (f"{cpu}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"torch {torch.__version__}, gloo on CPU")


def _status_total() -> int:
    m = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return int(m.group(1)) * 1024 if m else 0


def report(per_rank, args, command: str, wall: float) -> str:
    mb = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    n = per_rank[0]["full"]["n_params"]
    state_mb = n * 4 * 3 / 2**20  # fp32 params + AdamW exp_avg, exp_avg_sq
    lines = [SECTION, "",
             f"Machine: {_machine()}. Command: `{command}` ({wall:.0f} s wall).",
             f"Model: GPT, {args.n_layer} layers, width {args.n_embd}, {n / 1e6:.1f}M parameters (full model + AdamW "
             f"state {state_mb:.0f} MiB in fp32); {len(per_rank)} ranks, s={args.s}; kept sharded after fit "
             f"(max_live_parameters=1). Median of {args.reps} repetitions after a warm-up; peak = rise of the "
             "resident set during the operation (VmHWM), largest repetition. On a shared machine the times move "
             "between runs more than the memory figures do: read the ratios.", "",
             "| mode | rank | save s | save peak MiB | load s | load peak MiB | on disk MiB |",
             "|---|---|---|---|---|---|---|"]
    for mode in ("full", "sharded"):
        for r, res in enumerate(per_rank):
            x = res[mode]
            lines.append(f"| {mode} | {r} | {x['save_s']:.2f} | {mb(x['save_peak'])} | {x['load_s']:.2f} | "
                         f"{mb(x['load_peak'])} | {mb(x['bytes'])} |")
    worst = {mode: {k: max(res[mode][k] for res in per_rank) for k in ("save_s", "save_peak", "load_s", "load_peak")}
             for mode in ("full", "sharded")}
    ratio = {k: worst["full"][k] / max(worst["sharded"][k], 1e-9) for k in worst["full"]}
    lines += ["", "Full / sharded, slowest (or largest) rank: "
              f"save time {ratio['save_s']:.1f}x, save peak memory {ratio['save_peak']:.1f}x, "
              f"load time {ratio['load_s']:.1f}x, load peak memory {ratio['load_peak']:.1f}x.", ""]
    return "\n".join(lines)


def _write_results(text: str) -> None:
    path = ROOT / "benchmarks" / "LOG.md"
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION in old:
        start = old.index(SECTION)
        nxt = old.find("\n## ", start + len(SECTION))
        old = old[:start].rstrip() + ("\n\n" + old[nxt + 1:] if nxt >= 0 else "\n")
    path.write_text(old.rstrip() + "\n\n" + text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=704)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for the checkpoints (default: a new one under /tmp)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave LOG.md alone")
    args = ap.parse_args()
    if "RANK" in os.environ:  # a worker started by the launcher below
        worker(args)
        return
    from tests.helpers.launch import run_ranks

    out = Path(args.out or tempfile.mkdtemp(prefix="ckpt_io_"))
    out.mkdir(parents=True, exist_ok=True)
    command = (f"python benchmarks/checkpoint_io.py --ranks {args.ranks} --s {args.s} --n-layer {args.n_layer} "
               f"--n-embd {args.n_embd} --reps {args.reps}")
    t0 = time.perf_counter()
    fwd = ["--s", str(args.s), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--reps", str(args.reps)]
    per_rank = run_ranks(Path(__file__).resolve(), args.ranks, fwd, out, timeout=3000)[0]
    text = report(per_rank, args, command, time.perf_counter() - t0)
    print(text)
    if not args.no_write:
        _write_results(text)
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
