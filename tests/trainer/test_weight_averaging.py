"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``, ``WeightAveraging``'s equal average) over the
shards ([Note: weight averaging over the shards] in ``lightning_mics/frontends/weight_averaging.py``;
``tests/trainer/averaging.py``), against DDP on the same data and seed: the validation losses (taken on the average,
which the callback swaps in and out), the parameters after fit (the average, copied in), the checkpoint's average
and module state, and a fit resumed from a checkpoint of the first epoch against the uninterrupted one.

Before, the callbacks were refused at setup: the callback averaged the DTensor shards into a plain copy of the
module made before sharding and failed at its first update with DTensor's mixed-tensor error."""

import pytest

from tests.helpers.cases import CaseRuns, launch_together, max_diff
from tests.helpers.launch import REPO

pytestmark = pytest.mark.distributed
# s = 2 with 1 and 2 replicas, the optimizer's rows over replicas, the full checkpoint format, ZeRO-1
LAYOUTS = [("mics", 2), ("zero1", 2), ("mics_os", 4), ("mics_full", 4)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """averaging.py's and swa.py's runs, every strategy of one world in one launch (``launch_together``), DDP's
    first: 2 launches instead of 12, each (script, strategy) with the cases it ran in a launch of its own (12
    launches were 128 CPU-seconds for the file, 2 are 118: the fits, not the starts, are its cost)."""
    avg = CaseRuns(REPO / "tests" / "trainer" / "averaging.py", tmp_path_factory,
                   lambda kind: ["ema", "swa", "ema_accum"]
                   + (["ema_bf16"] if kind in ("mics", "mics_os", "ddp") else []))
    swa = CaseRuns(REPO / "tests" / "trainer" / "swa.py", tmp_path_factory, lambda kind: ["swa", "swa_bn"]
                   + (["swa_bf16"] if kind in ("mics", "mics_os") else []))
    for world in (2, 4):
        kinds = ["ddp", *(kind for kind, w in LAYOUTS if w == world)]
        launch_together(world, [(cr, kind) for kind in kinds for cr in (avg, swa)], tmp_path_factory)
    return avg, swa


@pytest.fixture(scope="module")
def runs(launched):
    return launched[0]


@pytest.mark.parametrize("case", ["ema", "swa", "ema_accum"])
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_weight_averaging_equals_ddp_and_resumes_exactly(runs, kind, world, case):
    got, ref = runs.load(kind, world, case), runs.load("ddp", world, case)
    tol = 1e-6 if world == 2 else 5e-6  # AdamW on 4 ranks: the reduction order shows (2.4e-7 measured)
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= tol * 10
    assert max_diff(got["params"], ref["params"]) <= tol
    assert max_diff(got["saved"], ref["saved"]) <= tol  # the average at the save
    assert max_diff(got["current"], ref["current"]) <= tol  # the module's own weights beside it
    assert max_diff(ref["saved"], ref["current"]) > 1e-2  # the two differ: the test tells them apart
    assert max_diff(got["resumed"], got["params"]) == 0.0  # the resumed fit is the uninterrupted one
    assert got["resumed_losses"] == got["losses"][1:]
    assert abs(got["validated_after"] - ref["validated_after"]) <= tol * 10  # trainer.validate after fit


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_the_average_is_held_in_shards(runs, kind, world):
    """Each rank averages its own rows: at s = 2 half the elements (and the rows over 2 replicas a quarter); ZeRO-1's
    module holds whole plain copies between steps, and so does its average."""
    assert_held_in_shards(runs.load(kind, world, "ema"), kind)


def assert_held_in_shards(got, kind):
    if kind == "zero1":
        assert got["average_types"] == ["Tensor"] and got["average_held"] == got["numel"]
    else:
        share = 4 if kind == "mics_os" else 2
        assert got["average_types"] == ["DTensor"] and got["average_held"] <= got["numel"] / share + 64, got


@pytest.mark.parametrize("kind,world", [("mics", 2), ("mics_os", 4)])
def test_weight_averaging_under_bf16_mixed_keeps_fp32_and_resumes_exactly(runs, kind, world):
    """Under bf16-mixed the parameters between steps are the fp32 masters' shards, and so is the average: the
    checkpoint holds fp32, and the resumed fit is the uninterrupted one bit for bit; the average, the checkpoint
    and the resumed fit are DDP's under MiCS's precision policy (tests/helpers/bf16_policy.py), bit for bit."""
    got, ref = runs.load(kind, world, "ema_bf16"), runs.load("ddp", world, "ema_bf16")
    assert {str(t.dtype) for t in got["saved"].values()} == {"torch.float32"}
    assert max_diff(got["resumed"], got["params"]) == 0.0
    for key in ("params", "saved", "resumed"):
        assert max_diff(got[key], ref[key]) <= 1e-6, key


# -- Lightning's StochasticWeightAveraging (tests/trainer/swa.py) ---------------------------------------------------
@pytest.fixture(scope="module")
def swa_runs(launched):
    return launched[1]


@pytest.mark.parametrize("case", ["swa", "swa_bn"])
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_stochastic_weight_averaging_equals_ddp_and_resumes_exactly(swa_runs, kind, world, case):
    """Lightning's older SWA callback (refused before): its SWALR schedule, the average copied in at the end, and
    with batch norm its extra epoch of forwards without backward. The parameters and rank 0's running statistics
    equal DDP's; the fit resumed from a checkpoint of epoch 2 (the average in the callback's state) is the
    uninterrupted one. With batch norm each rank keeps its own running statistics (as under FSDP; DDP broadcasts
    rank 0's), so the validation losses are compared without it. ZeRO-1's batch-norm case ended 0.011 from DDP
    before its plain parameters showed the optimizer's gradients ([Note: gradients on the plain parameters])."""
    got, ref = swa_runs.load(kind, world, case), swa_runs.load("ddp", world, case)
    tol = 1e-6 if world == 2 else 5e-6
    assert max_diff(got["params"], ref["params"]) <= tol
    assert max_diff(got["resumed"], got["params"]) == 0.0
    if case == "swa":
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= tol * 10
        assert got["resumed_losses"] == got["losses"][2:]
    else:
        assert max_diff(got["buffers"], ref["buffers"]) <= tol
        assert len(got["losses"]) == 6  # the batch-norm epoch ran


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_the_stochastic_average_is_held_in_shards(swa_runs, kind, world):
    assert_held_in_shards(swa_runs.load(kind, world, "swa"), kind)


@pytest.mark.parametrize("kind,world", [("mics", 2), ("mics_os", 4)])
def test_stochastic_weight_averaging_under_bf16_mixed_keeps_fp32_and_resumes_exactly(swa_runs, kind, world):
    """Under bf16-mixed the average is of the fp32 masters' shards, the parameters after fit are fp32, and the fit
    resumed mid-average is the uninterrupted one bit for bit."""
    got = swa_runs.load(kind, world, "swa_bf16")
    assert got["average_dtypes"] == ["torch.float32"]
    assert {str(t.dtype) for t in got["params"].values()} == {"torch.float32"}
    assert max_diff(got["resumed"], got["params"]) == 0.0
    assert got["resumed_losses"] == got["losses"][2:]
