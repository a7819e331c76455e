"""Fabric with ``16-mixed`` (fp16 autocast + loss scaling) under MiCS, on CPU: Fabric turns precision="16-mixed"
into bf16 there, so the fp16 plugin is passed explicitly with a CPU GradScaler (tests/fabric/fabric_fp16.py)."""

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_fp16")
    cases = ["overflow", "overflow_fused", "clip"]
    return run_ranks(REPO / "tests" / "fabric" / "fabric_fp16.py", 4, ["--world", "4", "--cases", *cases], out)


def test_overflow_on_one_rank_skips_the_step_on_every_rank(four):
    for r in four:
        o = r["overflow"]
        assert o["scaler"] == "ShardedGradScaler", o
        assert o["changed"] == [True, False, True, True], o  # step 1 overflowed on rank 0 only; later steps train
        # the user's GradScaler settings act: init_scale 1024, backed off once, regrown after growth_interval=2
        assert o["scales"] == [1024.0, 512.0, 512.0, 1024.0], o
        assert not o["nonfinite"], o
    assert len({tuple(r["overflow"]["scales"]) for r in four}) == 1


def test_overflow_on_one_rank_skips_the_step_on_every_rank_with_fused_adamw(four):
    """Fused AdamW gets the scale and the inf flag from GradScaler.step (no unscale_ before it): the flag of rank
    0's overflowing shard must reach every rank all the same."""
    for r in four:
        o = r["overflow_fused"]
        assert o["changed"] == [True, False, True, True], o
        assert o["scales"] == [1024.0, 512.0, 512.0, 1024.0], o
        assert not o["nonfinite"], o


def test_clip_by_norm_under_fp16_equals_one_plain_process(four):
    r0 = four[0]["clip"]
    for r in four:  # the unscaled, unsharded norm: the same on every rank, and clipping acts (norm > max_norm 0.5)
        assert r["clip"]["norms"] == r0["norms"] and r["clip"]["scales"] == r0["scales"], (r["clip"], r0)
    assert all(n > 0.55 for n in r0["norms"]), r0
    for got, want in zip(r0["norms"], r0["ref_norms_fp16"]):  # unscaled before the norm (not 65536x)
        assert abs(got - want) <= 1e-3 * want, r0
    assert r0["ref_scales"] == r0["scales"][-1], r0
    # fp16 rounds at 2**-11 ~ 4.9e-4 relative, here in another place (MiCS gathers fp16 parameters, the plain
    # autocast casts fp32 ones per op) and another summation order. The parameters move by r0["moved"] (~1.2e-2
    # of their norm) in 4 steps, so a few fp16 ulps of that is ~1e-5; allowed: 0.5% of the movement. A missing
    # clip (factor 0.5/0.7 on every update) would differ by ~30% of the movement.
    assert r0["rel_fp16"] <= 5e-3 * r0["moved"], r0
