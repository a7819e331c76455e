"""One rank of the process-group count ([Note: MiCS layout] in lightning_mics/layout/topology.py): for each layout, the
groups ``build_topology`` creates (new entries of c10d's group map), the groups the engine runs collectives on (the
mesh's axes and the two-hop gather's groups), and a two-hop all-gather over those groups against the flat one."""

import argparse
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d as c10d  # noqa: E402

from lightning_mics.comm import collectives  # noqa: E402
from lightning_mics.layout.topology import build_topology, plan_layout, release  # noqa: E402


def ranks_of(groups):
    return sorted(tuple(c10d.get_process_group_ranks(g)) for g in groups)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True, help="JSON list of [s, ranks_per_node]")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for s, p in json.loads(args.layouts):
        before = set(c10d._world.pg_map)
        topo = build_topology(plan_layout(world, s, p), "cpu")
        created = [g for g in c10d._world.pg_map if g not in before]
        used = [topo.shard_group, topo.replica_group]
        res = {"s": s, "p": p, "two_hop": topo.layout.hierarchical_possible}
        if topo.layout.hierarchical_possible:
            nodes = topo.node_groups()
            used += [g for g in (nodes.inter, nodes.intra) if g is not None]
            shard = torch.arange(5, dtype=torch.float32) + 10 * rank  # this rank's flat shard
            two_hop = collectives.gathered(collectives.all_gather_two_hop(shard, nodes, async_op=True))
            flat = collectives.gathered(collectives.all_gather_flat(shard, topo.shard_group, s, async_op=True))
            res.update(equal=bool(torch.equal(two_hop, flat)), nodes=[nodes.nodes, nodes.per_node],
                       intra=nodes.intra is not None)
        default = c10d._get_default_group()
        res.update(created=ranks_of(created), used=ranks_of({id(g): g for g in used if g is not default}.values()),
                   created_are_used=all(any(g is u for u in used) for g in created),
                   topology_groups=ranks_of(topo.groups()))
        out.append(res)
        release(topo)
    Path(args.out, f"result{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
