"""Sharded training equals one plain process on the same global batches (real processes, gloo, Trainer).

Each launch starts 4 ranks of ``tests/engine/equiv.py``, which fit the cases that share its arguments one after
another (``--variants``: each a fresh Trainer in the same processes, process start-up being most of a small fit's
cost); rank 0 also trains the reference once (same init, same optimizer, global batch = the union of the ranks'
batches) and reports per-parameter differences for each case.
"""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

SCRIPT = REPO / "tests" / "engine" / "equiv.py"
pytestmark = pytest.mark.distributed


def _run(tmp_path, *args, world=4):
    return run_ranks(SCRIPT, world, list(args), tmp_path)


def _assert_matches(result, rtol, atol, frozen=()):
    errs = result["errors"]
    assert errs, "reference comparison missing"
    for name, e in errs.items():
        assert e["shape_ok"], name
        assert e["max_abs"] <= atol + rtol * e["ref_max"], (name, e)
        if name in frozen:
            assert e["moved"] == 0.0 and e["max_abs"] == 0.0, (name, e)
    moved = [n for n, e in errs.items() if e["moved"] > 0]
    assert len(moved) >= len(errs) - len(frozen), "training did not move the parameters"


TIED_FIXED = ("frozen.weight", "frozen.bias", "unused.weight", "unused.bias")

# Every layout (s, r) in {(1,4), (2,2), (4,1)}; prefetch 0 and 2 besides the default 1; the two-hop all-gather
# (s = 4 over 2 simulated nodes of 2 ranks); activation checkpointing of each model's blocks, one at a time,
# grouped by 2, and grouped with the boundary activations offloaded; optimizer-state-only sharding (s = 1), the
# optimizer's rows over replicas (s = 2 with shard_optimizer_state) and keep-gathered mode. Trained one after
# another in the same 4 processes, with accumulation 2, each against the same single-process reference.
BLOCKS = {"gpt": "lightning_mics.app.models.gpt.Block", "demo": "torch.nn.TransformerEncoderLayer",
          "tied": "torch.nn.Sequential"}
VARIANTS = {
    "s1": {"s": 1}, "s2": {"s": 2}, "s4": {"s": 4},
    "s2-prefetch0": {"s": 2, "prefetch": 0}, "s2-prefetch2": {"s": 2, "prefetch": 2},
    "s4-two-hop": {"s": 4, "ranks_per_node": 2},
    "s2-checkpoint": {"s": 2, "activation_checkpointing": "BLOCK"},
    "s2-checkpoint-group2": {"s": 2, "activation_checkpointing": "BLOCK", "checkpoint_group_size": 2},
    "s2-checkpoint-group2-offload": {"s": 2, "activation_checkpointing": "BLOCK", "checkpoint_group_size": 2,
                                     "activation_offload": True},
    "s1-optimizer-state": {"s": 1, "shard_optimizer_state": True},
    "s2-optimizer-over-replicas": {"s": 2, "shard_optimizer_state": True},  # [Note: optimizer rows over replicas]
    "s2-keep-gathered": {"s": 2, "reshard_after_forward": False},
}


TRITON = {"s": 2, "kernels": "triton"}  # test_engine_with_triton_kernels_matches: the tied model's launch, last


def _for_model(model):
    variants = [{k: ([BLOCKS[model]] if v == "BLOCK" else v) for k, v in variant.items()} for variant in VARIANTS.values()]
    if model == "tied":  # its blocks are residual (x + b(x)): not a sequential stack, grouping is refused for it
        variants = [dict(v, checkpoint_group_size=1) if "checkpoint_group_size" in v else v for v in variants]
        variants.append(TRITON)
    return variants


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    runs = {}

    def get(model):
        if model not in runs:
            d = tmp_path_factory.mktemp(model)
            res = run_ranks(SCRIPT, 4, ["--model", model, "--steps", "4", "--accum", "2",
                                        "--keep-groups", "--variants", json.dumps(_for_model(model))], d)
            runs[model] = res
        return runs[model]
    return get


@pytest.mark.parametrize("model", ["gpt", "demo", "tied"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sgd_matches_single_process(layouts, model, variant):
    res = layouts(model)
    k = list(VARIANTS).index(variant)
    for r in res:
        assert "error" not in r["variants"][k], r["variants"][k].get("error")
    _assert_matches(res[0]["variants"][k], rtol=1e-5, atol=1e-7, frozen=TIED_FIXED if model == "tied" else ())
    assert all(r["variants"][k]["global_step"] == 4 for r in res)
    # self.log(..., sync_dist=True) in validation: the same reduced value on every rank
    assert len({r["variants"][k]["val_loss"] for r in res}) == 1


@pytest.fixture(scope="module")
def adamw(tmp_path_factory):
    """The GPT under AdamW at s = 2 and s = 4, one launch: the param groups' equivalence (s = 2) and the state
    per rank (both)."""
    return run_ranks(SCRIPT, 4, ["--model", "gpt", "--optimizer", "adamw", "--steps", "4", "--keep-groups",
                                 "--variants", json.dumps([{"s": 2}, {"s": 4}])], tmp_path_factory.mktemp("adamw"))


def test_adamw_param_groups_match(adamw):
    for r in adamw:
        assert "error" not in r["variants"][0], r["variants"][0]["error"]
    # Adam divides by sqrt(v): where a gradient is ~0, 1e-9 differences in it change that element's update,
    # so the bound is on each tensor's relative error, ||p - p_ref|| / ||p_ref||.
    for name, e in adamw[0]["variants"][0]["errors"].items():
        assert e["rel_norm"] <= 1e-5, (name, e)
        assert e["moved"] > 0, name


CLIPPED = {"s2": {"s": 2}, "s1": {"s": 1}, "s2-optimizer-over-replicas": {"s": 2, "shard_optimizer_state": True}}


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    """Accumulation 4 with clipping and small buckets, the three layouts one after another in one launch."""
    return run_ranks(SCRIPT, 4, ["--model", "tied", "--steps", "4", "--accum", "4", "--clip", "0.05", "--bucket",
                                 "500", "--keep-groups", "--variants", json.dumps(list(CLIPPED.values()))],
                     tmp_path_factory.mktemp("clipped"))


@pytest.mark.parametrize("variant", list(CLIPPED))
def test_accumulation_and_clipping_match(clipped, variant):
    res = clipped[0]["variants"][list(CLIPPED).index(variant)]
    assert "error" not in res, res["error"]
    _assert_matches(res, rtol=1e-5, atol=1e-7, frozen=TIED_FIXED)
    assert all(n > 0.05 for n in res["ref_norms"]), "clipping was never active"


def test_memory_per_rank_is_one_over_s(adamw):
    """Model state per rank (parameters, gradients, AdamW's two moments) against 1/s of the sharded part, as the
    engine counts the tensors it holds (``model_state_bytes``: the plain size is the module's own); memory measured
    from outside the engine, where a copy it does not know of would show, is tests/engine/test_live_cap.py's and
    tests/trainer/end_of_fit_memory.py's."""
    for k, s in enumerate((2, 4)):
        for r in adamw:
            assert "error" not in r["variants"][k], r["variants"][k]["error"]
            sb = r["variants"][k]["state_bytes"]
            ideal = (sb["plain"] - sb["replicated_plain"]) / s + sb["replicated_plain"]
            assert sb["total"] <= 1.10 * ideal, (s, sb, ideal)
            assert sb["total"] < sb["plain"] / (s * 0.8)  # really sharded, not replicated


@pytest.mark.triton
def test_engine_with_triton_kernels_matches(layouts):
    """All-gather copy-out and reduce-scatter copy-in through the Triton kernels (interpreter on CPU: the
    launcher's ranks inherit TRITON_INTERPRET=1 from tests/conftest.py), the last fit of the tied model's launch
    (its arguments: 4 steps, accumulation 2)."""
    res = layouts("tied")
    for r in res:
        assert "error" not in r["variants"][-1], r["variants"][-1].get("error")
    _assert_matches(res[0]["variants"][-1], rtol=1e-5, atol=1e-7, frozen=TIED_FIXED)


def test_one_rank_matches_single_process(tmp_path):
    """world = s = r = 1, the layout of one GPU: nobody to sum with, so the replicated parameters' "got a
    gradient" flags stay on the host ([Note: flags without a wait] in replicated.py); the tied model's frozen
    and unused parameters must still end with no gradient, over an accumulation window, clipped."""
    res = _run(tmp_path, "--model", "tied", "--s", "1", "--steps", "4", "--accum", "2", "--clip", "0.05",
               "--bucket", "500", world=1)
    _assert_matches(res[0], rtol=1e-5, atol=1e-7, frozen=TIED_FIXED)
    assert all(n > 0.05 for n in res[0]["ref_norms"]), "clipping was never active"
