"""Chained collectives ([Note: chained collectives] in lightning_mics/comm/collectives.py): the two-hop gather's hops
and the int8 all-reduce's all-to-all and all-gather, with local work between them.

On NCCL the second collective is issued at once, from a side stream, so the compute stream never waits for the
first one; on gloo when the result is first needed. Without a GPU, ``tests/comm/chain_at_issue.py`` runs the
NCCL form on gloo (the host waits for the first collective at issue): the same training must come out bit for bit
equal to the gloo form, each group must see the same collectives in the same order, and both forms must equal
their own run with every collective finishing 30 ms late ([Note: late collectives] in
tests/helpers/late_collectives.py), which a buffer read, written or freed too early would break
([Note: streams and buffer lifetime])."""

import json
from collections import defaultdict

import pytest
import torch

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed

EQUIV = REPO / "tests" / "engine" / "equiv.py"
AT_ISSUE = REPO / "tests" / "comm" / "chain_at_issue.py"
ARGS = ["--model", "gpt", "--optimizer", "adamw", "--threshold", "0", "--layers", "3", "--steps", "2", "--accum",
        "2", "--clip", "1.0", "--late", "0.03", "--count", "--save-states"]
STEPS = int(ARGS[ARGS.index("--steps") + 1])  # the optimizer steps every run takes (the second one
# is the first with the optimizer's state and the residuals of a step before it)
VARIANTS = [
    {"s": 4, "ranks_per_node": 2, "prefetch": 2},  # two hops: inter, then intra
    {"s": 4, "ranks_per_node": 2, "quantize_allgather": True, "prefetch": 2},  # int8 hop 1, dequantized between
    {"s": 2, "quantize_gradients": "error_feedback", "prefetch": 2},  # int8 replica sync: all-to-all, all-gather
    {"s": 2, "ranks_per_node": 1, "quantize_allgather": True},  # one rank per node: one int8 hop, no chain
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, script in (("need", EQUIV), ("issue", AT_ISSUE)):
        d = tmp_path_factory.mktemp(name)
        out[name] = (run_ranks(script, 4, [*ARGS, "--variants", json.dumps(VARIANTS)], d), d)
    return out


def _per_group(events):
    by = defaultdict(list)
    for op, group, nbytes in events:
        if group:
            by[tuple(group)].append((op, nbytes))
    return dict(by)


@pytest.mark.parametrize("k", range(len(VARIANTS)), ids=["two-hop", "two-hop-int8", "int8-replica", "one-hop-int8"])
def test_both_forms_equal_their_late_run_and_each_other(runs, k):
    need, need_dir = runs["need"]
    issue, issue_dir = runs["issue"]
    for res in (need, issue):
        v = res[0]["variants"][k]
        assert "error" not in v, v.get("error")
        late = v["late"]
        assert late["global_step"] == STEPS and sum(late["issued"].values()) > 0, late
        assert late["keys_match"] and late["bit_equal"], (VARIANTS[k], late)
        assert all(r["variants"][k]["late"]["same_comms"] for r in res)
    a, b = torch.load(need_dir / f"state{k}.pt"), torch.load(issue_dir / f"state{k}.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[key], b[key]) for key in a), VARIANTS[k]
    for rn, ri in zip(need, issue):  # every group sees the same collectives in both forms, in the same order but
        intra = (rn["rank"] // 2 * 2, rn["rank"] // 2 * 2 + 1)  # hop 2's: issued as needed, or as the hops 1 were
        for bn, bi in zip(rn["variants"][k]["comms"], ri["variants"][k]["comms"]):
            gn, gi = _per_group(bn), _per_group(bi)
            assert sorted(gn) == sorted(gi), (VARIANTS[k], rn["rank"])
            for g in gn:
                assert (sorted(gn[g]) == sorted(gi[g])) if g == intra and k < 2 else gn[g] == gi[g], (k, g, gn, gi)


def _follows(events, first, second):
    """Whether every ``first`` (op, group) is immediately followed by a ``second``; how many ``first`` there were."""
    pairs = [(op, tuple(g or ())) for op, g, _ in events]
    at = [i for i, e in enumerate(pairs) if e == first]
    return all(i + 1 < len(pairs) and pairs[i + 1] == second for i in at), len(at)


def test_the_second_collective_goes_at_issue_as_on_nccl(runs):
    """The NCCL form issues hop 2 right after hop 1 (at prefetch time), and the int8 all-reduce's all-gather right
    after its all-to-all; the gloo form issues them when the result is needed, so with prefetch 2 another unit's
    first hop comes between."""
    need, issue = runs["need"][0], runs["issue"][0]
    for r_need, r_issue in zip(need, issue):
        rank = r_need["rank"]
        inter, intra = (rank % 2, rank % 2 + 2), (rank // 2 * 2, rank // 2 * 2 + 1)
        replica = (rank % 2, rank % 2 + 2)
        for k, first, second in ((0, ("all_gather", inter), ("all_gather", intra)),
                                 (1, ("all_gather", inter), ("all_gather", intra)),
                                 (2, ("all_to_all", replica), ("all_gather", replica))):
            at_issue = [_follows(b, first, second) for b in r_issue["variants"][k]["comms"]]
            at_need = [_follows(b, first, second) for b in r_need["variants"][k]["comms"]]
            assert all(ok for ok, _ in at_issue) and sum(n for _, n in at_issue) > 0, (k, rank, at_issue)
            if k < 2:
                assert not all(ok for ok, _ in at_need), (k, rank, at_need)
