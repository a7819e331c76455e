"""Throughput of the main job on two hosts started by torchrun, with and without the threads per rank.

Two network namespaces on this machine are the hosts (tests/helpers/netns.py); they share its cores, as ranks of
one job share a machine's cores wherever several of them run on it. Each host runs examples/multi_host/torchrun.sh
(1 rank per host), the main job for ``--steps`` optimizer steps with its default model, in three settings, in turn,
``--rounds`` times:

- ``threads``: OMP_NUM_THREADS unset: the strategy gives each rank the machine's cores / 2 ([Note: threads per rank]
  in lightning_mics/frontends/threads.py);
- ``every_core``: OMP_NUM_THREADS = the machine's cores: what each rank took before (torch's default);
- ``lightning``: the same job on one host, Lightning's own launcher (trainer.devices=2), the reference.

The cases take turns in each place of a round. Prints each run's tokens/s (the report's: all ranks, time in
training batches) with the load average, and the medians.

    python benchmarks/threads_per_rank.py --steps 30 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from tests.helpers.netns import HOSTS, join  # noqa: E402

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)
    return env


def two_hosts_run(names: List[str], args: List[str], folder: Path, job: str, omp: str, port: int) -> float:
    procs = []
    for node, ns in enumerate(names):
        extra = dict(GLOO_SOCKET_IFNAME=ns, HEAD=HOSTS[0], HOSTS="2", RANKS_PER_HOST="1", JOB_ID=job, PORT=str(port),
                     TORCHRUN=f"{sys.executable} -m torch.distributed.run", LOCAL_ADDR=HOSTS[node])
        if omp:
            extra["OMP_NUM_THREADS"] = omp
        log = open(folder / f"{job}-host{node}.log", "w")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "bash", str(REPO / "examples/multi_host/torchrun.sh"),
                                       "-m", "lightning_mics.app.train", *args], cwd=folder, env=_env(**extra),
                                      stdout=log, stderr=subprocess.STDOUT))
        log.close()
    codes = [p.wait(timeout=3600) for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"{job}: exit {codes}; see {folder}/{job}-host*.log")
    return json.loads((folder / "outputs" / f"torchrun-{job}" / "report.json").read_text())["tokens_per_second"]


def one_host_run(args: List[str], folder: Path, job: str) -> float:
    out = folder / "outputs" / job
    with open(folder / f"{job}.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "lightning_mics.app.train", *args, "trainer.devices=2",
                               f"hydra.run.dir={out}"], cwd=folder, env=_env(), stdout=log,
                              stderr=subprocess.STDOUT, timeout=3600).returncode
    if code:
        raise RuntimeError(f"{job}: exit {code}; see {folder}/{job}.log")
    return json.loads((out / "report.json").read_text())["tokens_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=29655)
    parser.add_argument("--keep", default=None, help="a folder to keep the runs' logs and reports in")
    opts = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    args = [f"trainer.max_steps={opts.steps}", "trainer.val_check_interval=1000000",
            "callbacks.progress_bar.refresh_rate=0", "callbacks.checkpoint=null", "strategy.sharded_data_parallel_degree=2"]
    tag = f"tpr{os.getpid() % 10000}"
    names = [f"{tag}a", f"{tag}b"]
    made = []
    results: Dict[str, List[float]] = {"threads": [], "every_core": [], "lightning": []}
    try:
        for ns in names:
            subprocess.run(["ip", "netns", "add", ns], check=True)
            made.append(ns)
        join(names)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(opts.keep or tmp)
            folder.mkdir(parents=True, exist_ok=True)
            runs = {"threads": lambda k: two_hosts_run(names, args, folder, f"threads{k}", "", opts.port + 2 * k),
                    "every_core": lambda k: two_hosts_run(names, args, folder, f"every{k}", str(cores),
                                                          opts.port + 2 * k + 1),
                    "lightning": lambda k: one_host_run(args, folder, f"lightning{k}")}
            order = list(runs)
            for k in range(opts.rounds):
                for case in order[k % 3:] + order[: k % 3]:  # each case in each place of the round in turn
                    results[case].append(runs[case](k))
                    print(json.dumps({"round": k, "case": case, "tokens_per_s": results[case][-1],
                                      "load_average": os.getloadavg()[0]}), flush=True)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    med = {key: statistics.median(v) for key, v in results.items()}
    print(json.dumps({"cores": cores, "steps": opts.steps, "rounds": opts.rounds, "median_tokens_per_s": med,
                      "threads / lightning": med["threads"] / med["lightning"],
                      "every_core / lightning": med["every_core"] / med["lightning"]}))


if __name__ == "__main__":
    main()
