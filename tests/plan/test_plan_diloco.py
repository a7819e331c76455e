"""The planner with ``replica_sync="diloco"`` ([Note: planner DiLoCo] in plan/estimate.py) against real 4-rank fits
(s = 2, two replica groups, sync_every = 2, 4 steps: steps 2 and 4 end with the outer sync), tests/plan/plan_fit.py:

- model-state bytes per rank (the anchors and the outer momentum counted as optimizer state) equal
  ``MiCSStrategy.model_state_bytes()`` after the fit;
- an inner step's bytes per collective and group equal the strategy's telemetry and the dispatcher's c10d ops
  (no replica traffic; the replicated parameters' all-reduce on the shard group);
- a sync step adds exactly ``outer_sync_comm`` (one all-reduce on the replica group: fp32, or the int8 wire);
- the plan's replica link carries the sync's mean per step, and a degree with one replica group is refused.
"""

import json
from collections import defaultdict
from dataclasses import asdict

import pytest

import lightning_mics
from lightning_mics.layout.topology import plan_layout
from lightning_mics.plan import Settings, comm_per_step, estimate, model_state_bytes
from lightning_mics.plan.estimate import degrees_to_plan, outer_sync_comm
from tests.helpers.launch import REPO, run_ranks

SCRIPT = REPO / "tests" / "plan" / "plan_fit.py"
WORLD, S, H, STEPS = 4, 2, 2, 4
VARIANTS = [
    dict(model="gpt", sharded_data_parallel_degree=S, param_persistence_threshold=100, replica_sync="diloco",
         sync_every=H),  # the paper's outer settings: Nesterov momentum 0.9, lr 0.7
    dict(model="gpt", sharded_data_parallel_degree=S, param_persistence_threshold=100, replica_sync="diloco",
         sync_every=H, outer_momentum=0.0, outer_nesterov=False, outer_lr=1.0, quantize_gradients=True,
         quantization_block_size=512),  # int8 pseudo-gradients, no outer momentum
]


def _settings(v):
    return Settings(nodes=1, gpus_per_node=WORLD, precision="32-true", optimizer="adamw",
                    param_persistence_threshold=v["param_persistence_threshold"], replica_sync="diloco",
                    sync_every=H, outer_lr=v.get("outer_lr", 0.7), outer_momentum=v.get("outer_momentum", 0.9),
                    outer_nesterov=v.get("outer_nesterov", True),
                    quantize_gradients=v.get("quantize_gradients", False),
                    quantization_block_size=v.get("quantization_block_size", 2048))


def _telemetry(stats):
    return {k[len("comm/"):-len("/bytes")]: {"bytes": int(val), "calls": int(stats[k[:-5] + "calls"])}
            for k, val in stats.items() if k.startswith("comm/") and k.endswith("/bytes")}


def _dispatched(events, layout, quantized):
    """The c10d ops of one step by the telemetry's names (the int8 all-reduce: its all-to-all, counted once)."""
    seen = defaultdict(lambda: {"bytes": 0, "calls": 0})
    for op, group, nbytes in events:
        name = "replicate" if list(group) == layout.replica_group_of(0) else "shard"
        assert name == "replicate" or list(group) == layout.shard_group_of(0), (op, group)
        if quantized and name == "replicate":
            if op == "all_gather":
                continue  # the second collective of the int8 all-reduce, the same wire
            op = "all_reduce" if op == "all_to_all" else op
        if op in ("all_gather", "reduce_scatter", "all_reduce"):
            seen[f"{op}/{name}"]["bytes"] += nbytes
            seen[f"{op}/{name}"]["calls"] += 1
    return dict(seen)


def _plus(a, b):
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        entry = out.setdefault(k, {"bytes": 0, "calls": 0})
        entry["bytes"] += v["bytes"]
        entry["calls"] += v["calls"]
    return out


@pytest.mark.distributed
def test_planner_matches_diloco_fits(tmp_path):
    from tests.plan.plan_fit import build

    res = run_ranks(SCRIPT, WORLD, ["--variants", json.dumps(VARIANTS), "--steps", str(STEPS)], tmp_path)
    layout = plan_layout(WORLD, S, None)
    for i, v in enumerate(VARIANTS):
        st = _settings(v)
        spec = lightning_mics.plan(build(v["model"]), degrees=[S], **asdict(st)).model
        for rank in range(WORLD):
            assert model_state_bytes(spec, st, S, rank % S, rank // S) == res[rank]["variants"][i]["state"], (v, rank)
        measured = res[0]["variants"][i]
        assert len(measured["stats"]) == STEPS
        inner, sync = comm_per_step(spec, st, S), outer_sync_comm(spec, st, S)
        assert "all_reduce/replicate" not in inner and list(sync) == ["all_reduce/replicate"]
        quantized = bool(v.get("quantize_gradients"))
        assert _telemetry(measured["stats"][2]) == inner, (v, inner, measured["stats"][2])  # step 3: inside a window
        assert _telemetry(measured["stats"][3]) == _plus(inner, sync), (v, sync)  # step 4: ends with the outer sync
        assert _dispatched(measured["steps"][2], layout, quantized) == inner
        assert _dispatched(measured["steps"][3], layout, quantized) == _plus(inner, sync)
        est = estimate(spec, st, S)
        assert est.outer_sync == sync and est.link_bytes["replica"] == sync["all_reduce/replicate"]["bytes"] // H


def test_exact_sync_plans_as_before_and_one_replica_group_is_refused():
    spec = lightning_mics.plan("gpt", nodes=1, gpus_per_node=4, degrees=[2]).model
    exact = Settings(nodes=1, gpus_per_node=4, param_persistence_threshold=100)
    diloco = Settings(nodes=1, gpus_per_node=4, param_persistence_threshold=100, replica_sync="diloco", sync_every=8)
    assert outer_sync_comm(spec, exact, 2) == {} and "all_reduce/replicate" in comm_per_step(spec, exact, 2)
    assert estimate(spec, diloco, 2).link_bytes["replica"] < estimate(spec, exact, 2).link_bytes["replica"]
    assert degrees_to_plan(diloco) == [1, 2]
    with pytest.raises(ValueError, match=r"plan option degrees=\[4\].*replica_sync='diloco'"):
        degrees_to_plan(diloco, [4])
    with pytest.raises(ValueError, match="sync_every=0"):
        Settings(nodes=1, gpus_per_node=4, replica_sync="diloco", sync_every=0)


def test_streaming_fragments_plan_one_fragment_per_sync():
    """With ``sync_fragments`` F ([Note: planner DiLoCo]): one sync is the largest fragment's all-reduce (the engine's
    cut of the units, [Note: streaming fragments] in engine/fragments.py), the fragments together are the whole shard's,
    and the mean per step is F = 1's up to rounding. The cut is the one a real fit makes (tests/diloco checks the
    engine's fragments and their bytes on the dispatcher)."""
    from lightning_mics.plan.estimate import outer_syncs

    spec = lightning_mics.plan("llama-2-7b", nodes=2, gpus_per_node=8, degrees=[8]).model
    whole = Settings(nodes=2, gpus_per_node=8, replica_sync="diloco", sync_every=16)
    parts = Settings(nodes=2, gpus_per_node=8, replica_sync="diloco", sync_every=16, sync_fragments=4, sync_delay=3)
    total = outer_sync_comm(spec, whole, 8)["all_reduce/replicate"]["bytes"]
    frags = [c["all_reduce/replicate"]["bytes"] for c in outer_syncs(spec, parts, 8)]
    assert len(frags) == 4 and sum(frags) == total
    assert outer_sync_comm(spec, parts, 8)["all_reduce/replicate"]["bytes"] == max(frags) <= 0.3 * total
    a, b = estimate(spec, whole, 8).link_bytes["replica"], estimate(spec, parts, 8).link_bytes["replica"]
    assert abs(a - b) <= 4
    with pytest.raises(ValueError, match="sync_delay=4"):
        Settings(nodes=2, gpus_per_node=8, replica_sync="diloco", sync_every=16, sync_fragments=4, sync_delay=4)
