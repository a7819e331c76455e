"""The main job with and without int8 replica all-reduce: both validation-loss curves in one plot.

    lightning-mics-train strategy.sharded_data_parallel_degree=2 trainer.devices=4                  # fp32
    lightning-mics-train strategy.sharded_data_parallel_degree=2 trainer.devices=4 \\
        strategy.quantize_gradients=true                                                           # int8
    python benchmarks/quant_main_job.py outputs/<fp32 run> outputs/<int8 run> [--png benchmarks/quant_main_job.png]

Reads each run's report.json (written by the job on rank 0) and prints a markdown table: final validation loss,
the relative difference, replica all-reduce bytes per optimizer step (the telemetry's median), training time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: str) -> dict:
    return json.loads((Path(run) / "report.json").read_text())


def replica_bytes(report: dict) -> float:
    return sum(c["bytes"] for c in report["comm_per_step"]["collectives"]
               if c["op"] == "all_reduce" and c["group"] == "replicate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fp32")
    ap.add_argument("int8")
    ap.add_argument("--png", default="benchmarks/quant_main_job.png")
    args = ap.parse_args()
    runs = {"fp32 replica all-reduce": load(args.fp32), "int8 replica all-reduce (quantize_gradients=true)":
            load(args.int8)}
    base, quant = runs.values()
    rel = (quant["val_loss_final"] - base["val_loss_final"]) / base["val_loss_final"]
    print("| run | steps | val loss first -> final | replica all-reduce bytes/step | train s |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['steps']} | {r['val_loss_first']:.4f} -> {r['val_loss_final']:.4f} | "
              f"{replica_bytes(r):.0f} | {r['train_seconds']:.0f} |")
    print(f"\nint8 / fp32: final validation loss {rel:+.2%}, replica bytes {replica_bytes(quant) / replica_bytes(base):.3f}x")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in runs.items():
        steps, losses = zip(*r["val_loss_history"])
        ax.plot(steps, losses, marker="o", ms=3, label=f"{name}: {r['val_loss_final']:.4f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"main job, {base['world_size']} ranks, s=2: fp32 vs int8 replica all-reduce")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
