"""The main job's end-of-run report: throughput, validation perplexity, model-state bytes per rank, a loss plot.

:class:`RunStats` is a callback that measures while the Trainer runs (on every rank: the bytes per rank are
gathered with one collective at the end of training, while the strategy still holds its shards);
:func:`write_report` runs on rank 0 after ``fit`` and writes ``report.json``, ``report.md`` and ``loss.png``
into the run's output folder, reading the losses from the CSV logger's ``metrics.csv``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import Any, Dict, List, Optional

import lightning as L
import torch
import torch.distributed as dist


def _to_float(v: Any) -> Optional[float]:
    if isinstance(v, torch.Tensor):
        v = v.detach().float().cpu().item()
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class RunStats(L.Callback):
    """Training time without validation, tokens seen, and the strategy's model-state bytes on every rank.

    ``model_state_bytes`` is read with ``getattr(trainer.strategy, "model_state_bytes", None)``: strategies
    that do not expose it (ddp) simply report nothing; a method is called, a property read as is."""

    def __init__(self) -> None:
        self.train_seconds = 0.0
        self.tokens_local = 0
        self.world_size = 1
        self.model_state_bytes: Optional[List[Any]] = None
        self._t0: Optional[float] = None

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        self.tokens_local += int(x.numel())

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self.world_size = trainer.world_size
        msb = getattr(trainer.strategy, "model_state_bytes", None)
        if msb is None:
            return
        local = msb() if callable(msb) else msb
        if isinstance(local, dict):
            local = {k: int(v) for k, v in local.items()}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            self.model_state_bytes = gathered
        else:
            self.model_state_bytes = [local]

    @property
    def tokens_per_second(self) -> Optional[float]:
        """All ranks together (they run the same number of equal batches)."""
        if self.train_seconds <= 0:
            return None
        return self.tokens_local * self.world_size / self.train_seconds


def read_metrics(metrics_csv: str) -> Dict[str, List[tuple]]:
    """``{column: [(step, value), ...]}`` for the loss columns of a CSVLogger ``metrics.csv``."""
    out: Dict[str, List[tuple]] = {}
    if not os.path.exists(metrics_csv):
        return out
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                out.setdefault(key, []).append((step, float(value)))
    return out


def plot_losses(metrics: Dict[str, List[tuple]], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train/loss", dict(alpha=0.6, lw=1)), ("val/loss", dict(marker="o", lw=2))):
        if metrics.get(key):
            steps, values = zip(*metrics[key])
            ax.plot(steps, values, label=key, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def write_report(trainer: "L.Trainer", stats: RunStats, out_dir: str, metrics_csv: str,
                 extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Writes ``report.json``, ``report.md`` and ``loss.png`` into ``out_dir``; returns the report. Rank 0."""
    metrics = read_metrics(metrics_csv)
    val = metrics.get("val/loss", [])
    cm = trainer.callback_metrics
    val_loss = _to_float(cm.get("val/loss")) if "val/loss" in cm else (val[-1][1] if val else None)
    val_ppl = _to_float(cm.get("val/ppl")) if "val/ppl" in cm else None
    report: Dict[str, Any] = {
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "tokens_per_second": stats.tokens_per_second,
        "train_seconds": stats.train_seconds,
        "tokens": stats.tokens_local * stats.world_size,
        "val_loss_first": val[0][1] if val else None,
        "val_loss_final": val_loss,
        "val_ppl_final": val_ppl,
        "val_loss_history": val,
        "model_state_bytes_per_rank": stats.model_state_bytes,
        **(extra or {}),
    }
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)

    lines = [
        "# Run report",
        "",
        f"- strategy: {report['strategy']}, world size {report['world_size']}",
        f"- optimizer steps: {report['steps']}",
        f"- throughput: {report['tokens_per_second']:.0f} tokens/s (all ranks, training batches only, "
        f"{report['train_seconds']:.1f} s)" if report["tokens_per_second"] else "- throughput: n/a",
        f"- validation loss: {_fmt(report['val_loss_first'])} (step {val[0][0]}) -> {_fmt(val_loss)} (step "
        f"{val[-1][0]})" if val else f"- validation loss: {_fmt(val_loss)}",
        f"- validation perplexity: {val_ppl:.3f}" if val_ppl is not None and math.isfinite(val_ppl)
        else "- validation perplexity: n/a",
    ]
    if stats.model_state_bytes:
        lines += ["", "| rank | " + " | ".join(_bytes_keys(stats.model_state_bytes)) + " |",
                  "|---|" + "---|" * len(_bytes_keys(stats.model_state_bytes))]
        for rank, b in enumerate(stats.model_state_bytes):
            cells = [_mib(b.get(k)) for k in _bytes_keys(stats.model_state_bytes)] if isinstance(b, dict) else [str(b)]
            lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    else:
        lines.append("- model-state bytes per rank: not exposed by this strategy")
    lines += ["", "![loss](loss.png)", ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    plot_losses(metrics, os.path.join(out_dir, "loss.png"),
                title=f"{report['strategy']}, {report['world_size']} ranks, {report['steps']} steps")
    return report


def _bytes_keys(per_rank: List[Any]) -> List[str]:
    first = per_rank[0]
    return list(first.keys()) if isinstance(first, dict) else ["bytes"]
