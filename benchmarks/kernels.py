"""Bucket-copy bandwidth: triton_kernels against plain torch and a device-to-device copy, in GB/s.

    python benchmarks/kernels.py                          # on a GPU: 10/100/1000 tensors, 1 MB .. 1 GB buckets
    python benchmarks/kernels.py --max-bytes 4e6          # without a GPU: torch baselines only (no Triton)
    python benchmarks/kernels.py --rotate 3 --views        # as the engine calls them: the threshold of "auto"

Per op (flatten, scatter, chunk_cat, chunk_split) and cast (fp32 -> fp32, fp32 -> bf16) a bucket of B bytes
of fp32 is split into n 1-D tensors of uneven sizes: multiples of 64 elements like real parameter shapes, so
every tensor takes the kernels' aligned 128-bit path (--unaligned: any size, the masked scalar path). GB/s =
bytes read + bytes written (chunk padding included) / time. "copy" is `dst.copy_(src)` of as many bytes,
the physical limit; "vs copy" = GB/s / copy's GB/s; "vs torch" = torch's time / Triton's time (its best torch
baseline). Timing: triton.testing.do_bench (median) on CUDA. On a CPU the Triton kernels would only run in
the interpreter, which is not worth timing, so only the torch baselines are timed there (perf_counter,
fastest of 10). Every implementation's output is checked bit for bit against the others before timing.
Writes <out>/kernels.md and <out>/kernels.png.

"torch fallback" is triton_kernels' own torch path (what backend="torch", and "auto" below its size, run).
--rotate K: each call takes the next of K copies of the inputs and outputs (same values, new allocations), as
the engine's gathers, gradients and outputs are new at every step: the descriptor tables are then looked up by
shape and the pointers travel per call ([Note: descriptor tables] in triton_kernels/_table.py); the Triton rows
report the tables built while timed (0 expected) and the per-call pointer copies. --views: the outputs of
scatter / chunk_split / dequantize are views of one buffer, as a unit's full parameters are (no pointer copy).
The summary line per (op, cast, tensors) names the smallest bucket from which Triton beat the torch fallback at
every larger size measured: [Note: auto's size rule] in triton_kernels/_backend.py takes its threshold from it.

Quantized ops (block-quantized int8 with fp32 scales, --block-size elements per scale, --chunks chunks):
quantize (a bucket of n tensors -> int8 wire), quantize+ef (with an fp32 error-feedback residual read and
rewritten), dequantize (wire -> n tensors), dequantize_sum (an all-to-all's --chunks rows -> their fp32 sum).
"cast" there is the dtype of the float side (inputs of quantize, outputs of dequantize); "torch fallback" is
triton_kernels' own torch path (the plain torch ops it replaces, bit-identical to the kernel). GB/s counts
the float bytes, the int8 bytes and the scales (and the residual twice) once each. The CPU figures time that
torch path only; the kernels' real speed needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_mics_kernels as tk  # noqa: E402

OPS = ("flatten", "scatter", "chunk_cat", "chunk_split")
QUANT_OPS = ("quantize", "quantize+ef", "dequantize", "dequantize_sum")
CASTS = {"fp32": torch.float32, "fp32->bf16": torch.bfloat16}
QUANT_CASTS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sizes_for(n: int, total: int, gen: torch.Generator, unaligned: bool) -> list[int]:
    w = torch.rand(n, generator=gen) + 0.5
    q = 1 if unaligned else 64
    s = [max(q, int(x) // q * q) for x in (w / w.sum() * total).tolist()]
    s[-1] = max(q, s[-1] + total - sum(s))
    return s


def outputs(sizes: list[int], dtype: torch.dtype, dev: str, views: bool) -> list[torch.Tensor]:
    """New tensors of `sizes`: separate allocations, or (views) views of one buffer, as a unit's parameters."""
    if views:
        return list(torch.empty(sum(sizes), dtype=dtype, device=dev).split(sizes))
    return [torch.empty(s, dtype=dtype, device=dev) for s in sizes]


def cases(op: str, dst: torch.dtype, sizes: list[int], chunks: int, dev: str, block: int = 2048,
          views: bool = False):
    """-> (bytes moved, {impl: fn}, check) for one configuration; every fn writes the same output."""
    if op in QUANT_OPS:
        return quant_cases(op, dst, sizes, chunks, dev, block, views)
    src = [torch.randn(s, device=dev) for s in sizes]
    n_el = sum(sizes)
    if op in ("flatten", "scatter"):
        flat = torch.empty(n_el, dtype=dst, device=dev)
        pieces = list(flat.split(sizes))
        moved = n_el * (4 + flat.element_size())
        if op == "flatten":
            fns = {"triton": lambda: tk.flatten(src, out=flat, backend="triton"),
                   "torch fallback": lambda: tk.flatten(src, out=flat, backend="torch"),
                   "torch.cat": lambda: torch.cat(src, out=flat),
                   "torch._foreach_copy_": lambda: torch._foreach_copy_(pieces, src)}
            return moved, fns, lambda: flat.clone()
        full = torch.randn(n_el, device=dev)  # scatter: an fp32 bucket into outputs of dtype dst
        outs = outputs(sizes, dst, dev, views)
        pieces = list(full.split(sizes))
        fns = {"triton": lambda: tk.scatter(full, outs, backend="triton"),
               "torch fallback": lambda: tk.scatter(full, outs, backend="torch"),
               "torch._foreach_copy_": lambda: torch._foreach_copy_(outs, pieces)}
        if dst == torch.float32:
            fns["torch.split_with_sizes_copy"] = lambda: torch.split_with_sizes_copy(full, sizes, out=outs)
        return moved, fns, lambda: torch.cat(outs)
    total = sum(-(-s // chunks) for s in sizes)
    buf = torch.empty(chunks, total, dtype=dst, device=dev)
    moved = n_el * 4 + buf.numel() * buf.element_size()
    if op == "chunk_cat":
        fns = {"triton": lambda: tk.chunk_cat(src, chunks, out=buf, backend="triton"),
               "torch fallback": lambda: tk.chunk_cat(src, chunks, out=buf, backend="torch"),
               "torch._chunk_cat": lambda: torch._chunk_cat(src, 0, chunks, out=buf)}
        return moved, fns, lambda: buf.clone()
    tk.chunk_cat(src, chunks, out=buf, backend="torch")  # chunk_split: the gathered buffer -> fp32 params
    outs = outputs(sizes, torch.float32, dev, views)
    fns = {"triton": lambda: tk.chunk_split(buf, outs, chunks, backend="triton"),
           "torch fallback": lambda: tk.chunk_split(buf, outs, chunks, backend="torch")}
    return moved, fns, lambda: torch.cat(outs)


def rotated(make, k: int):
    """`make()`'s case k times over (the same values: the generators are seeded alike), each call of an impl
    running on the next copy; the check reads the copy that the last call wrote."""
    copies = []
    for _ in range(k):
        torch.manual_seed(1234)
        copies.append(make())
    at = [0]

    def call(name):
        def fn():
            at[0] = (at[0] + 1) % k
            copies[at[0]][1][name]()
        return fn

    return copies[0][0], {name: call(name) for name in copies[0][1]}, lambda: copies[at[0]][2]()


def quant_cases(op: str, dtype: torch.dtype, sizes: list[int], chunks: int, dev: str, block: int, views: bool):
    src = [torch.randn(s, device=dev).to(dtype) for s in sizes]
    n, size = sum(sizes), src[0].element_size()
    lay = tk.quant_layout(n, block, chunks)
    wire_bytes = chunks * lay.row_bytes
    impls = {"triton": "triton", "torch fallback": "torch"}
    if op in ("quantize", "quantize+ef"):
        wire = torch.empty(wire_bytes, dtype=torch.uint8, device=dev)
        if op == "quantize":
            fns = {k: (lambda b=b: tk.quantize(src, block, num_chunks=chunks, out=wire, backend=b))
                   for k, b in impls.items()}
            return n * size + wire_bytes, fns, lambda: wire.clone()
        start = torch.randn(n, device=dev) * 1e-3
        res = torch.empty_like(start)

        def with_residual(b):  # the residual is rewritten each call: restart it so every impl sees the same
            res.copy_(start)
            tk.quantize(src, block, num_chunks=chunks, residual=res, out=wire, backend=b)

        fns = {k: (lambda b=b: with_residual(b)) for k, b in impls.items()}
        return n * size + wire_bytes + 2 * 4 * n, fns, lambda: torch.cat([wire, res.view(torch.uint8)])
    wire = tk.quantize([torch.randn(n, device=dev)], block, num_chunks=chunks, backend="torch").wire
    if op == "dequantize":
        outs = outputs(sizes, dtype, dev, views)
        fns = {k: (lambda b=b: tk.dequantize(wire, outs, block, num_chunks=chunks, backend=b))
               for k, b in impls.items()}
        return wire_bytes + n * size, fns, lambda: torch.cat(outs)
    out = torch.empty(lay.chunk, device=dev)
    fns = {k: (lambda b=b: tk.dequantize_sum(wire, chunks, block, out=out, backend=b)) for k, b in impls.items()}
    return wire_bytes + 4 * lay.chunk, fns, lambda: out.clone()


def timer(dev: str):
    if dev == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3

    def cpu(fn, reps=10):  # minimum, not median: a shared CPU box's noise only ever adds time
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return cpu


def run(args) -> list[dict]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    use_triton = dev == "cuda" and tk.triton_available()
    bench, gen, rows = timer(dev), torch.Generator().manual_seed(0), []
    if not use_triton:
        print(f"device {dev}: the Triton path needs a GPU (CUDA) and is not timed here; torch baselines only.")
    sizes_b = [b for b in (2**20 * 4**k for k in range(6)) if args.min_bytes <= b <= args.max_bytes]
    for op in args.ops:
        casts = CASTS if op in OPS else {"fp32": torch.float32} if op == "dequantize_sum" else QUANT_CASTS
        for cast, dst in casts.items():
            for n in args.tensors:
                for nbytes in sizes_b:
                    sizes = sizes_for(n, nbytes // 4, gen, args.unaligned)
                    key = dict(op=op, cast=cast, n=n, bytes=nbytes)
                    case = rotated(lambda: cases(op, dst, sizes, args.chunks, dev, args.block_size, args.views),
                                   max(1, args.rotate))
                    rows += measure(key, case, bench, use_triton, dev)
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                    report_group(rows, op, cast, n, nbytes)
                summarize(rows, op, cast, n)
    return rows


def summarize(rows, op, cast, n):
    """The smallest bucket from which Triton beat the torch fallback at every larger size measured."""
    mine = [r for r in rows if (r["op"], r["cast"], r["n"]) == (op, cast, n)]
    pts = sorted((r["bytes"], r["s"]) for r in mine if r["impl"] == "triton")
    ref = {r["bytes"]: r["s"] for r in mine if r["impl"] == "torch fallback"}
    if not pts or not ref:
        return
    wins = [b for b, s in pts if s <= ref[b]]
    from_ = next((b for b, _ in pts if all(b2 in wins for b2, _ in pts if b2 >= b)), None)
    where = f"from {from_ / 2**20:.0f} MB of fp32 ({from_ // 4} elements) up" if from_ else "at no size measured"
    print(f"{op:11s} {cast:10s} n={n:<5d} Triton beats the torch fallback {where}")


def measure(key: dict, case, bench, use_triton: bool, dev: str) -> list[dict]:
    moved, fns, out = case
    if not use_triton:
        fns.pop("triton")
    rows, results = [], {}
    for name, fn in fns.items():
        fn()
        results[name] = out()
        before = tk.table_stats()
        row = dict(key, impl=name, s=bench(fn), moved=moved)
        after = tk.table_stats()  # warmed up by the calls above: the timed ones build no table
        if name == "triton":
            row.update(builds=after.builds - before.builds, copies=after.pointer_copies - before.pointer_copies,
                       lookups=after.lookups - before.lookups)
        rows.append(row)
    ref = next(v for k, v in results.items() if k != "triton")
    assert all(torch.equal(v, ref) for v in results.values()), f"{key}: outputs differ"
    a = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    rows.append(dict(key, impl="copy", s=bench(lambda: b.copy_(a)), moved=moved))
    return rows


def report_group(rows, op, cast, n, nbytes):
    group = [r for r in rows if (r["op"], r["cast"], r["n"], r["bytes"]) == (op, cast, n, nbytes)]
    copy = next(r for r in group if r["impl"] == "copy")
    best_torch = min((r["s"] for r in group if r["impl"] not in ("triton", "copy")), default=None)
    for r in group:
        r["GB/s"] = r["moved"] / r["s"] / 1e9
        r["vs copy"] = r["GB/s"] / (copy["moved"] / copy["s"] / 1e9)
        r["vs torch"] = best_torch / r["s"] if best_torch and r["impl"] == "triton" else None
        vs = f"{r['vs torch']:.2f}x" if r["vs torch"] else ""
        tables = f"  tables built {r['builds']}, pointer copies {r['copies']}" if "builds" in r else ""
        print(f"{op:11s} {cast:10s} n={n:<5d} {nbytes / 2**20:7.0f} MB  {r['impl']:24s} {r['s'] * 1e6:10.1f} us "
              f"{r['GB/s']:8.1f} GB/s  {r['vs copy']:5.2f} of copy  {vs}{tables}")


def write(rows, out: Path, device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Device: {device}. GB/s = bytes read + written / median time; `vs copy` = fraction of a same-size "
             "`dst.copy_(src)`; `vs torch` = best torch baseline's time / Triton's time.", "",
             "| op | cast | tensors | bucket | impl | time (us) | GB/s | vs copy | vs torch | tables built / "
             "pointer copies / lookups (timed) |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        vs = f"{r['vs torch']:.2f}x" if r["vs torch"] else ""
        tables = f"{r['builds']} / {r['copies']} / {r['lookups']}" if "builds" in r else ""
        lines.append(f"| {r['op']} | {r['cast']} | {r['n']} | {r['bytes'] / 2**20:.0f} MB | {r['impl']} | "
                     f"{r['s'] * 1e6:.1f} | {r['GB/s']:.1f} | {r['vs copy']:.2f} | {vs} | {tables} |")
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    panels = sorted({(r["op"], r["cast"]) for r in rows}, key=lambda p: ((*OPS, *QUANT_OPS).index(p[0]), p[1]))
    ns = sorted({r["n"] for r in rows})
    colors = {impl: f"C{i}" for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows))}
    fig, axes = plt.subplots(len(panels), len(ns), figsize=(4.5 * len(ns), 3 * len(panels)), squeeze=False)
    for (op, cast), row_axes in zip(panels, axes):
        for n, ax in zip(ns, row_axes):
            for impl, color in colors.items():
                pts = [(r["bytes"] / 2**20, r["GB/s"]) for r in rows
                       if (r["op"], r["cast"], r["n"], r["impl"]) == (op, cast, n, impl)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, color=color, linestyle="--" if impl == "copy" else "-")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set(title=f"{op} {cast}, {n} tensors", xlabel="bucket (MB of fp32)", ylabel="GB/s", ylim=(0, None))
            ax.legend(fontsize=7)
    fig.suptitle(f"bucket copies on {device}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out / "kernels.png", dpi=90)
    print(f"wrote {out / 'kernels.md'} and {out / 'kernels.png'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    p.add_argument("--min-bytes", type=float, default=2**20)
    p.add_argument("--max-bytes", type=float, default=2**30 if gpu else 4 * 2**20,
                   help="default: 1 GB on a GPU, 4 MB on CPU")
    p.add_argument("--tensors", type=lambda s: [int(x) for x in s.split(",")], default=[10, 100, 1000])
    p.add_argument("--ops", type=lambda s: s.split(","), default=[*OPS, *QUANT_OPS])
    p.add_argument("--chunks", type=int, default=8, help="num_chunks for chunk_cat / chunk_split (shard group size)")
    p.add_argument("--block-size", type=int, default=2048, help="elements per scale for the quantized ops")
    p.add_argument("--unaligned", action="store_true", help="tensor sizes of any length (masked, scalar path)")
    p.add_argument("--rotate", type=int, default=1, help="copies of the inputs/outputs, one per call in turn")
    p.add_argument("--views", action="store_true", help="outputs as views of one buffer (a unit's parameters)")
    args = p.parse_args(argv)
    rows = run(args)
    device = torch.cuda.get_device_name() if gpu else "CPU (torch baselines only; Triton needs a GPU)"
    write(rows, args.out, device)


if __name__ == "__main__":
    main()
