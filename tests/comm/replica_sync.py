"""One rank: the replica all-reduce of a unit's accumulator, issued early, with a reduction that finishes after
it was issued ([Note: replica sync overlap] in gradients.py). The late part goes to a second buffer all-reduced at
the end; the result must equal one all-reduce of the sum, for contiguous and non-contiguous buckets."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_mics.options import MiCSConfig  # noqa: E402
from lightning_mics.engine.engine import MiCSEngine  # noqa: E402
from lightning_mics.layout.topology import build_topology, plan_layout  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(7, 5)
        self.frozen = torch.nn.Linear(5, 3)  # between two trainable ones: buckets over non-consecutive slots
        self.frozen.requires_grad_(False)
        self.b = torch.nn.Linear(5, 9)


def main() -> None:
    own = not dist.is_initialized()  # run after other scripts in one launch (tests/helpers/chain.py): theirs
    if own:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ModuleList([Block(), Block()]))
    topo = build_topology(plan_layout(world, 2, 2), "cpu")
    results = []
    for bucket_size in (int(5e8), 40):  # one bucket per unit / several, some non-consecutive
        options = MiCSConfig(param_persistence_threshold=0, reduce_bucket_size=bucket_size, kernels="torch").freeze()
        engine = MiCSEngine(model, topo, options.resolved("32-true", False), torch.device("cpu"))
        for k, unit in enumerate(engine.units):
            if not unit.trainable():
                continue
            grads = engine.grads.of(unit)
            n = unit.shard_flat.numel()
            g = torch.Generator().manual_seed(100 * rank + k)
            first, late = torch.randn(n, generator=g), torch.randn(n, generator=g)
            expected = first + late
            dist.all_reduce(expected, group=topo.replica_group)
            grads.accum = first.clone()
            grads.issue_replica_sync()
            assert grads.replica_issued
            for bucket in grads.buckets(unit.trainable()):  # reductions finishing after the issue
                if bucket.lo >= 0:
                    grads._accumulate(bucket, late[bucket.lo:bucket.hi])
                else:
                    regions = grads._regions(bucket, late)
                    grads._accumulate(bucket, torch.cat(regions))
            grads.finish_replica_sync()
            mask = torch.zeros(n, dtype=torch.bool)  # only the trainable parameters' regions are synced
            for i in unit.trainable():
                sp = unit.params[i]
                mask[sp.offset:sp.offset + sp.rows.padded_numel] = True
            err = (grads.accum - expected)[mask].abs().max().item()
            nonconsecutive = any(b.lo < 0 for b in grads.buckets(unit.trainable()))
            results.append({"bucket_size": bucket_size, "unit": unit.path, "err": err,
                            "late_left": grads.accum_after_issue is not None, "issued": grads.replica_issued,
                            "nonconsecutive": nonconsecutive})
            grads.accum = None
        engine.remove_hooks()
        engine.restore_module()
    out = Path(sys.argv[sys.argv.index("--out") + 1]) / f"result{rank}.json"
    out.write_text(json.dumps({"rank": rank, "results": results}))
    if own:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
