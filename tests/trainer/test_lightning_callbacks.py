"""Lightning's callbacks that steer a fit (``tests/trainer/callbacks.py``), against DDP on the same data and seed:
the parameters after each flow, and what the flow decides (the epoch early stopping ends at, the checkpoints kept).
AdamW at 4 ranks ends 1.6e-6 from DDP in every case (its update divides by the gradient's root mean square, which
makes the summation order of the reduce-scatter and all-reduce visible); at 2 ranks the same bits or 1.2e-7."""

import pytest

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO

pytestmark = pytest.mark.distributed
CASES = ["accum_schedule", "early_stop", "last", "on_exception"]
LAYOUTS = [("mics", 2), ("zero1", 2), ("mics_os", 4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(REPO / "tests" / "trainer" / "callbacks.py", tmp_path_factory, lambda kind: CASES)


def close(world):
    return 1e-6 if world == 2 else 5e-6


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_accumulation_scheduled_by_epoch_equals_ddp(runs, kind, world):
    got, ref = runs.load(kind, world, "accum_schedule"), runs.load("ddp", world, "accum_schedule")
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_early_stopping_stops_where_ddp_does(runs, kind, world):
    got, ref = runs.load(kind, world, "early_stop"), runs.load("ddp", world, "early_stop")
    assert got["epoch"] == ref["epoch"] < 8
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_top_k_and_last_checkpoints_resume_as_ddp(runs, kind, world):
    got, ref = runs.load(kind, world, "last"), runs.load("ddp", world, "last")
    assert got["files"] == ref["files"] == ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt", "last.ckpt"]
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_checkpoint_on_exception_resumes_as_ddp(runs, kind, world):
    got, ref = runs.load(kind, world, "on_exception"), runs.load("ddp", world, "on_exception")
    assert got["raised"] == ref["raised"] == "raised at step 5"
    assert got["files"] == ref["files"] == ["on_exception.ckpt"]
    assert max_diff(got["params"], ref["params"]) <= close(world)
