"""Collectives that finish late, as NCCL's do ([Note: late collectives] in tests/helpers/late_collectives.py).

Every layout and option trains twice in the same processes, once on gloo's prompt collectives and once with every
collective run 30 ms after it was issued, on a worker thread per process group; the two full states must be equal
bit for bit, and the same collectives issued. A buffer read before its ``wait()``, written while in flight, or
freed early would make them differ (``test_a_read_before_wait_is_caught`` plants one).
"""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed

EQUIV = REPO / "tests" / "engine" / "equiv.py"
FABRIC = REPO / "tests" / "fabric" / "fabric_loop.py"
BLOCK = "lightning_mics.app.models.gpt.Block"
BASE = ["--model", "gpt", "--optimizer", "adamw", "--threshold", "0", "--layers", "3", "--steps", "2",
        "--accum", "2", "--clip", "1.0", "--late", "0.03", "--keep-groups", "--count"]
STEPS = int(BASE[BASE.index("--steps") + 1])  # the optimizer steps every run takes (the second one
# is the first with the optimizer's state and the residuals of a step before it)

FP32 = [
    {"s": 2, "prefetch": 2},
    {"s": 4, "ranks_per_node": 2},  # two-hop gather: the shard group spans two "nodes"
    {"s": 2, "reshard_after_forward": False},  # keep-gathered
    {"s": 2, "max_live_parameters": 20_000},  # the live cap makes prefetch wait
    {"s": 2, "quantize_gradients": "error_feedback"},
    {"s": 4, "ranks_per_node": 2, "quantize_allgather": True},
    {"s": 2, "shard_optimizer_state": True},  # the optimizer's rows over replicas, with accumulation
    {"s": 1, "shard_optimizer_state": True},  # ZeRO-1
    {"s": 2, "activation_checkpointing": [BLOCK], "checkpoint_group_size": 2, "activation_offload": True},
    {"s": 2, "stop_on_nonfinite": True},
]
BF16 = [
    {"s": 2},
    {"s": 1, "shard_optimizer_state": True},  # ZeRO-1's shown gradients under mixed precision
    {"s": 2, "shard_optimizer_state": True},
    {"s": 2, "quantize_gradients": True, "prefetch": 2},
]
FABRIC_CASES = [
    'late:2:2:adamw:norm:32-true:{"prefetch":2}',
    'late:2:2:adamw:norm:32-true:{"shard_optimizer_state":true}',
    'late:4:2:sgd:value:32-true:{"ranks_per_node":2}',
    'late:2:2:adamw:norm:bf16-mixed:{"quantize_gradients":"error_feedback"}',
    'late:1:2:adamw:norm:bf16-mixed:{"shard_optimizer_state":true}',
    'late:2:2:sgd:norm:32-true:{"reshard_after_forward":false,"max_live_parameters":3000}',
]


def _check_trainer(res, variants):
    for k, v in enumerate(variants):
        run = res[0]["variants"][k]
        assert "error" not in run, run.get("error")
        late = run["late"]
        assert late["global_step"] == STEPS
        assert sum(late["issued"].values()) > 0, (v, late)  # the async collectives did run late
        assert late["keys_match"] and late["bit_equal"], (v, late)
        for r in res:
            assert r["variants"][k]["late"]["same_comms"], (v, r["rank"])


def test_device_delays_reads_and_writes_in_flight(tmp_path):
    res = run_ranks(REPO / "tests" / "comm" / "late_device.py", 2, [], tmp_path)
    for rank, r in enumerate(res):
        prompt, late = r["0.0"], r["0.2"]
        assert late["early"] == [0.0] * 8  # not yet written when read before wait()
        assert late["after"] == [100.0] * 8  # the inputs as written while in flight
        assert late["sync"] == prompt["sync"] == [3.0] * 3
        assert late["objs"] == [{"rank": 0}, {"rank": 1}]
        assert late["issued"] == {"_allgather_base_": 1}


def test_trainer_layouts_equal_their_run_with_late_collectives(tmp_path):
    res = run_ranks(EQUIV, 4, [*BASE, "--variants", json.dumps(FP32)], tmp_path)
    _check_trainer(res, FP32)


def test_trainer_layouts_under_bf16_mixed_equal_their_run_with_late_collectives(tmp_path):
    res = run_ranks(EQUIV, 4, [*BASE, "--precision", "bf16-mixed", "--variants", json.dumps(BF16)], tmp_path)
    _check_trainer(res, BF16)


def test_fabric_loops_equal_their_run_with_late_collectives(tmp_path):
    res = run_ranks(FABRIC, 4, ["--world", "4", "--cases", *FABRIC_CASES], tmp_path)
    for case in FABRIC_CASES:
        got = res[0][case]
        assert sum(got["issued"].values()) > 0, (case, got)
        assert got["bit_equal"], (case, got)
        for r in res:  # the same collectives, in the same order, on every rank
            assert r[case]["collectives"] > 0 and r[case]["same_comms"], (case, r[case])


def test_a_read_before_wait_is_caught(tmp_path):
    """The device can fail a run: the same training with a unit's gathered parameters read before the
    all-gather's wait() ends elsewhere once the collectives finish late."""
    res = run_ranks(REPO / "tests" / "comm" / "late_early_read.py", 4,
                    [*BASE, "--variants", json.dumps([{"s": 2}])], tmp_path)
    late = res[0]["variants"][0]["late"]
    assert sum(late["issued"].values()) > 0
    assert not late["bit_equal"], late
