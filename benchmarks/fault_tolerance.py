"""Fault-tolerant replica groups on two namespace hosts of 2 ranks each (MiCS s = 2 inside each host): what a lost
host costs, how fast a restarted one is back, and what fault tolerance costs when nothing fails.

    python benchmarks/fault_tolerance.py                     # defaults below; about 6 minutes on 2 cores
    python benchmarks/fault_tolerance.py --heartbeat-ms 5000 1000 --repeat 2 --overhead-steps 120

Hosts: two network namespaces over a veth (benchmarks/twohosts.py, not shaped), the lighthouse on host 0, replica
group g on host g, each a ``torchrun --nproc-per-node 2`` job of tests/fault_tolerance/ft_trainer.py (a GPT of
``--width`` x ``--layers``, AdamW, rank 0 writes one line per optimizer step with its wall time, the quorum's
groups and whether it committed). Measured:

- **kill gap**: from SIGKILL to every process of host 1's group (its agent and workers at once) to the end of the
  surviving group's first optimizer step committed without it (and, beside it, to the end of its next step, usually
  the one the loss fell into, not taken); the lighthouse drops the lost group after ``--heartbeat_timeout_ms``, so
  the gap is printed beside it and beside the survivor's median step before the kill;
- **restart to first step**: from launching host 1's group again (right after the kill) to the end of its first
  optimizer step in the quorum (process start, imports, setup, the heal from host 0 included), and the heal itself
  (the quorum that loaded the peer's state, from the group's own report);
- **steps lost**: optimizer steps the survivor did not commit (the step the loss fell into), and steps the job ran
  with one group (the lost group's batches not trained);
- **overhead**: median step time of the fault-tolerant job (2 groups) over the same layout without it (one 4-rank
  job over both hosts, s = 2, r = 2), both from step 10 on, no failure.

Results go to stdout as a markdown table and, with ``--log``, appended to benchmarks/LOG.md with the date, commit
and command. Every process the run starts is killed at the end, and the namespaces deleted, whatever happens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.twohosts import TwoHosts  # noqa: E402
from tests.helpers.ft_groups import SCRIPT, FTJob, records, wait_for  # noqa: E402
from tests.helpers.netns import HOSTS  # noqa: E402


def _step_times(recs: List[dict], first: int) -> List[float]:
    return [b["t"] - a["t"] for a, b in zip(recs, recs[1:]) if a["step"] >= first and b["step"] == a["step"] + 1]


def overhead(hosts: TwoHosts, out: Path, model: List[str], steps: int) -> Dict[str, float]:
    """Median step time with and without fault tolerance, same layout (2 hosts x 2 ranks, s = 2)."""
    base = out / "plain_layout"
    base.mkdir()
    procs = hosts.torchrun([str(SCRIPT), "--mode", "mics", "--num-nodes", "2", "--out", str(base), "--record",
                            "--steps", str(steps), *model], 29610, base)
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if codes != [0, 0]:
        raise RuntimeError(f"the layout without fault tolerance failed: {codes} (logs in {base})")
    ft = out / "ft_layout"
    ft.mkdir()
    with FTJob(ft, hosts.names, HOSTS, 29620, 29630) as job:
        job.lighthouse(min_replicas=2, host=0)
        for g in range(2):
            job.start(g, ["--mode", "ft", "--out", str(ft), "--record", "--steps", str(steps), *model])
        codes = [job.wait(g, timeout=900) for g in range(2)]
    if codes != [0, 0]:
        raise RuntimeError(f"the fault-tolerant job failed: {codes} (logs in {ft})")
    plain = statistics.median(_step_times(records(base / "mics_steps.jsonl"), 10))
    tolerant = statistics.median(_step_times(records(ft / "ft0_steps.jsonl"), 10))
    parts = torch.load(ft / "ft0.pt", weights_only=False)["summary"]["median_seconds"]
    return {"step_s_without": plain, "step_s_with": tolerant, "ratio": tolerant / plain, "parts": parts}


def kill_and_restart(hosts: TwoHosts, out: Path, model: List[str], heartbeat_ms: int, port: int, after: int = 10,
                     then: int = 10) -> Dict[str, Any]:
    """Host 1's group killed after ``after`` steps and started again at once; runs until it has stepped ``then``
    times in the quorum."""
    args = ["--mode", "ft", "--out", str(out), "--record", "--steps", "100000", "--resumable", *model]
    a, b = out / "ft0_steps.jsonl", out / "ft1_steps.jsonl"
    with FTJob(out, hosts.names, HOSTS, port, port + 10) as job:
        job.lighthouse(min_replicas=1, heartbeat_ms=heartbeat_ms, host=0)
        job.start(0, args)
        job.start(1, args)
        wait_for(lambda: job.check() and min(len(records(a)), len(records(b))) >= after, 600,
                 what=f"{after} steps on both hosts")
        killed = job.kill(1)
        before = len(records(b))
        job.start(1, args)
        restarted = job.started_at[1][-1]
        wait_for(lambda: job.check() and len(records(b)) >= before + then, 300,
                 what="the restarted group stepping in the quorum")
        job.kill(0)
        job.kill(1)
    ra, rb = records(a), records(b)
    pre = _step_times([r for r in ra if r["t"] < killed], 2)
    survivor_next = next(r for r in ra if r["t"] > killed)  # often the step the loss fell into, not taken
    survivor_alone = next(r for r in ra if r["t"] > killed and r["committed"] and r["quorum"] == 1)
    joined = rb[before]
    lone = [r for r in ra if r["t"] > killed and r["quorum"] == 1]
    heals = [line for line in (out / f"{job.current(1)}.log").read_text(errors="replace").splitlines()
             if "healed from a live peer" in line]
    return {"heartbeat_ms": heartbeat_ms, "step_s_before": statistics.median(pre),
            "next_step_end_s": survivor_next["t"] - killed, "kill_gap_s": survivor_alone["t"] - killed,
            "restart_to_step_s": joined["t"] - restarted, "heal": heals[-1].split("(")[-1].rstrip(")") if heals else "",
            "not_committed": sum(1 for r in ra if r["t"] > killed and not r["committed"]),
            "steps_with_one_group": len(lone), "joined_at_step": joined["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heartbeat-ms", type=int, nargs="+", default=[5000, 1000],
                    help="the lighthouse's --heartbeat_timeout_ms (5000: torchft's default)")
    ap.add_argument("--repeat", type=int, default=1, help="kills per heartbeat timeout (0: the overhead only)")
    ap.add_argument("--overhead-steps", type=int, default=80)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--log", action="store_true", help="append the results to benchmarks/LOG.md")
    ap.add_argument("--keep", default=None, help="a folder for the runs' logs and records (default: a temporary one)")
    args = ap.parse_args()
    model = ["--width", str(args.width), "--layers", str(args.layers)]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, TwoHosts(f"ftb{int(time.time()) % 10000}") as hosts:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        kills = []
        for i, hb in enumerate(args.heartbeat_ms):
            for k in range(args.repeat):
                d = out / f"kill_{hb}_{k}"
                d.mkdir()
                kills.append(kill_and_restart(hosts, d, model, hb, 29700 + 40 * (i * args.repeat + k)))
                print(json.dumps(kills[-1]), flush=True)
        ov = overhead(hosts, out, model, args.overhead_steps)
        print(json.dumps(ov), flush=True)
    lines = ["| heartbeat timeout | survivor's step before | kill -> next step end | kill -> first step without it "
             "| restart -> first step in quorum | heal | steps not committed | steps with one group |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {k['heartbeat_ms'] / 1000:g} s | {k['step_s_before']:.3f} s | {k['next_step_end_s']:.2f} s | "
              f"{k['kill_gap_s']:.2f} s | {k['restart_to_step_s']:.1f} s | {k['heal']} | {k['not_committed']} | "
              f"{k['steps_with_one_group']} |" for k in kills]
    parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in ov["parts"].items() if v is not None)
    lines += ["", f"Without failures: median step {ov['step_s_with']:.3f} s with fault tolerance, "
              f"{ov['step_s_without']:.3f} s without (one 4-rank job, s = 2, r = 2): {ov['ratio']:.2f}x; "
              f"its parts on group 0's rank 0, median per step: {parts}."]
    print("\n".join(lines))
    if args.log:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        head = (f"\n### {datetime.date.today()}, commit {commit}, {time.time() - started:.0f} s\n\n"
                f"Command: `python benchmarks/fault_tolerance.py {' '.join(sys.argv[1:])}`\n\n")
        with open(REPO / "benchmarks" / "LOG.md", "a") as f:
            f.write(head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
