"""DiLoCo's quality against exact sync: the main job's validation loss at equal tokens.

Runs the main job (``python -m lightning_mics.app.train``) once per configuration, on 4 CPU ranks with s = 2 (two
replica groups), the same seed, data, model and number of optimizer steps (so the same tokens), and prints a markdown
table of each run's validation loss at every validation point, with the final loss relative to exact sync, and a plot
of the loss against tokens (``diloco_quality.png`` under ``--out``):

    python benchmarks/diloco_quality.py            # exact, H = 4, 8, 16, 32 and 16 with int8; 192 steps each
    python benchmarks/diloco_quality.py --steps 96 --runs exact diloco:16 diloco:16:int8

A run is ``exact`` or ``diloco:<H>[:int8][:lr=<x>][:momentum=<x>][:fragments=<F>][:delay=<tau>][:mixing=<alpha>]``
(int8: ``quantize_gradients=True``, the pseudo-gradients in int8 blocks; lr, momentum: the outer SGD's, else DiLoCo's
0.7 and 0.9 with Nesterov; momentum=0 turns Nesterov off; fragments, delay, mixing: streaming DiLoCo's
``sync_fragments``, ``sync_delay``, ``fragment_mixing``, e.g. ``diloco:16:fragments=4:delay=1:mixing=0.5``).
Each job writes its run folder under ``--out`` (default ``outputs/diloco_quality``); the table reads their
``report.json``. Validation runs every ``--val-every`` optimizer steps; keep it a multiple of every H, so that it
always sees the synced model (between syncs each replica group holds its own). On the 2-core CPU machine 192 steps
take about 3 minutes per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List


STREAMING = {"fragments": ("sync_fragments", int), "delay": ("sync_delay", int), "mixing": ("fragment_mixing", float)}


def syncs(run: str, steps: int) -> int:
    """The replica all-reduces of a run: every step (exact), every H steps, or one fragment's every H / F."""
    if run == "exact":
        return steps
    parts = dict(p.partition("=")[::2] for p in run.split(":")[2:])
    return steps // (int(run.split(":")[1]) // int(parts.get("fragments", 1)))


def overrides(run: str, steps: int, val_every: int) -> List[str]:
    base = ["trainer.devices=4", "strategy.sharded_data_parallel_degree=2", f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={val_every}", "callbacks.progress_bar.refresh_rate=0",
            f"callbacks.checkpoint.every_n_train_steps={steps}"]
    if run == "exact":
        return base
    parts = run.split(":")
    if parts[0] != "diloco" or len(parts) < 2 or not parts[1].isdigit():
        raise SystemExit(f"a run is 'exact' or 'diloco:<H>[:int8][:lr=<x>][:momentum=<x>][:fragments=<F>]"
                         f"[:delay=<tau>][:mixing=<alpha>]', got {run!r}")
    out = base + ["strategy.replica_sync=diloco", f"strategy.sync_every={int(parts[1])}"]
    for part in parts[2:]:
        key, _, value = part.partition("=")
        if part == "int8":
            out.append("strategy.quantize_gradients=true")
        elif key in ("lr", "momentum") and value:
            out.append(f"strategy.outer_{key}={float(value)}")
            if key == "momentum" and float(value) == 0:
                out.append("strategy.outer_nesterov=false")
        elif key in STREAMING and (value if STREAMING[key][1] is int else value.replace(".", "", 1)).isdigit():
            name, kind = STREAMING[key]
            out.append(f"strategy.{name}={kind(value)}")
        else:
            raise SystemExit(f"{run!r}: {part!r} is not int8, lr=<x>, momentum=<x>, fragments=<F>, delay=<tau> or "
                             "mixing=<alpha>")
    return out


def run_job(run: str, steps: int, val_every: int, out: Path, reuse: bool = False) -> Dict:
    run_id = run.replace(":", "-").replace("=", "")
    folder = out / run_id
    if reuse and (folder / "report.json").exists():  # a run of an earlier call with the same --out
        report = json.loads((folder / "report.json").read_text())
        if report["steps"] == steps:
            return {**report, "wall_s": float("nan")}
    cmd = [sys.executable, "-m", "lightning_mics.app.train", *overrides(run, steps, val_every), f"run_id={run_id}",
           f"hydra.run.dir={folder}"]
    start = time.monotonic()
    log = out / f"{run_id}.log"
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ))
    if code != 0:
        raise SystemExit(f"{run}: the job failed (exit {code}); see {log}")
    report = json.loads((folder / "report.json").read_text())
    report["wall_s"] = time.monotonic() - start
    return report


def table(runs: List[str], reports: Dict[str, Dict]) -> str:
    points = [step for step, _ in reports[runs[0]]["val_loss_history"]]
    exact = reports.get("exact")
    head = "| run | tokens | " + " | ".join(f"val loss @ step {p + 1}" for p in points) + \
        " | final vs exact | replica syncs |"
    lines = [head, "|" + "---|" * (len(points) + 4)]
    for run in runs:
        r = reports[run]
        losses = dict((s, v) for s, v in r["val_loss_history"])
        rel = f"{(r['val_loss_final'] / exact['val_loss_final'] - 1) * 100:+.1f}%" if exact else "-"
        lines.append(f"| {run} | {r['tokens']:,} | " + " | ".join(f"{losses.get(p, float('nan')):.4f}" for p in points)
                     + f" | {rel} | {syncs(run, r['steps'])} |")
    return "\n".join(lines)


def plot(runs: List[str], reports: Dict[str, Dict], path: Path) -> None:
    """Left: validation loss against tokens, a line per run (exact sync in black, one colour per H; int8 dashed,
    streaming dotted, both dash-dot). Right: the final loss above exact sync's against H, a line per variant, the
    issue's 3% aim dashed. Settings every DiLoCo run shares go into the title, not into each label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diloco = [run for run in runs if run != "exact"]
    every = sorted({int(run.split(":")[1]) for run in diloco})
    shared = set.intersection(*(set(run.split(":")[2:]) for run in diloco)) if diloco else set()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    styles = {(False, False): "-", (True, False): "--", (False, True): ":", (True, True): "-."}
    finals: Dict[tuple, Dict[int, float]] = {}
    exact = reports.get("exact")
    for run in runs:
        r = reports[run]
        tokens_per_step = r["tokens"] / r["steps"]
        xs = [(step + 1) * tokens_per_step / 1e6 for step, _ in r["val_loss_history"]]
        ys = [v for _, v in r["val_loss_history"]]
        if run == "exact":
            ax.plot(xs, ys, color="k", lw=2, marker="o", label="exact sync")
            continue
        parts = run.split(":")
        int8, streaming = "int8" in parts, any(p.startswith("fragments=") for p in parts)
        label = ":".join(parts[:2] + [p for p in parts[2:] if p not in shared])
        ax.plot(xs, ys, color=f"C{every.index(int(parts[1]))}", marker=".", label=label, ls=styles[int8, streaming])
        if exact:
            finals.setdefault((int8, streaming), {})[int(parts[1])] = (
                (r["val_loss_final"] / exact["val_loss_final"] - 1) * 100)
    title = "DiLoCo across 2 replica groups (4 ranks, s = 2)" + (f"; all runs: {', '.join(sorted(shared))}"
                                                                  if shared else "")
    fig.suptitle(title, fontsize=10)
    ax.set_xlabel("tokens, millions (all ranks)")
    ax.set_ylabel("validation loss")
    ax.set_title("validation loss at equal tokens", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="upper right")
    names = {(False, False): "blocking", (True, False): "blocking, int8", (False, True): "streaming",
             (True, True): "streaming, int8"}
    for key, by_h in sorted(finals.items()):
        hs = sorted(by_h)
        bx.plot(hs, [by_h[h] for h in hs], color="k", ls=styles[key], marker="o", label=names[key])
    if finals:
        bx.axhline(3.0, color="r", ls="--", lw=1, label="aim at H = 16: 3%")
        bx.set_xscale("log", base=2)
        bx.set_xticks(every, [str(h) for h in every])
    bx.set_xlabel("H (inner steps per sync)")
    bx.set_ylabel("final validation loss above exact sync, %")
    bx.set_title("after the last step", fontsize=9)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+",
                    default=["exact", "diloco:4", "diloco:8", "diloco:16", "diloco:32", "diloco:16:int8"])
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--val-every", type=int, default=32, help="validation interval, in optimizer steps")
    ap.add_argument("--out", type=Path, default=Path("outputs/diloco_quality"))
    ap.add_argument("--reuse", action="store_true", help="take a run's report from --out where it exists")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for run in args.runs:
        reports[run] = run_job(run, args.steps, args.val_every, args.out, args.reuse)
        print(f"{run}: val loss {reports[run]['val_loss_final']:.4f} after {reports[run]['tokens']:,} tokens "
              f"({reports[run]['wall_s']:.0f} s)", flush=True)
    text = table(args.runs, reports)
    (args.out / "table.md").write_text(text + "\n")
    plot(args.runs, reports, args.out / "diloco_quality.png")
    print(text)
    print(f"plot: {args.out / 'diloco_quality.png'}")


if __name__ == "__main__":
    main()
