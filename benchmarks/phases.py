"""Where one micro-batch's time goes, on 4 local ranks without network namespaces: ``cluster_rank.py``'s cases
(same model, batches, strategies; ranks 0-1 count as one host, 2-3 as the other) with a barrier at each phase
boundary, so phases do not overlap across ranks. Per micro-batch and rank it records the wall time of forward,
backward and the rest (optimizer step), this process's CPU time and minor page faults in each, and ``link``:
from the micro-batch's start to the first collective issued on a group spanning both "hosts" (what
``benchmarks/timeline.py`` calls the compute before the link; ``blink``: the part of it after forward).

    PYTHONPATH=$PWD torchrun --nproc-per-node 4 benchmarks/phases.py --case mics_host --accum 1 --steps 4 --out DIR
    python benchmarks/phases.py --summary DIR [DIR ...]   # medians [min, max] over runs' micro-batches after warmup

Compare two trees A/B by alternating runs of each (the machine's load moves between runs).
"""

import argparse
import glob
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WALL = ("link", "fwd", "bwd", "rest")  # max over ranks (the barriers make them nearly equal)
MEAN = ("cfwd", "cbwd", "crest", "ffwd", "fbwd")  # mean over ranks: CPU seconds, page faults


def summary(dirs):
    vals = {k: [] for k in ("blink", *WALL, *MEAN)}
    for d in dirs:
        ranks = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(os.path.join(d, "rank*.json")))]
        n = len(ranks[0])
        for i in range(max(1, n // 4) if n >= 4 else 1, n):  # the first optimizer step (of 4+) is warmup
            if ranks[0][i]["link"] is not None:  # None: nothing crossed (a micro-batch inside a window)
                vals["blink"].append(statistics.median(r[i]["link"] - r[i]["fwd"] for r in ranks))
                vals["link"].append(max(r[i]["link"] for r in ranks))
            for k in WALL[1:]:
                vals[k].append(max(r[i][k] for r in ranks))
            for k in MEAN:
                vals[k].append(sum(r[i][k] for r in ranks) / len(ranks))
    return {k: (statistics.median(v), min(v), max(v)) for k, v in vals.items() if v}


def main() -> None:
    import cluster_rank as CR

    ap = argparse.ArgumentParser(parents=[CR.parser()])
    ap.add_argument("--case", choices=CR.CASES, required=True)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    hosts = CR.RANKS_PER_HOST
    os.environ.update(LOCAL_RANK=str(rank % hosts), GROUP_RANK=str(rank // hosts), LOCAL_WORLD_SIZE=str(hosts))
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    clock = CR.CommClock(timeline=True)
    clock.install()

    def mark():
        return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    class Phases(L.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, *_):
            dist.barrier()
            self.m0 = mark()

        def on_before_backward(self, *_):
            self.m1 = mark()
            dist.barrier()
            self.t1 = time.perf_counter()

        def on_after_backward(self, *_):
            self.m2 = mark()
            dist.barrier()
            self.t2 = time.perf_counter()

        def on_train_batch_end(self, *_):
            c3 = time.process_time()
            dist.barrier()
            t3 = time.perf_counter()
            (t0, c0, f0), (_, c1, f1), (_, c2, f2) = self.m0, self.m1, self.m2
            cross = [e[0] for e in clock.timeline if e[1] == "issue" and e[2].endswith("/cross") and e[0] >= t0]
            clock.timeline.clear()
            self.rows.append(dict(fwd=self.t1 - t0, bwd=self.t2 - self.t1, rest=t3 - self.t2, cfwd=c1 - c0,
                                  cbwd=c2 - c1, crest=c3 - c2, ffwd=f1 - f0, fbwd=f2 - f1,
                                  link=min(cross) - t0 if cross else None))

    steps = args.warmup + args.steps
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, args.vocab, (steps * args.accum * args.batch, args.seq + 1), generator=g)
    cb = Phases()
    trainer = L.Trainer(accelerator="cpu", devices=hosts, num_nodes=2, max_steps=steps,
                        accumulate_grad_batches=args.accum, strategy=CR.make_strategy(args.case, clock),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[cb])
    trainer.fit(CR.make_module(args.case, args), DataLoader(TensorDataset(tokens), batch_size=args.batch))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(cb.rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--summary":
        for k, (med, lo, hi) in summary(sys.argv[2:]).items():
            print(f"{k:6s} {med:10.3f} [{lo:.3f}, {hi:.3f}]")
    else:
        main()
