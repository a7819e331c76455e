"""Mixed precision under sharding: fp16 loss scaling skips an overflowing step on every rank; bf16 trains
close to the fp32 reference; low-precision gathers halve the gathered bytes while reduction stays fp32."""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("optimizer", ["sgd", "fused-adamw"])
def test_fp16_overflow_on_one_rank_skips_step_everywhere(tmp_path, optimizer):
    """Also with fused AdamW, which gets the scale and the inf flag from GradScaler.step (no unscale_ first)."""
    res = run_ranks(REPO / "tests" / "engine" / "fp16_overflow.py", 4, ["--optimizer", optimizer], tmp_path)
    for r in res:
        assert r["scaler"] == "ShardedGradScaler"
        assert r["changed"] == [True, False, True, True], r  # step 1 overflowed on rank 0 only
        assert r["scales"][0] == 65536.0 and r["scales"][1] == 32768.0, r  # the scale backed off once
        assert not r["nan"]
        # as the dispatcher sees them: parameters are gathered in fp16 (half the bytes), gradients reduced in fp32
        assert r["comm_dtypes"]["all_gather"] == ["torch.float16"], r["comm_dtypes"]
        assert r["comm_dtypes"]["reduce_scatter"] == ["torch.float32"], r["comm_dtypes"]
    assert len({tuple(r["scales"]) for r in res}) == 1


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_trains_close_to_fp32_reference(tmp_path, precision):
    """Also with the schedule and activation features on (prefetch 2, blocks checkpointed two at a time with the
    boundary activations offloaded), in keep-gathered mode, with optimizer-state-only sharding and with the
    optimizer's rows over replicas: the same model, under bf16.

    Under ``bf16-mixed`` each also equals one process under MiCS's precision policy (``equiv.reference`` with
    ``cast``: each rank's batch under autocast, the gathered parameters as bf16 copies, the small ones that stay
    replicated in fp32), bit for bit: 0.0 measured, against 1.0e-3 from the fp32 reference (bf16 gradients of 4
    ranks sum exactly in fp32, so no reduction order shows). Casting the replicated ones too ends 1.3e-3 away."""
    variants = [{"s": 2}, {"s": 2, "prefetch": 2, "activation_checkpointing": ["lightning_mics.app.models.gpt.Block"],
                           "checkpoint_group_size": 2, "activation_offload": True},
                {"s": 2, "reshard_after_forward": False}, {"s": 1, "shard_optimizer_state": True},
                {"s": 2, "shard_optimizer_state": True}]
    res = run_ranks(REPO / "tests" / "engine" / "equiv.py", 4,
                    ["--model", "gpt", "--precision", precision, "--accum", "2", "--clip", "1.0",
                     "--variants", json.dumps(variants)], tmp_path)
    for variant in res[0]["variants"]:
        for name, e in variant["errors"].items():
            assert e["rel_norm"] < 2e-2, (name, e)
            assert e["moved"] > 0
        # over the whole model, the distance from the reference against the reference's own training: 8.9e-3
        # (bf16-true) and 4.4e-3 (bf16-mixed) measured, 1 for a run that never stepped. (Per tensor that power is
        # missing: under bf16-true an update below bf16's resolution, such as a LayerNorm weight's here, is lost
        # where the fp32 reference keeps it.)
        errors = variant["errors"].values()
        off = sum((e["rel_update"] * e["moved"]) ** 2 for e in errors) ** 0.5
        assert off <= 0.05 * sum(e["moved"] ** 2 for e in errors) ** 0.5, variant["errors"]
        if precision == "bf16-mixed":
            assert max(variant["policy_max_abs"].values()) <= 1e-6, variant["policy_max_abs"]
