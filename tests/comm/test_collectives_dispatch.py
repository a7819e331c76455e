"""Which collective runs on which group, how often: counted by a TorchDispatchMode around every batch.

Every run of this file (equiv.py's fits, staging.py's, replica_sync.py's, torch_names.py's) goes in one launch of
4 ranks, one script after another in the same processes (``tests/helpers/chain.py``), each with the arguments it had
in a launch of its own: a launch's start costs more than its small fits (10 forked launches and 2 of fresh
interpreters were 83 CPU-seconds for the file; one launch, 30).
Each test reads its own run's results."""

import json
from collections import Counter

import pytest

from tests.helpers.chain import run_chain
from tests.helpers.launch import REPO

SCRIPT = REPO / "tests" / "engine" / "equiv.py"
pytestmark = pytest.mark.distributed

SHARD = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
REPLICA = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
WORLD = [0, 1, 2, 3]
WORLD_T = tuple(WORLD)


RUNS = {  # name: (script, its arguments), every one on 4 ranks
    "two_hop_sync": (SCRIPT, ["--model", "gpt", "--s", "2", "--steps", "2", "--accum", "4", "--bucket", "3000",
                              "--clip", "1.0", "--count"]),
    # the telemetry's bytes and the replica all-reduce's order: the same fit
    "accum2": (SCRIPT, ["--model", "gpt", "--s", "2", "--steps", "2", "--accum", "2", "--count"]),
    "two_hop_groups": (SCRIPT, ["--model", "gpt", "--steps", "2", "--count", "--variants", json.dumps(
        [{"s": 4, "ranks_per_node": 2}, {"s": 4, "ranks_per_node": 2, "hierarchical_allgather": False}])]),
    "prefetch": (SCRIPT, ["--model", "gpt", "--layers", "4", "--steps", "3", "--count", "--markers", "--variants",
                          json.dumps([{"s": 2, "prefetch": 0}, {"s": 2, "prefetch": 2}])]),
    "live_cap": (SCRIPT, ["--model", "gpt", "--layers", "4", "--steps", "2", "--count", "--variants", json.dumps(
        [{"s": 2, "prefetch": 2, "max_live_parameters": 20000}, {"s": 2, "prefetch": 2}])]),
    "replicated_buckets": (SCRIPT, ["--model", "gpt", "--s", "2", "--threshold", "200", "--bucket", "64", "--count"]),
    "staging_32-true": (REPO / "tests" / "comm" / "staging.py", ["--accum", "2", "--steps", "2", "--precision",
                                                                  "32-true"]),
    "staging_bf16-mixed": (REPO / "tests" / "comm" / "staging.py", ["--accum", "2", "--steps", "2", "--precision",
                                                                     "bf16-mixed"]),
    "replica_sync": (REPO / "tests" / "comm" / "replica_sync.py", []),
    # last: they leave their recorders on torch.distributed, the second without the new names
    "names_new": (REPO / "tests" / "comm" / "torch_names.py", []),
    "names_old": (REPO / "tests" / "comm" / "torch_names.py", ["--old-names"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: the ranks' results}: every run of ``RUNS`` in one launch of 4 ranks."""
    names = list(RUNS)
    res = run_chain(4, [RUNS[n] for n in names], tmp_path_factory.mktemp("dispatch"))
    return dict(zip(names, res))


def test_two_hop_sync_with_accumulation(runs):
    accum, steps = 4, 2
    res = runs["two_hop_sync"]
    for r in res:
        rank = r["rank"]
        n_buckets, n_units = r["state_bytes"]["n_buckets"], r["state_bytes"]["n_units"]
        assert n_buckets > n_units  # buckets split units here
        assert len(r["comms"]) == steps * accum
        for i, events in enumerate(r["comms"]):
            c = Counter((op, tuple(g)) for op, g, _ in events)
            boundary = (i + 1) % accum == 0
            # All-gathers only in the shard group ([Note: keep for backward] in schedule.py): forward gathers
            # every block, and the root only in the first micro-batch of a window (it stays gathered from one
            # micro-batch into the next until the optimizer step); backward gathers every block except the last
            # one of the forward, which stays gathered once the order is recorded (from the second micro-batch).
            blocks = n_units - 1
            forward = blocks + (1 if i % accum == 0 else 0)
            backward = blocks - (1 if i > 0 else 0)
            assert c[("all_gather", tuple(SHARD[rank]))] == forward + backward, (i, c)
            # reduce-scatter of every bucket, every micro-batch, only in the shard group
            assert c[("reduce_scatter", tuple(SHARD[rank]))] == n_buckets, (i, c)
            # replica all-reduce: once per bucket, only at the accumulation boundary
            assert c[("all_reduce", tuple(REPLICA[rank]))] == (n_buckets if boundary else 0), (i, c)
            # the whole world: one all-reduce (replicated small params + used-flags) at the boundary only
            assert c[("all_reduce", tuple(WORLD))] == (1 if boundary else 0), (i, c)
            # clipping: the norm is reduced over the shard group only, at the boundary
            assert c[("all_reduce", tuple(SHARD[rank]))] == (1 if boundary else 0), (i, c)
            allowed = {("all_gather", tuple(SHARD[rank])), ("reduce_scatter", tuple(SHARD[rank])),
                       ("all_reduce", tuple(REPLICA[rank])), ("all_reduce", tuple(WORLD)),
                       ("all_reduce", tuple(SHARD[rank]))}
            assert set(c) <= allowed, set(c) - allowed


def test_telemetry_bytes_agree_with_dispatch(runs):
    """The strategy's own per-step byte counters (logged to Lightning's loggers) equal what the dispatcher saw."""
    accum = 2
    res = runs["accum2"]
    for r in res:
        rank = r["rank"]
        groups = {"shard": SHARD[rank], "replicate": REPLICA[rank], "world": WORLD}
        for step in range(2):
            window = [e for batch in r["comms"][step * accum:(step + 1) * accum] for e in batch]
            stats = r["stats"][(step + 1) * accum - 1]
            for op, gname in [("all_gather", "shard"), ("reduce_scatter", "shard"), ("all_reduce", "replicate"),
                              ("all_reduce", "world")]:
                seen = sum(n for o, g, n in window if o == op and g == groups[gname])
                assert stats[f"comm/{op}/{gname}/bytes"] == seen, (op, gname, stats, seen)


def _cross_node_bytes(events, rank, per_node):
    """Bytes of all-gather output that came from ranks on other nodes (a group's output is split evenly)."""
    node = rank // per_node
    return sum(n * sum(1 for x in g if x // per_node != node) / len(g)
               for op, g, n in events if op == "all_gather" and g)


def test_two_hop_all_gather_groups_and_cross_node_bytes(runs):
    """s = 4 over 2 simulated nodes of 2 ranks: the two-hop gather runs on the inter group (same local rank,
    other node), then the intra group, and brings half the bytes across nodes that the flat gather does."""
    res = runs["two_hop_groups"]
    for r in res:
        rank = r["rank"]
        two_hop, flat = r["variants"]
        inter = tuple(j for j in range(4) if j % 2 == rank % 2)
        intra = tuple(j for j in range(4) if j // 2 == rank // 2)
        for events in two_hop["comms"]:
            c = Counter((op, tuple(g)) for op, g, _ in events if op == "all_gather")
            assert set(c) == {("all_gather", inter), ("all_gather", intra)}, c
            assert c[("all_gather", inter)] == c[("all_gather", intra)] > 0
        for events in flat["comms"]:
            assert {tuple(g) for op, g, _ in events if op == "all_gather"} == {WORLD_T}
        gathers = sum(1 for events in two_hop["comms"] for op, g, _ in events if op == "all_gather"
                      and tuple(g) == inter)
        assert gathers == sum(1 for events in flat["comms"] for op, _, _ in events if op == "all_gather")
        cross_two_hop = sum(_cross_node_bytes(e, rank, 2) for e in two_hop["comms"])
        cross_flat = sum(_cross_node_bytes(e, rank, 2) for e in flat["comms"])
        assert cross_two_hop * 2 == cross_flat > 0


def test_prefetch_issues_the_next_units_before_a_forward_runs(runs):
    """A 4-block GPT: by the time block k's forward runs, the root and blocks 0..k are gathered and, with
    prefetch p, the next p blocks' all-gathers have been issued (from the second step on: the recorded order)."""
    blocks = 4
    res = runs["prefetch"]
    for r in res:
        for prefetch, v in zip((0, 2), r["variants"]):
            gathers, seen = 0, 0
            for op, _, _ in v["comms"][-1]:
                if op == "all_gather":
                    gathers += 1
                elif op.startswith("forward:model.h."):
                    k = int(op.rsplit(".", 1)[1])
                    assert gathers == min(1 + (k + 1) + prefetch, 1 + blocks), (prefetch, k, gathers)
                    seen += 1
                elif op == "reduce_scatter":
                    break  # backward
            assert seen == blocks
        # telemetry: time spent waiting on communication, per optimizer step
        assert all(st["time/comm_wait_s"] >= 0 for st in r["variants"][1]["stats"])


def test_live_gathered_parameters_stay_within_the_cap(runs):
    """Live gathered elements, measured from storages at every dispatched op (tests/helpers/live.py): with
    prefetch 2 and max_live_parameters set, never more than the cap plus the largest unit; without the cap,
    more than that is alive, so the cap was what held it."""
    cap = 20000
    res = runs["live_cap"]
    for r in res:
        capped, free = r["variants"]
        largest = max(capped["state_bytes"]["unit_numels"])
        assert capped["live_peak"] / 4 <= cap + largest, (capped["live_peak"] / 4, cap, largest)
        assert free["live_peak"] / 4 > cap + largest
    # and it still trains right
    assert all(e["max_abs"] <= 1e-7 + 1e-5 * e["ref_max"] for e in res[0]["variants"][0]["errors"].values())


def test_replicated_gradients_are_reduced_in_buckets_during_backward(runs):
    """Replicated parameters' gradients go in buckets as they become ready, as DDP does: with small buckets,
    several world all-reduces at the boundary, the first before backward's last reduce-scatter."""
    res = runs["replicated_buckets"]
    for r in res:
        ops = [(op, tuple(g) if g else None) for op, g, _ in r["comms"][-1]]
        world = [i for i, (op, g) in enumerate(ops) if op == "all_reduce" and g == WORLD_T]
        scatters = [i for i, (op, g) in enumerate(ops) if op == "reduce_scatter"]
        assert len(world) > 1 and world[0] < scatters[-1], ops


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_reduce_scatter_input_lies_in_the_released_units_storage(runs, precision):
    """[Note: staging in place] in full_storage.py: a unit released after its reduce-scatter lays the input out in
    its own full-parameter storage, which is freed once the collective is done; the root, kept gathered inside
    the accumulation window, stages elsewhere until the boundary. Under bf16-mixed the fp32 input does not fit
    the bf16 storage: every unit stages in a buffer of its own. The result equals one plain process."""
    accum = 2
    res = runs[f"staging_{precision}"]
    for r in res:
        root, blocks = r["units"][0], r["units"][1:]
        assert len(blocks) == 2 and len(r["staged"]) == 2 * accum, r
        for i, (staged, held) in enumerate(zip(r["staged"], r["held"])):
            boundary = (i + 1) % accum == 0
            if precision == "bf16-mixed":
                expect = [None] * (len(blocks) + 1)
            else:
                expect = [*blocks, root if boundary else None]
            assert sorted(staged, key=str) == sorted(expect, key=str), (r["rank"], i, staged)
            # after the batch: nothing left allocated but the root inside the window
            assert held == ([] if boundary else [root]), (r["rank"], i, held)
    if precision == "32-true":
        assert res[0]["max_rel"] < 1e-5, res[0]["max_rel"]


def test_replica_all_reduce_starts_during_the_boundary_backward(runs):
    """[Note: replica sync overlap] in gradients.py: in the boundary micro-batch a unit's replica all-reduce is
    issued as soon as its reduce-scatter is done, before the backward's last reduce-scatter, in the fixed order
    reversed(units) on every rank; the first one right after its own reduce-scatter (nothing crosses the replica
    link before it); the micro-batches before the boundary issue none."""
    accum = 2
    res = runs["accum2"]
    for r in res:
        rank = r["rank"]
        n_units = r["state_bytes"]["n_units"]
        for i, events in enumerate(r["comms"]):
            ops = [(op, tuple(g)) for op, g, _ in events]
            replica = [k for k, o in enumerate(ops) if o == ("all_reduce", tuple(REPLICA[rank]))]
            scatters = [k for k, o in enumerate(ops) if o[0] == "reduce_scatter"]
            if (i + 1) % accum:
                assert not replica, ops
                continue
            assert len(replica) == len(scatters) == n_units, ops  # one bucket per unit here
            # the first before the second reduce-scatter: its reduce-scatter was finished at once
            assert scatters[0] < replica[0] < scatters[1], ops
            # every later one after the next unit's reduce-scatter (one stays in flight) and before the one
            # after that; all but the root's (the backward's last unit) and the one before it start before the
            # last reduce-scatter is issued
            assert all(scatters[k + 1] < replica[k] for k in range(1, n_units - 1)), ops
            assert all(replica[k] < scatters[k + 2] for k in range(n_units - 2)), ops
            assert scatters[-1] < replica[-1], ops
            assert sum(k < scatters[-1] for k in replica) == n_units - 2, ops


def test_a_reduction_after_the_replica_all_reduce_was_issued_is_added(runs):
    """The late part of an accumulator goes to a second buffer all-reduced at the end: the result equals one
    all-reduce of the sum, for buckets over consecutive and non-consecutive parameters (a frozen one between)."""
    res = runs["replica_sync"]
    for r in res:
        assert len(r["results"]) == 6, r  # root + 2 blocks, 2 bucket sizes
        assert any(e["nonconsecutive"] for e in r["results"]), r
        for e in r["results"]:
            assert e["err"] <= 1e-6 and not e["late_left"] and not e["issued"], e


@pytest.mark.parametrize("old_names", [False, True], ids=["torch-2.13-names", "older-torch-names"])
def test_engine_collectives_run_under_either_torch_name(runs, old_names):
    """Users on GPUs bring their own torch: where ``all_gather_single`` / ``reduce_scatter_single`` do not exist
    yet (before 2.13) the engine calls the older names, and on 2.13 the new ones (no deprecation warning).
    torch_names.py removes the new names from ``torch.distributed`` and wraps every name in a recorder after the
    package was imported (the ranks are forked from the preloaded server, no longer fresh interpreters): the
    engine looks the name up at each call, and one that bound a name at import would call none of the recorders
    (``called`` empty) and fail here. The two runs end the module's launch, the older names last."""
    res = runs["names_old" if old_names else "names_new"]
    for r in res:
        assert r["gather_ok"] and r["scatter_ok"]
        if old_names or not r["has_new_names"]:
            assert r["called"] == ["all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensor"]
        else:
            assert r["called"] == ["all_gather_single", "reduce_scatter_single", "all_gather_single"]
            assert r["future_warnings"] == []


def test_the_package_calls_the_renamed_collectives_only_through_collectives_py():
    """One place decides which name a torch has: nothing else in the package names either spelling on ``dist``."""
    import re
    pattern = re.compile(r"dist\.(all_gather_single|reduce_scatter_single|all_gather_into_tensor|reduce_scatter_tensor)\(")
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "lightning_mics").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found
