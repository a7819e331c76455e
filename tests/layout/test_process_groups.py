"""The process groups a layout creates are the ones its collectives use ([Note: MiCS layout] in
lightning_mics/layout/topology.py): counted from c10d's own group map on 4 real gloo ranks, for shard groups that span
"nodes" of 2 ranks (two hops: inter, then intra) and of 1 rank (one hop, over the shard group). With NCCL each group
is a communicator, built eagerly when the default group is bound to a device; a second copy of every replica group
(the two-hop gather's mesh used to make one) costs one each."""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed

# (s, ranks_per_node) -> the groups this rank is created into beyond the default group, by their ranks (rank 0)
LAYOUTS = {
    (4, 2): [(0,), (0, 1), (0, 2)],  # replicate (r = 1), intra, inter; the shard group is the default group
    (2, 1): [(0, 1), (0, 2)],  # shard (= inter: one hop), replicate
    (4, 1): [(0,)],  # replicate; shard = inter = the default group
    (2, 2): [(0, 1), (0, 2)],  # one node per shard group: no hops
}


def test_every_group_created_is_used_once(tmp_path):
    res = run_ranks(REPO / "tests" / "layout" / "topology_groups.py", 4,
                    ["--layouts", json.dumps([list(k) for k in LAYOUTS])], tmp_path)
    for r in res:
        for (s, p), got in zip(LAYOUTS, r):
            assert got["created_are_used"], got
            assert got["created"] == got["used"] == got["topology_groups"], got
            assert len(set(map(tuple, got["created"]))) == len(got["created"]), got  # no two with the same ranks
            assert got["two_hop"] == (s > p), got
            if s > p:
                assert got["equal"] and got["nodes"] == [s // p, p] and got["intra"] == (p > 1), got
    assert [[tuple(c) for c in g["created"]] for g in res[0]] == list(LAYOUTS.values())
