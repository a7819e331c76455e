"""One rank of the late-collectives device's own check ([Note: late collectives] in tests/helpers/late_collectives.py):
under the device an async all-gather's output read before ``wait()`` is still unwritten, and an input written
while the collective is in flight is sent as written; a blocking collective and an object collective still run,
in their group's order."""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.late_collectives import LateCollectives  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sub = dist.new_group([0, 1])
    res = {}
    for delay in (0.0, 0.2):
        with LateCollectives(delay) if delay else contextlib.nullcontext() as late:
            x = torch.full((4,), float(rank + 1))
            out = torch.zeros(8)
            work = dist.all_gather_into_tensor(out, x, async_op=True)
            early = out.clone()
            x.fill_(100.0)  # written while in flight
            work.wait()
            y = torch.full((3,), float(rank + 1))
            dist.all_reduce(y, group=sub)
            objs = [None, None]
            dist.all_gather_object(objs, {"rank": rank})
            res[str(delay)] = {"early": early.tolist(), "after": out.tolist(), "sync": y.tolist(), "objs": objs,
                               "issued": dict(late.issued) if delay else None}
    dist.barrier()
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
