"""Two hosts over a shaped link: what the two-hop all-gather and the 2-hop gradient sync save (optional).

    sudo python benchmarks/netem.py [--delay-ms 2 --rate-mbit 200 --steps 6]

Two network namespaces joined by a veth pair act as two hosts of 2 ranks each (as in tests/layout/test_two_hosts.py;
private /30 addresses that exist only between the two namespaces, deleted at the end whatever happens).
``torchrun --nnodes 2 --nproc-per-node 2`` starts the ranks; gloo binds to the veth, so every byte between the
hosts crosses it. The link is measured as it is, then shaped on both ends with ``tc netem`` (delay and rate), or
where the kernel has no netem qdisc (as on the machine of benchmarks/LOG.md) with ``tc tbf`` (rate only).

Cases, all with accumulation 4 and every parameter sharded (``param_persistence_threshold=0``):
  s=4 flat        one sharding group over both hosts, the flat all-gather (``hierarchical_allgather=False``)
  s=4 two-hop     the same group, the two-hop all-gather (across hosts among same local ranks, then in the host)
  s=2 r=2         a sharding group per host: gathers and reduce-scatters stay inside the host; the only traffic
                  between the hosts is the replica all-reduce, once per optimizer step (MiCS's 2-hop sync)
Each rank times its optimizer steps (a callback, wall clock between step ends) after 2 warm-up steps; the table
gives the median over steps of the slowest rank, and the bytes per group and collective of one step (rank 0,
the strategy's telemetry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.helpers.netns import HOSTS, join  # noqa: E402
CASES = {"s=4 flat": dict(sharded_data_parallel_degree=4, hierarchical_allgather=False),
         "s=4 two-hop": dict(sharded_data_parallel_degree=4, hierarchical_allgather=True),
         "s=2 r=2": dict(sharded_data_parallel_degree=2)}


# -- one rank ---------------------------------------------------------------------------------------------------
def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO))
    import lightning as L
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mics import MiCSStrategy

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    class Net(L.LightningModule):
        def __init__(self, d=128, depth=4, vocab=512):
            super().__init__()
            self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
            self.blocks = nn.ModuleList(Block(d) for _ in range(depth))

        def training_step(self, batch, idx):
            x, y = batch
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timer(L.Callback):
        def __init__(self):
            self.ends, self.comm = [], []

        def on_train_batch_end(self, trainer, *_):
            if not self.ends or trainer.global_step != self.ends[-1][0]:
                self.ends.append((trainer.global_step, time.perf_counter()))
                self.comm.append(dict(trainer.strategy.comm_stats))

    torch.manual_seed(0)
    x = torch.randint(0, 512, (4 * 4 * args.accum * (args.steps + 2), 33))
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_steps=args.steps + 2, logger=False,
                        accumulate_grad_batches=args.accum, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer],
                        strategy=MiCSStrategy(param_persistence_threshold=0, **json.loads(args.case)))
    trainer.fit(Net(), DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4))
    ends = [t for _, t in timer.ends]
    steps = [b - a for a, b in zip(ends[2:], ends[3:])]  # after 2 warm-up steps
    out = dict(rank=trainer.global_rank, step_s=steps, comm=timer.comm[-1],
               params=sum(p.numel() for p in trainer.lightning_module.parameters()))
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


# -- the two hosts ----------------------------------------------------------------------------------------------
def _ip(*a, check=True):
    r = subprocess.run(["ip", *a], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(a)}: {r.stderr.strip()}")
    return r


def make_hosts(names):
    for ns in names:
        _ip("netns", "add", ns)
    join(names)  # loopback-range addresses ([Note: loopback-range hosts] in tests/helpers/netns.py)


def shape(names, delay_ms, rate_mbit) -> str:
    """netem (delay and rate) on both ends; where the kernel has no netem qdisc, tbf (rate only). Says which."""
    used = "none"
    for ns in names:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", ns, "root"], capture_output=True)
        if not (delay_ms or rate_mbit):
            continue
        netem = [*tc, "add", "dev", ns, "root", "netem", "delay", f"{delay_ms:g}ms", "rate", f"{rate_mbit:g}mbit"]
        if subprocess.run(netem, capture_output=True).returncode == 0:
            used = f"netem {delay_ms:g} ms, {rate_mbit:g} Mbit/s"
            continue
        tbf = [*tc, "add", "dev", ns, "root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", "32kbit", "latency", "400ms"]
        subprocess.run(tbf, check=True, capture_output=True)
        used = f"tbf {rate_mbit:g} Mbit/s (no netem qdisc in this kernel: no delay)"
    return used


def run_case(names, case, args, out: Path, port: int):
    out.mkdir(parents=True)
    procs = []
    for node, ns in enumerate(names):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME=ns)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", HOSTS[0], "--master-port",
               str(port), __file__, "--worker", "--out", str(out), "--case", json.dumps(case),
               "--steps", str(args.steps), "--accum", str(args.accum)]
        log = open(out / f"host{node}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if codes != [0, 0]:
        raise RuntimeError(f"{case}: exit {codes}; see {out}/host*.log")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="/tmp/lightning_mics_netem")
    ap.add_argument("--case", default="{}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    root = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    names = [f"nm{os.getpid() % 10000}a", f"nm{os.getpid() % 10000}b"]
    rows = []
    t0 = time.monotonic()
    try:
        make_hosts(names)
        for li, (delay, rate) in enumerate([(0, 0), (args.delay_ms, args.rate_mbit)]):
            link = "veth as is" if li == 0 else shape(names, delay, rate)
            for ci, (name, case) in enumerate(CASES.items()):
                res = run_case(names, case, args, root / f"{li}-{ci}", 29600 + 10 * li + ci)
                slowest = max(statistics.median(r["step_s"]) for r in res)
                comm = res[0]["comm"]
                mb = {k.split("/")[1] + "/" + k.split("/")[2]: v / 1e6 for k, v in comm.items()
                      if k.startswith("comm/") and k.endswith("/bytes")}
                rows.append(dict(link=link, case=name, step_s=slowest, mb=mb, params=res[0]["params"]))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for ns in names:
            _ip("netns", "del", ns, check=False)
    groups = sorted({g for r in rows for g in r["mb"]})
    print(f"\n{rows[0]['params'] / 1e6:.2f}M parameters, 4 ranks on 2 hosts, accumulation {args.accum}, "
          f"median of {args.steps} steps after 2, slowest rank; {time.monotonic() - t0:.0f} s wall\n")
    print("| link | case | step s | / s=4 flat | " + " | ".join(f"{g} MB/step" for g in groups) + " |")
    print("|---|---|---|---|" + "---|" * len(groups))
    for r in rows:
        flat = next(x["step_s"] for x in rows if x["link"] == r["link"] and x["case"] == "s=4 flat")
        print(f"| {r['link']} | {r['case']} | {r['step_s']:.3f} | {r['step_s'] / flat:.2f} | "
              + " | ".join(f"{r['mb'].get(g, 0.0):.2f}" for g in groups) + " |")


if __name__ == "__main__":
    main()
