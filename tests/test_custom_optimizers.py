"""Optimizers written by hand (``tests/scripts/custom_optimizers.py``: LAMB with its per-parameter trust ratio of
whole-parameter norms, Lion), against DDP on the same data and seed: the parameters after 2 epochs with
accumulation 2. Measured: Lion 0.0 everywhere, LAMB 1.6e-7 to 3.0e-7 (the norms' summation order)."""

import pytest

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(REPO / "tests" / "scripts" / "custom_optimizers.py", tmp_path_factory,
                    lambda kind: ["lamb", "lion"])


@pytest.mark.parametrize("case", ["lamb", "lion"])
@pytest.mark.parametrize("kind,world", [("mics", 2), ("zero1", 2), ("mics_os", 4), ("zero1", 4)])
def test_a_hand_written_optimizer_equals_ddp(runs, kind, world, case):
    got, ref = runs.load(kind, world, case), runs.load("ddp", world, case)
    assert max_diff(got["params"], ref["params"]) <= 1e-6
