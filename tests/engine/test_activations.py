"""Activation memory: grouped checkpointing and offload measured from outside the strategy, sharded
initialization from the meta device. Equivalence of checkpointing and offload with one plain process is in
test_equivalence.py (every model, every variant); the refusals are in tests/options/."""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
HERE = REPO / "tests" / "engine"
GPT_BLOCK = "lightning_mics.app.models.gpt.Block"


def test_checkpointing_recomputes_and_keeps_fewer_bytes(tmp_path):
    """A 4-block GPT, 2 ranks: bytes autograd keeps for backward, counted by the step's own saved-tensor hooks,
    and forward-only ops (gelu) that run inside backward, counted by a dispatch mode. Off: no recomputation;
    one block per group: each block replayed, fewer bytes kept; two per group: fewer still. These are the bytes in
    autograd's saved tensors only; test_what_checkpointing_keeps_alive counts every holder."""
    variants = [{"s": 2}, {"s": 2, "activation_checkpointing": [GPT_BLOCK]},
                {"s": 2, "activation_checkpointing": [GPT_BLOCK], "checkpoint_group_size": 2}]
    res = run_ranks(HERE / "equiv.py", 2, ["--model", "gpt", "--layers", "4", "--steps", "2", "--count", "--measure",
                                             "--variants", json.dumps(variants)], tmp_path)
    for r in res:
        off, group1, group2 = r["variants"]
        assert off["replayed_forward_ops"] == [0, 0]
        assert group1["replayed_forward_ops"] == group2["replayed_forward_ops"] == [4, 4]  # one gelu per block
        for a, b, c in zip(off["kept_bytes"], group1["kept_bytes"], group2["kept_bytes"]):
            assert c < b < a / 4, (a, b, c)
    for v in res[0]["variants"]:  # and each trains as one plain process does
        assert all(e["max_abs"] <= 1e-7 + 1e-5 * e["ref_max"] for e in v["errors"].values())


def test_strategy_reports_bytes_saved_and_offloaded(tmp_path):
    """Telemetry per optimizer step: bytes saved for backward (fewer with checkpointing) and bytes offloaded."""
    variants = [{"s": 2}, {"s": 2, "activation_checkpointing": [GPT_BLOCK], "checkpoint_group_size": 2,
                           "activation_offload": True}]
    res = run_ranks(HERE / "equiv.py", 2, ["--model", "gpt", "--layers", "4", "--steps", "2", "--count",
                                             "--variants", json.dumps(variants)], tmp_path)
    for r in res:
        off, offload = (v["stats"][-1] for v in r["variants"])
        assert 0 < offload["mem/saved_for_backward_bytes"] < off["mem/saved_for_backward_bytes"]
        assert off["mem/offloaded_bytes"] == 0 < offload["mem/offloaded_bytes"]


@pytest.mark.parametrize("where", ["configure_model", "init_module"])
def test_meta_device_model_is_materialized_as_shards(tmp_path, where):
    """Built on the meta device (in configure_model, or under trainer.init_module(empty_init=True)): during
    setup no rank allocates more than its (padded) 1/s of the model plus one unit, measured with the profiler's
    memory events, which is less than the whole model; the initial values equal the same model built on a real
    device with the same seed; training equals one plain process."""
    res = run_ranks(HERE / "meta_init.py", 2, ["--where", where], tmp_path)
    ref = res[0]
    assert ref["meta_before"]
    assert ref["init_max_abs"] == 0.0
    assert ref["trained_max_abs"] <= 1e-5 * ref["trained_ref_max"]
    for r in res:
        # 16 KiB: what Lightning and c10d allocate around setup besides the model
        assert r["setup_peak"] <= ref["shard_bytes"] + ref["unit_bytes"] + 16 * 1024, (r, ref)
        assert r["setup_peak"] < ref["full_bytes"]


def test_what_checkpointing_keeps_alive(tmp_path):
    """Which blocks' inputs are alive when forward has ended (4-block GPT, read through weak references, so any
    reference counts, not only autograd's saved tensors): all four without checkpointing and with one block per
    group; only each group's first with two per group (the inner block's input is recomputed); none with offload
    (the host copies replace them; on CUDA this is the device memory it frees, measured in benchmarks/gpu_checks.py).
    Each variant still replays every block once in backward, and once the step is done no input is alive, the
    replays' included (offload kept its host copies until the next forward). The same under bf16-mixed, and under
    the Trainer.

    With offload, backward asks each group's host copy back from the hook on the group's output, before its replay
    takes it (on CUDA that copy runs on a side stream; its time in benchmarks/LOG.md), last group first."""
    ac = {"activation_checkpointing": [GPT_BLOCK]}
    grouped = {**ac, "checkpoint_group_size": 2}
    variants = [{}, ac, grouped, {**grouped, "activation_offload": True}, {**ac, "activation_offload": True}]
    bf16 = [{**v, "precision": "bf16-mixed"} for v in variants]
    trainer = [{**v, "front": "trainer"} for v in variants]
    (res,) = run_ranks(HERE / "ac_alive.py", 1, ["--variants", json.dumps(variants + bf16 + trainer)], tmp_path)
    assert [r["alive"] for r in res] == 3 * [[True] * 4, [True] * 4, [True, False, True, False], [False] * 4,
                                             [False] * 4]
    assert [r["replays"] for r in res] == 3 * [0, 4, 4, 4, 4]
    assert [r["alive_after_step"] for r in res] == 15 * [0]  # nothing kept past backward, replays' inputs included
    fabric_32, fabric_bf16, trainer_32 = res[:5], res[5:10], res[10:]
    assert len({r["loss"] for r in fabric_32 + trainer_32}) == len({r["loss"] for r in fabric_bf16}) == 1

    def in_order(groups):  # last group first: its hook asks for its copy, then its replay takes it
        return [[e, g] for g in reversed(range(groups)) for e in ("ask", "take")]
    assert [r["copies"] for r in res] == 3 * [[], [], [], in_order(2), in_order(4)]
