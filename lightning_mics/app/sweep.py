"""The end of a sweep (``lightning-mics-train -m ...``): one table and one plot comparing its jobs, from the
``report.json`` each job wrote. ``sweep.md`` holds the table, ``sweep.png`` the validation loss of every job by
step beside its throughput. Written by :class:`lightning_mics.app.runs.SweepSummary` into the sweep's folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

from omegaconf import OmegaConf

from lightning_mics.app.report import format_size, format_value


def _jobs(sweep_dir: str) -> List[Tuple[str, List[str], Dict[str, Any]]]:
    """``(job folder name, its overrides, its report)`` for every job folder that holds a report, by job number."""
    jobs = []
    folders = [d for d in Path(sweep_dir).iterdir() if d.is_dir()]
    for d in sorted(folders, key=lambda d: (0, int(d.name), "") if d.name.isdigit() else (1, 0, d.name)):
        report = d / "report.json"
        if not report.is_file():
            continue
        overrides_file = d / ".hydra" / "overrides.yaml"
        overrides = list(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
        jobs.append((d.name, [str(o) for o in overrides], json.loads(report.read_text())))
    return jobs


def _row(name: str, label: str, r: Dict[str, Any]) -> List[str]:
    tps, sps = r.get("tokens_per_second"), r.get("samples_per_second")
    speed = f"{tps:.0f} tokens/s" if tps else (f"{sps:.1f} samples/s" if sps else "n/a")
    ms = r.get("model_state") or {}
    per_rank = ms.get("per_rank") or []
    state = "n/a (not exposed)"
    if per_rank:
        worst = max(per_rank, key=lambda b: b.get("total", 0))
        frac = worst.get("fraction_of_unsharded")
        state = format_size(worst["total"]) + (f" ({frac:.2f}x)" if frac is not None else "")
    comm = r.get("comm_per_step") or {}
    comm_bytes = sum(c["bytes"] for c in comm.get("collectives") or [])
    return [name, label or "(defaults)", r.get("strategy", "?"), str(r.get("world_size", "?")),
            str(r.get("steps", "?")), speed, format_value("loss", r.get("val_loss_final")), state,
            format_size(comm_bytes) if comm.get("collectives") else "n/a (not exposed)",
            f"{r.get('train_seconds', 0.0):.1f} s"]


def write_summary(sweep_dir: str) -> List[str]:
    """Writes ``sweep.md`` and ``sweep.png`` into ``sweep_dir``; returns the table's lines (empty: no reports)."""
    jobs = _jobs(sweep_dir)
    if not jobs:
        return []
    common = set.intersection(*(set(o) for _, o, _ in jobs))
    labels = [" ".join(o for o in overrides if o not in common) for _, overrides, _ in jobs]
    header = ["job", "overrides", "strategy", "ranks", "steps", "throughput", "val loss (final)",
              "model state per rank (max; x unsharded)", "comm per step (rank 0)", "time in training batches"]
    rows = [_row(name, label, r) for (name, _, r), label in zip(jobs, labels)]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    shared = f"Overrides common to every job: `{' '.join(sorted(common))}`." if common else ""
    with open(os.path.join(sweep_dir, "sweep.md"), "w") as f:
        f.write("\n".join(["# Sweep", "", *table, "", shared, "", "![sweep](sweep.png)", ""]))
    _plot(jobs, labels, os.path.join(sweep_dir, "sweep.png"))
    return [f"[sweep] {len(jobs)} jobs compared in {sweep_dir}/sweep.md and sweep.png", *table]


def _plot(jobs: List[Tuple[str, List[str], Dict[str, Any]]], labels: List[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    names = [f"{name}: {label or 'defaults'}" for (name, _, _), label in zip(jobs, labels)]
    for name, (_, _, r) in zip(names, jobs):
        history = r.get("val_loss_history") or []
        if history:
            steps, values = zip(*history)
            loss_ax.plot(steps, values, marker="o", lw=1.5, label=name)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("validation loss")
    loss_ax.grid(alpha=0.3)
    if loss_ax.lines:
        loss_ax.legend(fontsize=8)
    speeds = [r.get("tokens_per_second") or r.get("samples_per_second") or 0.0 for _, _, r in jobs]
    unit = "tokens/s" if any(r.get("tokens_per_second") for _, _, r in jobs) else "samples/s"
    bars = speed_ax.barh(range(len(jobs)), speeds, color="tab:blue")
    speed_ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    speed_ax.locator_params(axis="x", nbins=4)
    speed_ax.set_yticks(range(len(jobs)), [n[:40] for n in names], fontsize=8)
    speed_ax.invert_yaxis()
    speed_ax.set_xlabel(f"throughput ({unit}, all ranks)")
    speed_ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
