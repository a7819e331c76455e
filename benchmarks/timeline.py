"""What holds a step on the shaped link, from the collectives' timeline (``cluster.py --timeline``).

[Note: what holds a step]
``cluster_rank.py --timeline`` stamps, per rank, every collective's issue, its completion (gloo's future, where the Work
has one) and its wait, and each optimizer step's end and resume ([Note: the benchmark's communication clock] in
cluster_rank.py). Per timed step of each rank, from the cross-host collectives of at least ``MIN_BYTES``:
  before_link_s   from the step's start to the issue of its first cross-host collective: the compute that
                  no overlap can hide from the link (forward, and the backward up to the first unit whose
                  gradients are ready for the replica all-reduce)
  link_span_s     from that issue to the completion of the step's last cross-host collective: at least the
                  link floor (bytes / rate); ``link_span_s / floor_s`` near 1 means the link never idled
  after_link_s    from that completion to the step's end: the optimizer step and what follows the last
                  cross-host byte
so step = before + span + after. A step can only get shorter than before + floor + after by starting the
cross-host traffic earlier, by idling the link less, or by sending fewer bytes.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

MIN_BYTES = 1 << 16  # the replicated parameters' flags all-reduce (a few hundred bytes) is latency, not link time


def _windows(timeline: List[List[Any]], warmup: int) -> List[tuple]:
    """(start, end) of every timed optimizer step: from the previous step's resume to this step's end."""
    resume = {int(n): t for t, ev, _, n in timeline if ev == "resume"}
    end = {int(n): t for t, ev, _, n in timeline if ev == "step"}
    return [(resume[k - 1], end[k]) for k in sorted(end) if k > warmup and k - 1 in resume]


def _rank_phases(timeline: List[List[Any]], warmup: int) -> List[Dict[str, float]]:
    out = []
    for start, end in _windows(timeline, warmup):
        inside = [(t, ev, nb) for t, ev, key, nb in timeline if start <= t <= end and key.endswith("/cross")]
        issues = [t for t, ev, nb in inside if ev == "issue" and nb >= MIN_BYTES]
        finished = [t for t, ev, _ in inside if ev in ("done", "waited")]
        if not issues or not finished:
            continue
        first, last = min(issues), max(t for t in finished if t >= min(issues))
        out.append(dict(before_link_s=first - start, link_span_s=last - first, after_link_s=end - last))
    return out


def phases(records: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Medians over ranks and timed steps of the records' timelines; {} where no run has a timeline."""
    rows = [p for rec in records for r in rec["ranks"] if r.get("timeline")
            for p in _rank_phases(r["timeline"], rec.get("timed_from", rec["warmup"] + 1) - 1)]
    if not rows:
        return {}
    return {k: statistics.median(p[k] for p in rows) for k in rows[0]}


def _f(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}"


def phases_table(rows: Sequence[Dict[str, Any]]) -> str:
    head = "| link | accum | case | step s | before link s | cross-host span s | floor s | span / floor | after s |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        if "link_span_s" not in r:
            continue
        link = f"{r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "unshaped"
        util = r["link_span_s"] / r["floor_s"] if r["floor_s"] else None
        lines.append(f"| {link} | {r['accum']} | {r['case']} | {r['step_s']:.2f} | {r['before_link_s']:.2f} | "
                     f"{r['link_span_s']:.2f} | {_f(r['floor_s'])} | {_f(util)} | {r['after_link_s']:.2f} |")
    return "\n".join(lines)
