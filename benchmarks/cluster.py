"""Where MiCS is meant to win: two hosts over a slow link, every peer through Lightning's Trainer.

    sudo .venv/bin/python benchmarks/cluster.py --rates 100 400 0 --accum 1 4 --rounds 2 --steps 3
    python benchmarks/cluster.py --report benchmarks/out/cluster/<run>     # the table and plot again, no run

Two network namespaces joined by a veth act as two hosts of 2 ranks each (benchmarks/twohosts.py); every byte
between the hosts crosses the veth, whose egress is shaped on both ends with ``tc tbf`` to each rate of
``--rates`` in Mbit/s (0: the veth as it is). For each round, rate, accumulation and case (interleaved, so that a
loaded machine slows every case alike), ``torchrun --nnodes 2 --nproc-per-node 2`` runs
benchmarks/cluster_rank.py in both namespaces: ``--warmup`` optimizer steps, then ``--steps`` timed ones. The cases
(``ddp``, ``fsdp2_full``, ``fsdp2_hsdp``, ``mics_host``, ``mics_twohop``, ``mics_host_os``, and the int8 twins
``mics_host_q8``, ``mics_twohop_q8``, ``mics_host_os_q8``; DiLoCo's ``mics_host_diloco`` and
``mics_host_diloco_q8``, whose host groups train apart and meet every ``--sync-every`` steps, and their streaming
twins ``mics_host_diloco_stream``, ``mics_host_diloco_stream_q8``) are described there.

[Note: DiLoCo's timed window]
An exact case's steps are all alike, so ``--steps`` of them time it. A DiLoCo case's are not: only sync steps send
between the hosts. It times ``--windows`` x ``--sync-every`` (k x H) consecutive steps instead, steps W + 2 .. W + 1 +
kH (W = ``--warmup``, then the untimed step after the handshake), so that they hold exactly k windows' syncs wherever
W puts the first: k syncs at steps H, 2H, ... counted from the run's first step, or with F streaming fragments
(delay d, P = H / F) kF, each sent after a step P - d (mod P) and applied after a step 0 (mod P). The link's window
(W + 1 .. W + 1 + kH) must hold no more: W + 1 must not be a sync step, nor W or W + 1 a streaming send or apply
(refused at the command line). ``link_bytes`` is then the window's bytes over its kH + 1 steps, as for the exact
cases, and ``link_bytes_per_sync`` those bytes over the syncs (a streaming sync carries one fragment). Both counts are
checked from the engine's outer-step counter (rank 0): ``syncs_timed`` and ``syncs_link``; a run whose counts differ
failed.

Per case, rate and accumulation, one JSON line on stdout (and in ``rows.jsonl``):
  step_s          the slowest rank's mean step over the timed steps (wall clock from the end of the step before
                  them to the end of the last), median over rounds; one more step runs between the warm-up and the
                  timed ones, untimed: it follows the counters' handshake ([Note: step marks] in twohosts.py).
                  With no barrier between them, the ranks' steps are not aligned: one rank's step holds its wait
                  for another, whose next step is the shorter; a median over steps of their maximum would count
                  that jitter as time
  link_bytes      bytes per step over the busier direction of the veth (``link_bytes_dirs``: host 0 -> 1, 1 -> 0),
                  from the veth ends' counters, read from outside the processes at the end of the warm-up and of
                  the last step while all ranks wait: the timed window's mean per step (median over runs)
  floor_s         link_bytes / rate: the step time if the link were busy all the time and nothing else took any
  ar_wait_s       time a rank is blocked on all-reduces whose group spans both hosts, per step (mean over ranks,
                  median over steps); ``comm_wait_s`` the same over every cross-host collective
                  ([Note: the benchmark's communication clock] in cluster_rank.py)
  counted         bytes and calls per collective and scope, per step, as issued (rank 0); ``telemetry`` the MiCS
                  strategy's own ``comm_stats`` of the last step (rank 0)
  probe_mbit      what one TCP stream gets through the shaped link; ``load1`` the 1-minute load average before
                  the runs (lowest, highest)
Writes ``runs.jsonl`` (one record per run, as it finishes), ``rows.jsonl``, ``table.md`` and ``cluster.png`` under
``--out``. Needs root (or CAP_NET_ADMIN) for the namespaces; traffic goes only to the two hosts' loopback-range
addresses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from cluster_rank import CASES, DILOCO, STREAMED, STREAMING, parser as model_parser, syncs_per_window  # noqa: E402
from timeline import phases, phases_table  # noqa: E402

PEERS = ("ddp", "fsdp2_full", "fsdp2_hsdp")
NOT_HERE = {
    "Lightning FSDPStrategy (FSDP1)": "refuses a CPU accelerator before it starts (`The strategy fsdp requires a GPU "
                                      "accelerator`); FSDP2, its successor, runs here through Lightning's "
                                      "ModelParallelStrategy as fsdp2_full and fsdp2_hsdp",
    "DeepSpeed (ZeRO-3, its MiCS)": "not installed here, and Lightning's DeepSpeedStrategy refuses anything but CUDA "
                                    "(`The DeepSpeed strategy is only supported on CUDA GPUs`)",
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[model_parser()])
    ap.add_argument("--rates", type=float, nargs="+", default=[100.0, 400.0, 0.0],
                    help="link rates in Mbit/s; 0: unshaped")
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--windows", type=int, default=1,
                    help="DiLoCo cases: timed windows of --sync-every steps each ([Note: DiLoCo's timed window])")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--out", default=None, help="folder for the results (default benchmarks/out/cluster/<time>)")
    ap.add_argument("--queue-ms", type=float, default=100.0,
                    help="how long a packet may wait in the shaped link's queue (tbf latency), ms")
    ap.add_argument("--sysctl", nargs="+", default=[], metavar="KEY=VALUE",
                    help="net.* settings in both hosts' namespaces, e.g. net.ipv4.tcp_slow_start_after_idle=0")
    ap.add_argument("--report", default=None, help="rebuild table and plot from this folder's runs.jsonl")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error(f"--warmup must be >= 1 (a timed step is measured from the previous step's end), got {args.warmup}")
    if args.steps < 1 or args.rounds < 1 or min(args.accum) < 1 or min(args.rates) < 0:
        ap.error("--steps, --rounds and --accum must be >= 1 and --rates >= 0")
    if args.windows < 1 or args.sync_every < 1:
        ap.error(f"--windows and --sync-every must be >= 1, got {args.windows} and {args.sync_every}")
    if set(args.cases) & set(DILOCO) and args.sync_every > 1 and (args.warmup + 1) % args.sync_every == 0:
        ap.error(f"--warmup {args.warmup} with --sync-every {args.sync_every}: the untimed step {args.warmup + 1} "
                 "would be a sync step, counted in the link's window ([Note: DiLoCo's timed window])")
    if set(args.cases) & set(STREAMED):
        frags, delay = STREAMING["sync_fragments"], args.sync_delay
        if args.sync_every % frags or args.sync_every // frags <= delay:
            ap.error(f"--sync-every {args.sync_every} with --sync-delay {delay}: the streaming cases need a multiple "
                     f"of {frags} (their fragments) with more than {delay} steps per fragment")
        period = args.sync_every // frags
        if {args.warmup % period, (args.warmup + 1) % period} & {0, (period - delay) % period}:
            ap.error(f"--warmup {args.warmup} with --sync-every {args.sync_every}: step {args.warmup} or "
                     f"{args.warmup + 1} would send or apply a fragment's sync, its bytes in the link's window "
                     "([Note: DiLoCo's timed window])")
    if not args.queue_ms > 0:
        ap.error(f"--queue-ms must be > 0 (milliseconds), got {args.queue_ms}")
    from twohosts import check_sysctl

    try:
        check_sysctl(args.sysctl)  # before any namespace is made
    except ValueError as e:
        ap.error(f"--{e}")
    return args


def case_steps(case: str, args: argparse.Namespace) -> int:
    """Timed steps of a run: ``--steps``; a DiLoCo case k x H ([Note: DiLoCo's timed window])."""
    return args.windows * args.sync_every if case in DILOCO else args.steps


def loadavg() -> List[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# -- one run ---------------------------------------------------------------------------------------------------
def run_one(hosts: Any, case: str, rate: float, accum: int, args: argparse.Namespace, folder: Path, port: int,
            ) -> Dict[str, Any]:
    """One torchrun on both hosts; the record ``summarize`` reads (``error`` set if it failed)."""
    from twohosts import StepMarks, per_step

    folder.mkdir(parents=True)
    sock = Path(tempfile.mkdtemp(prefix="clm")) / "s"  # a Unix socket path must stay under 108 characters
    script = [str(BENCH / "cluster_rank.py"), "--case", case, "--accum", str(accum), "--out", str(folder),
              "--marks", str(sock)]
    steps = case_steps(case, args)
    for k in ("width", "layers", "heads", "vocab", "seq", "batch", "warmup", "sync_every", "sync_delay"):
        script += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    script += ["--steps", str(steps)]
    script += ["--timeline"] if args.timeline else []
    rec: Dict[str, Any] = dict(case=case, rate_mbit=rate, accum=accum, warmup=args.warmup, load=loadavg(),
                               queue_ms=args.queue_ms)
    t0 = time.time()
    with StepMarks(hosts, sock) as marks:
        procs = hosts.torchrun(script, port, folder)
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        except Exception:
            codes = ["timeout"]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    sock.parent.rmdir()
    rec["wall_s"] = time.time() - t0
    last = args.warmup + 1 + steps  # one untimed step after the warm-up's counters ([Note: step marks])
    if codes != [0, 0] or sorted(marks.marks) != [args.warmup, last]:
        rec["error"] = f"exit {codes}, counters read at steps {sorted(marks.marks)}; logs in {folder}"
        return rec
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(4)]
    rec["n_params"] = ranks[0]["n_params"]
    rec["ranks"] = [dict(ends=r["ends"], resumes=r["resumes"], comm=r["comm"], timeline=r.get("timeline"))
                    for r in ranks]
    rec["telemetry"] = ranks[0]["telemetry"][-1]
    [(sent, received)] = per_step(marks.marks, last, last, before=args.warmup)  # the whole window
    rec["link_steps"] = [(sent / (last - args.warmup), received / (last - args.warmup))]  # its mean per step
    rec["timed_from"] = args.warmup + 2  # the first step that no handshake precedes ([Note: step marks])
    if case in DILOCO:  # [Note: DiLoCo's timed window]: the syncs in the windows, from the engine's counter
        outer = ranks[0]["outer_steps"]  # outer[j]: syncs done by the end of step j + 1
        rec.update(sync_every=args.sync_every, sync_delay=args.sync_delay, windows=args.windows,
                   package=ranks[0]["package"], outer_steps=outer,
                   syncs_timed=outer[last - 1] - outer[rec["timed_from"] - 2],
                   syncs_link=outer[last - 1] - outer[args.warmup - 1])
        want = args.windows * syncs_per_window(case)
        if rec["syncs_timed"] != want or rec["syncs_link"] != want:
            rec["error"] = (f"{rec['syncs_timed']} syncs in the timed steps and {rec['syncs_link']} in the link's "
                            f"window, not {want}; logs in {folder}")
    return rec


# -- summary, ratios, table, plot ------------------------------------------------------------------------------
def _cross_wait(comm: Dict[str, Any], prefix: str) -> float:
    wait = sum(v["wait_s"] for k, v in comm.items() if k.startswith(prefix) and k.endswith("/cross"))
    return wait + comm.get("ddp_exposed_s", 0.0)


def _sync_steps(rec: Dict[str, Any], first: int, n: int) -> set:
    """Indexes among the ``n`` timed steps (the first is step ``first``) of the steps that ended with a DiLoCo sync:
    from the engine's counter where the record has it, else the multiples of H ([Note: DiLoCo's timed window])."""
    outer = rec.get("outer_steps")
    if outer:  # outer[j]: the syncs done by the end of step j + 1
        return {i for i in range(n) if outer[first + i - 1] > outer[first + i - 2]}
    return {i for i in range(n) if (first + i) % (rec["sync_every"] // syncs_per_window(rec["case"])) == 0}


def summarize(records: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (case, rate, accum) from the runs' records (failed runs left out), with ratios."""
    groups: Dict[tuple, List[Dict[str, Any]]] = defaultdict(list)
    for rec in records:
        if "error" not in rec:
            groups[(rec["case"], rec["rate_mbit"], rec["accum"])].append(rec)
    rows = []
    for (case, rate, accum), recs in groups.items():
        steps, per_round, ar, cw, link, counted = [], [], [], [], [], defaultdict(list)
        inner, sync = [], []
        for rec in recs:
            w = rec.get("timed_from", rec["warmup"] + 1) - 1  # records before it marked every step
            durs = [[e - b for b, e in zip(r["resumes"][w - 1:], r["ends"][w:])] for r in rec["ranks"]]
            if case in DILOCO:  # the slowest rank's mean over the inner steps, and over the sync steps
                synced = _sync_steps(rec, w + 1, len(durs[0]))
                inner.append(max(statistics.mean(x for i, x in enumerate(d) if i not in synced) for d in durs))
                sync.append(max(statistics.mean(d[i] for i in synced) for d in durs))
            if "timed_from" in rec:  # no barrier between the steps: a rank's step k holds its wait for a later rank,
                slowest = [max(statistics.mean(d) for d in durs)] * len(durs[0])  # so the slowest rank's pace
            else:
                slowest = [max(d) for d in zip(*durs)]
            steps += slowest
            per_round.append(statistics.median(slowest))
            comms = [r["comm"][w:] for r in rec["ranks"]]  # comm[j]: the window ending at step j + 1
            for k in range(len(slowest)):
                ar.append(statistics.mean(_cross_wait(c[k], "all_reduce/") for c in comms))
                cw.append(statistics.mean(_cross_wait(c[k], "") for c in comms))
                for key, v in comms[0][k].items():
                    if key != "ddp_exposed_s":
                        counted[key].append((v["bytes"], v["calls"]))
            link += rec["link_steps"]
        dirs = [statistics.median(d[i] for d in link) for i in (0, 1)]
        row = dict(case=case, rate_mbit=rate, accum=accum, step_s=statistics.median(steps), link_bytes=max(dirs),
                   link_bytes_dirs=dirs, floor_s=max(dirs) * 8 / (rate * 1e6) if rate else None,
                   ar_wait_s=statistics.median(ar), comm_wait_s=statistics.median(cw),
                   counted={k: dict(bytes=statistics.median(b for b, _ in v), calls=statistics.median(c for _, c in v))
                            for k, v in sorted(counted.items())},
                   telemetry={k: v for k, v in recs[-1]["telemetry"].items() if k.startswith(("comm/", "time/"))},
                   steps=len(steps), rounds=len(recs), step_s_rounds=per_round, n_params=recs[0]["n_params"],
                   probe_mbit=statistics.median(r.get("probe_mbit", 0.0) for r in recs),
                   load1=[min(r["load"][0] for r in recs), max(r["load"][0] for r in recs)])
        row["step_over_floor"] = row["step_s"] / row["floor_s"] if row["floor_s"] else None
        if case in DILOCO:  # [Note: DiLoCo's timed window]
            k, link_steps = recs[0]["windows"] * syncs_per_window(case), len(slowest) + 1
            row.update(sync_every=recs[0]["sync_every"], sync_delay=recs[0].get("sync_delay"), syncs_timed=k,
                       link_window_steps=link_steps,
                       link_bytes_per_sync=row["link_bytes"] * link_steps / k, inner_step_s=statistics.median(inner),
                       sync_step_s=statistics.median(sync))
            row["vs_inner"] = row["step_s"] / row["inner_step_s"]
        row.update(phases(recs))  # [Note: what holds a step] in timeline.py, where the runs have a timeline
        rows.append(row)
    add_ratios(rows)
    order = {c: i for i, c in enumerate(CASES)}
    return sorted(rows, key=lambda r: (r["rate_mbit"] == 0, r["rate_mbit"], r["accum"], order[r["case"]]))


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """``vs_best_peer``: step time / the fastest peer's (DDP, FSDP2 full, FSDP2 HSDP) at the same rate and
    accumulation (the peer itself included); ``vs_fsdp2_full`` and ``bytes_vs_hsdp`` likewise; ``vs_best_exact``
    against the fastest exact case of all (the MiCS ones too, every case but DiLoCo's); ``vs_unshaped`` against the
    same case and accumulation on the unshaped link (rate 0)."""
    at: Dict[tuple, Dict[str, Dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        at[(r["rate_mbit"], r["accum"])][r["case"]] = r
    for r in rows:
        same = at[(r["rate_mbit"], r["accum"])]
        peers = [same[c] for c in PEERS if c in same]
        best = min(peers, key=lambda p: p["step_s"]) if peers else None
        r["best_peer"] = best["case"] if best else None
        r["vs_best_peer"] = r["step_s"] / best["step_s"] if best else None
        r["vs_fsdp2_full"] = r["step_s"] / same["fsdp2_full"]["step_s"] if "fsdp2_full" in same else None
        hsdp = same.get("fsdp2_hsdp")
        r["bytes_vs_hsdp"] = r["link_bytes"] / hsdp["link_bytes"] if hsdp and hsdp["link_bytes"] else None
        exact = [v for c, v in same.items() if c not in DILOCO]
        best = min(exact, key=lambda p: p["step_s"]) if exact else None
        r["best_exact"] = best["case"] if best else None
        r["vs_best_exact"] = r["step_s"] / best["step_s"] if best else None
        unshaped = at.get((0.0, r["accum"]), {}).get(r["case"])
        r["vs_unshaped"] = r["step_s"] / unshaped["step_s"] if unshaped else None


def _f(x: Optional[float], fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def table(rows: Sequence[Dict[str, Any]]) -> str:
    head = ("| link | accum | case | step s | per round | / best peer | / fsdp2_full | link MB/step | / HSDP bytes "
            "| floor s | step / floor | AR wait s | comm wait s | load 1-min |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        link = f"{r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "unshaped"
        rounds = " / ".join(f"{x:.2f}" for x in r["step_s_rounds"])
        lines.append(f"| {link} | {r['accum']} | {r['case']} | {r['step_s']:.2f} | {rounds} | "
                     f"{_f(r['vs_best_peer'], '.2f')} | {_f(r['vs_fsdp2_full'], '.2f')} | "
                     f"{r['link_bytes'] / 1e6:.1f} | "
                     f"{_f(r['bytes_vs_hsdp'], '.2f')} | {_f(r['floor_s'], '.2f')} | "
                     f"{_f(r['step_over_floor'], '.2f')} | {r['ar_wait_s']:.2f} | {r['comm_wait_s']:.2f} | "
                     f"{r['load1'][0]:.1f}-{r['load1'][1]:.1f} |")
    return "\n".join(lines)


def diloco_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The DiLoCo rows against the exact cases of the same rate and accumulation, and against their unshaped run."""
    head = ("| link | accum | case | H | step s | best exact (step s) | / best exact | best peer | / best peer "
            "| / unshaped | inner step s | sync step s | step / inner | link MB/step | MB/sync | load 1-min |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    at = {(r["rate_mbit"], r["accum"], r["case"]): r for r in rows}
    for r in rows:
        if r["case"] not in DILOCO:
            continue
        link = f"{r['rate_mbit']:g} Mbit/s" if r["rate_mbit"] else "unshaped"
        best = at.get((r["rate_mbit"], r["accum"], r["best_exact"]))
        lines.append(f"| {link} | {r['accum']} | {r['case']} | {r['sync_every']} | {r['step_s']:.2f} | "
                     f"{r['best_exact'] or '—'} ({_f(best and best['step_s'], '.2f')}) | "
                     f"{_f(r['vs_best_exact'], '.2f')} | {r['best_peer'] or '—'} | {_f(r['vs_best_peer'], '.2f')} | "
                     f"{_f(r['vs_unshaped'], '.2f')} | {r['inner_step_s']:.2f} | {r['sync_step_s']:.2f} | "
                     f"{r['vs_inner']:.2f} | {r['link_bytes'] / 1e6:.1f} | "
                     f"{r['link_bytes_per_sync'] / 1e6:.1f} | {r['load1'][0]:.1f}-{r['load1'][1]:.1f} |")
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate_mbit"] for r in rows}, key=lambda x: (x == 0, x))
    accums = sorted({r["accum"] for r in rows})
    fig, axes = plt.subplots(1, len(accums), figsize=(5.5 * len(accums), 4), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        for case in CASES:
            pts = [(rates.index(r["rate_mbit"]), r["step_s"]) for r in rows
                   if r["case"] == case and r["accum"] == accum]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=case, color=plt.cm.tab20(CASES.index(case)),
                        ls="--" if case in DILOCO else "-")
        floor = [(rates.index(r["rate_mbit"]), r["floor_s"]) for r in rows
                 if r["case"] == "mics_host" and r["accum"] == accum and r["floor_s"]]
        if floor:
            ax.plot(*zip(*sorted(floor)), ls=":", marker="_", ms=14, color="k", label="mics_host link floor")
        ax.set_xticks(range(len(rates)), [f"{x:g}" if x else "unshaped" for x in rates])
        ax.set_yscale("log")
        ax.set_xlabel("link rate, Mbit/s each way")
        ax.set_ylabel("step time, s (slowest rank, median)")
        ax.set_title(f"accumulation {accum}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # each panel its own: a case may have run at one accumulation only
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(folder: Path, command: str) -> List[Dict[str, Any]]:
    records = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line.strip()]
    if (folder / "command.txt").exists():  # the command that ran, not the one that asks for the report again
        command = (folder / "command.txt").read_text().strip()
    rows = summarize(records)
    with open(folder / "rows.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    failed = [f"{r['case']} at {r['rate_mbit']:g} Mbit/s, accumulation {r['accum']}: {r['error']}"
              for r in records if "error" in r]
    loads = [r["load"][0] for r in records]
    n = rows[0]["n_params"] if rows else 0
    text = [f"Command: `{command}`", "",
            f"GPT {n / 1e6:.1f}M parameters, AdamW, fp32, 4 ranks on 2 hosts; {len(records)} runs, 1-minute load "
            f"average {min(loads):.1f} to {max(loads):.1f}. Best peer: the fastest of {', '.join(PEERS)}.", "",
            table(rows), ""]
    if any(r["case"] in DILOCO for r in rows):
        h = sorted({r["sync_every"] for r in rows if r["case"] in DILOCO})
        text += [f"DiLoCo (H = {', '.join(map(str, h))}), each mean step over whole windows with their syncs "
                 "([Note: DiLoCo's timed window] in benchmarks/cluster.py); best exact: the fastest case that is "
                 "exact data parallelism (every case but DiLoCo's); / unshaped: against the same case on the "
                 "unshaped link; inner and sync step: the slowest rank's mean over the window's steps without and "
                 "with a sync, from the same run; step / inner: the mean step over the inner steps' mean, which "
                 "holds the same load as the run:", "", diloco_table(rows), ""]
    if any("link_span_s" in r for r in rows):
        text += ["What holds the step ([Note: what holds a step] in benchmarks/timeline.py), medians over ranks and "
                 "timed steps:", "", phases_table(rows), ""]
    text += ["Peers that cannot run here:"]
    text += [f"- {k}: {v}" for k, v in NOT_HERE.items()]
    text += ["", "Failed runs:"] + [f"- {x}" for x in failed] if failed else []
    (folder / "table.md").write_text("\n".join(text) + "\n")
    if rows:
        plot(rows, folder / "cluster.png")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    command = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else "main(" + repr(argv) + ")"
    if args.report:
        for row in report(Path(args.report), command):
            print(json.dumps(row), flush=True)
        print((Path(args.report) / "table.md").read_text())
        return
    from twohosts import TwoHosts, probe

    out = Path(args.out or BENCH / "out" / "cluster" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(command + "\n")
    port = 29600 + os.getpid() % 200
    with TwoHosts(f"cl{os.getpid() % 10000}") as hosts, open(out / "runs.jsonl", "a") as runs:
        (out / "namespaces.txt").write_text(" ".join(hosts.names) + "\n")
        hosts.sysctl(args.sysctl)
        for rnd in range(args.rounds):
            for rate in args.rates:
                hosts.shape(rate, args.queue_ms)
                mbit = probe(hosts, int((rate or 1600) * 1e6 / 8))  # about 1 s of the link
                for accum in args.accum:
                    for case in args.cases:
                        port += 1
                        folder = out / f"r{rnd}-{rate:g}-a{accum}-{case}"
                        rec = run_one(hosts, case, rate, accum, args, folder, port)
                        rec.update(round=rnd, probe_mbit=mbit)
                        runs.write(json.dumps(rec) + "\n")
                        runs.flush()
                        step = "failed: " + rec["error"] if "error" in rec else f"{rec['wall_s']:.0f} s wall"
                        print(f"# round {rnd} {rate:g} Mbit/s (TCP {mbit:.0f}) accum {accum} {case}: {step}, "
                              f"load {rec['load'][0]:.1f}", file=sys.stderr, flush=True)
    for row in report(out, command):
        print(json.dumps(row), flush=True)
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
