"""The main job's end-of-run report: throughput, validation loss, model-state bytes per rank against the
unsharded figure, bytes per collective and group per optimizer step, and a loss plot.

:class:`RunStats` is a callback that measures while the Trainer runs, on every rank:

- training time (training batches only) and the samples and tokens they held;
- the strategy's per-rank model-state bytes, ``trainer.strategy.model_state_bytes()``, read before each
  optimizer step (when the step's gradients exist) and gathered from every rank with one collective at the end
  of training;
- the strategy's telemetry after each optimizer step, ``trainer.strategy.comm_stats`` (``{"comm/<op>/<group>/
  bytes": ..., "comm/<op>/<group>/calls": ...}`` for that step);
- the *unsharded* model-state bytes, measured when fit has ended and the module and optimizer are plain again
  (as after DDP): the parameters, one gradient per trainable parameter, and the optimizer's state tensors, each
  in its own dtype: what one plain process training this module with this optimizer holds.

Both strategy attributes are read through ``getattr``, so a strategy without them (Lightning's DDP) still gets
a report, with those parts marked as not exposed. :func:`write_report` runs on rank 0 after ``fit`` and writes
``report.json``, ``report.md`` and ``loss.png`` into the run's output folder (the losses come from the CSV
logger's ``metrics.csv``; no plot when none was logged); :func:`summary_lines` gives the lines the app prints
with a ``[report]`` prefix, among them where a resumed run started and where a stopped one stopped. Every value
is printed in its unit (:func:`format_size`, :func:`format_value`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import lightning as L
import torch
import torch.distributed as dist

STATE_KEYS = ("params", "grads", "optimizer", "total")


def _to_float(v: Any) -> Optional[float]:
    if isinstance(v, torch.Tensor):
        v = v.detach().float().cpu().item()
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plain_model_state_bytes(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> Dict[str, int]:
    """Bytes one plain process holds for ``module`` trained with ``optimizers``: every (unique) parameter, a
    gradient of the same size and dtype for each trainable one, and every non-scalar optimizer state tensor
    (Adam's ``exp_avg``/``exp_avg_sq``; the 0-d ``step`` counters are left out, as the strategy leaves them
    out of its per-rank figure). Measured on the real tensors, so call it when they are full (after fit)."""
    params = sum(_nbytes(p) for p in module.parameters())
    grads = sum(_nbytes(p) for p in module.parameters() if p.requires_grad)
    opt = 0
    for o in optimizers:
        o = getattr(o, "_optimizer", o)  # Lightning's LightningOptimizer wrapper
        for state in o.state.values():
            opt += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        for item in batch:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


class RunStats(L.Callback):
    """Training time, samples and tokens, per-rank and unsharded model-state bytes, per-step comm telemetry.

    Tokens are counted when a batch's first tensor holds integer ids (a language model's input): its number of
    elements. Samples are its first dimension."""

    def __init__(self) -> None:
        self.train_seconds = 0.0
        self.samples_local = 0
        self.tokens_local = 0
        self.world_size = 1
        self.model_state_bytes: Optional[List[Any]] = None  # per rank, from the strategy
        self.unsharded_bytes: Optional[Dict[str, int]] = None
        self.comm_steps: List[Dict[str, float]] = []  # trainer.strategy.comm_stats after each optimizer step
        self.start_step = 0  # the global step training started from (> 0 when resumed)
        self._t0: Optional[float] = None
        self._last_step = -1
        self._step_state: Any = None  # this rank's model-state bytes before the latest optimizer step

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self.start_step = self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None
        x = _first_tensor(batch)
        if x is not None:
            self.samples_local += int(x.shape[0]) if x.dim() else 1
            if not x.is_floating_point() and not x.is_complex():
                self.tokens_local += int(x.numel())
        if trainer.global_step != self._last_step:  # an optimizer step has just run
            self._last_step = trainer.global_step
            stats = getattr(trainer.strategy, "comm_stats", None)
            if stats:
                self.comm_steps.append({k: float(v) for k, v in stats.items()})

    @staticmethod
    def _local_state_bytes(trainer: "L.Trainer") -> Any:
        msb = getattr(trainer.strategy, "model_state_bytes", None)
        if msb is None:
            return None
        local = msb() if callable(msb) else msb
        return {k: int(v) for k, v in local.items()} if isinstance(local, dict) else local

    def on_before_optimizer_step(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                                 optimizer: Any) -> None:
        # Read while a step's gradients exist (and, after the first step, the optimizer's state): the model
        # state a rank holds during training, comparable with the unsharded figure, which counts both.
        self._step_state = self._local_state_bytes(trainer)

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self.world_size = trainer.world_size
        local = self._step_state if self._step_state is not None else self._local_state_bytes(trainer)
        if local is None:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            self.model_state_bytes = gathered
        else:
            self.model_state_bytes = [local]

    def on_fit_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        # after the strategy's teardown: the module and the optimizer are plain (full) again
        self.unsharded_bytes = plain_model_state_bytes(pl_module, trainer.optimizers)

    @property
    def tokens_per_second(self) -> Optional[float]:
        """All ranks together (they run the same number of equal batches); None when no token ids were seen."""
        if self.train_seconds <= 0 or self.tokens_local == 0:
            return None
        return self.tokens_local * self.world_size / self.train_seconds

    @property
    def samples_per_second(self) -> Optional[float]:
        if self.train_seconds <= 0:
            return None
        return self.samples_local * self.world_size / self.train_seconds

    def comm_per_step(self) -> Optional[Dict[str, Any]]:
        """The median over the sampled optimizer steps of each telemetry value (a key missing in a step counts
        as 0 there), so the steps whose window also held a validation pass do not skew it."""
        if not self.comm_steps:
            return None
        keys = sorted({k for step in self.comm_steps for k in step})
        median = {k: statistics.median(step.get(k, 0.0) for step in self.comm_steps) for k in keys}
        collectives: Dict[Tuple[str, str], Dict[str, Any]] = {}
        other: Dict[str, float] = {}
        for key, value in median.items():
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "comm" and parts[3] in ("bytes", "calls"):
                entry = collectives.setdefault((parts[1], parts[2]), {"op": parts[1], "group": parts[2],
                                                                      "bytes": 0.0, "calls": 0.0})
                entry[parts[3]] = value
            else:
                other[key] = value
        return {"steps_sampled": len(self.comm_steps), "statistic": "median over optimizer steps, rank 0",
                "collectives": [c for c in collectives.values() if c["calls"] or c["bytes"]], "other": other}


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


def plot_losses(metrics: Dict[str, List[tuple]], path: str, title: str = "") -> bool:
    """Draws the logged losses into ``path``; draws nothing and returns False when none was logged (a run shorter
    than ``trainer.log_every_n_steps`` with no validation)."""
    curves = [(key, style) for key, style in (("train/loss", dict(alpha=0.6, lw=1)), ("val/loss", dict(lw=2)))
              if metrics.get(key)]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in curves:
        steps, values = zip(*metrics[key])
        marker = "o" if key == "val/loss" or len(steps) < 3 else None
        ax.plot(steps, values, label=key, marker=marker, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (as the module logs it)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _size_or_na(n: Optional[float]) -> str:
    return "n/a" if n is None else format_size(n)


def format_value(key: str, value: Optional[float]) -> str:
    """``value`` in the unit its key names: ``*_bytes`` in B/KiB/MiB/GiB, ``*_s`` in s or ms, ``*elements*`` as a
    count of elements; other values with 4 decimals."""
    if value is None:
        return "n/a"
    if key.endswith("_bytes"):
        return format_size(value)
    if key.endswith("_s"):
        return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"
    if "elements" in key:
        return f"{value:,.0f} elements"
    return f"{value:.4f}"


def model_state_summary(per_rank: Optional[List[Any]], unsharded: Optional[Dict[str, int]]) -> Dict[str, Any]:
    """``{"unsharded": {...}, "per_rank": [{..., "fraction_of_unsharded": x}, ...] | None}``."""
    ranks = None
    if per_rank:
        ranks = []
        for b in per_rank:
            entry = dict(b) if isinstance(b, dict) else {"total": int(b)}
            total, full = entry.get("total"), (unsharded or {}).get("total")
            entry["fraction_of_unsharded"] = total / full if total is not None and full else None
            ranks.append(entry)
    return {"unsharded": unsharded, "per_rank": ranks}


def _how_it_ran(report: Dict[str, Any]) -> List[str]:
    lines = []
    if report.get("resumed_from"):
        lines.append(f"resumed from {report['resumed_from']} at optimizer step {report.get('start_step')}")
    if report.get("stopped_by"):
        then = (f"continue with ckpt_path={report['last_checkpoint']}" if report.get("last_checkpoint")
                else "no checkpoint was saved")
        lines.append(f"stopped by {report['stopped_by']} after optimizer step {report['steps']}; {then}")
    return lines


def quorum_line(ft: Optional[Dict[str, Any]]) -> Optional[str]:
    """The quorum as this replica group saw it (``strategy.fault_tolerance_summary``), or None without it."""
    if not ft:
        return None
    return (f"fault tolerance: group {ft['group']} of {ft['groups']}, {ft['steps']} {ft.get('decisions', 'steps')} here, {ft['committed']} "
            f"committed, {ft['failed']} not taken; {ft['participants_min']}-{ft['participants_max']} groups in the "
            f"quorum, {ft['quorum_changes']} change(s); {ft['recoveries']} recovery(ies) from a live peer "
            f"({', '.join(f'{s:.1f} s' for s in ft['heal_seconds']) or 'none'}), {ft['peers_healed']} peer(s) "
            f"healed from this group; the job's committed steps: {ft['committed_steps']}")


def summary_lines(report: Dict[str, Any]) -> List[str]:
    """The report in a few lines of text (the app prints them with a ``[report]`` prefix)."""
    tps, sps = report.get("tokens_per_second"), report.get("samples_per_second")
    speed = f"{tps:.0f} tokens/s" if tps else (f"{sps:.1f} samples/s" if sps else "throughput n/a")
    lines = [f"{report['strategy']} on {report['world_size']} ranks, {report['steps']} optimizer steps, {speed} "
             f"(all ranks, {report['train_seconds']:.1f} s in training batches)"]
    lines.append(f"validation loss {_fmt(report['val_loss_first'])} -> {_fmt(report['val_loss_final'])}, "
                 f"perplexity {_fmt(report['val_ppl_final'])}")
    lines += _how_it_ran(report)
    lines += [line for line in [quorum_line(report.get("fault_tolerance"))] if line]
    ms = report["model_state"]
    full = (ms.get("unsharded") or {}).get("total")
    if ms.get("per_rank"):
        for rank, b in enumerate(ms["per_rank"]):
            frac = b.get("fraction_of_unsharded")
            parts = " + ".join(f"{k} {format_size(b[k])}" for k in ("params", "grads", "optimizer") if k in b)
            lines.append(f"model state, rank {rank}: {format_size(b['total'])} per rank"
                         + (f", {frac:.2f}x of {format_size(full)} unsharded" if frac is not None else "")
                         + (f" ({parts})" if parts else ""))
    else:
        lines.append(f"model state: {format_size(full) if full is not None else 'n/a'} unsharded; per-rank bytes not "
                     f"exposed by {report['strategy']}")
    comm = report.get("comm_per_step")
    if comm and comm["collectives"]:
        cells = [f"{c['op']}/{c['group']} {format_size(c['bytes'])} in {c['calls']:g} "
                 f"call{'' if c['calls'] == 1 else 's'}" for c in comm["collectives"]]
        lines.append(f"comm per optimizer step (rank 0, median of {comm['steps_sampled']} steps): " + "; ".join(cells))
    else:
        lines.append(f"comm per optimizer step: not exposed by {report['strategy']}")
    return lines


def write_report(trainer: "L.Trainer", stats: RunStats, out_dir: str, metrics_csv: str,
                 extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Writes ``report.json``, ``report.md`` and (when losses were logged) ``loss.png`` into ``out_dir``; returns
    the report, whose ``files`` lists what was written. Rank 0."""
    metrics = read_metrics(metrics_csv)
    val = metrics.get("val/loss", [])
    cm = trainer.callback_metrics
    val_loss = _to_float(cm.get("val/loss")) if "val/loss" in cm else (val[-1][1] if val else None)
    val_ppl = _to_float(cm.get("val/ppl")) if "val/ppl" in cm else None
    report: Dict[str, Any] = {
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "start_step": stats.start_step,
        "tokens_per_second": stats.tokens_per_second,
        "samples_per_second": stats.samples_per_second,
        "train_seconds": stats.train_seconds,
        "tokens": stats.tokens_local * stats.world_size,
        "samples": stats.samples_local * stats.world_size,
        "val_loss_first": val[0][1] if val else None,
        "val_loss_final": val_loss,
        "val_ppl_final": val_ppl if val_ppl is not None and math.isfinite(val_ppl) else None,
        "val_loss_history": val,
        "model_state": model_state_summary(stats.model_state_bytes, stats.unsharded_bytes),
        "comm_per_step": stats.comm_per_step(),
        "fault_tolerance": getattr(trainer.strategy, "fault_tolerance_summary", None),
        **(extra or {}),
    }
    plotted = plot_losses(metrics, os.path.join(out_dir, "loss.png"),
                          title=f"{report['strategy']}, {report['world_size']} ranks, {report['steps']} steps")
    report["files"] = ["report.md", "report.json"] + ["loss.png"] * plotted
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)

    summary = summary_lines(report)
    lines = ["# Run report", "", *[f"- {line}" for line in summary[:2] + _how_it_ran(report)]]
    lines += [f"- {line}" for line in [quorum_line(report["fault_tolerance"])] if line]
    ms = report["model_state"]
    if val:
        lines.append("- validation loss by step: " + ", ".join(f"{v:.3f} ({s})" for s, v in val))
    lines += ["", "## Model state (parameters, gradients, optimizer state)", ""]
    unsharded = ms.get("unsharded")
    rows = list(enumerate(ms["per_rank"])) if ms.get("per_rank") else []
    lines += ["| | " + " | ".join(STATE_KEYS) + " | fraction of unsharded |", "|---|" + "---|" * (len(STATE_KEYS) + 1)]
    for rank, b in rows:
        frac = b.get("fraction_of_unsharded")
        lines.append(f"| rank {rank} | " + " | ".join(_size_or_na(b.get(k)) for k in STATE_KEYS)
                     + f" | {'n/a' if frac is None else f'{frac:.2f}x'} |")
    if unsharded:
        lines.append("| unsharded (one plain process) | " + " | ".join(_size_or_na(unsharded.get(k)) for k in STATE_KEYS)
                     + " | 1.00x |")
    if not rows:
        lines += ["", f"Per-rank bytes are not exposed by {report['strategy']}."]
    lines += ["", "Unsharded: the module's parameters, a gradient per trainable parameter and the optimizer's "
              "state tensors, measured on the plain module and optimizer after fit.", ""]
    comm = report["comm_per_step"]
    lines += ["## Communication per optimizer step", ""]
    if comm and comm["collectives"]:
        lines += [f"Telemetry of the strategy (`trainer.strategy.comm_stats`), {comm['statistic']} "
                  f"({comm['steps_sampled']} steps).", "",
                  "| collective | group | bytes | calls |", "|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['group']} | {format_size(c['bytes'])} | {c['calls']:g} |"
                  for c in comm["collectives"]]
        if comm["other"]:
            lines += ["", *[f"- {k}: {format_value(k, v)}" for k, v in comm["other"].items()]]
    else:
        lines.append(f"Not exposed by {report['strategy']}.")
    lines += ["", "![loss](loss.png)" if plotted else "No loss was logged, so no plot: the run had fewer optimizer "
              "steps than `trainer.log_every_n_steps` and no validation.", ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    return report
