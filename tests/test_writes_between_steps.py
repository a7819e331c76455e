"""Parameters written outside the optimizer step under the optimizer-state-only layout (s = 1,
``shard_optimizer_state=True``), against DDP on the same data and seed ([Note: writes between steps] in
``lightning_mics/unit.py``).

Between steps that layout's module computes with whole plain copies of the parameters, and the step's all-gather
refreshes them from the optimizer's master rows. Before the masters took the writes back, a write was lost: a clamp
after every step ended 4.05 from DDP on 4 ranks, as if it never ran. (With the optimizer's rows over replicas,
s > 1, such a write still reaches only this replica's rows: the README says so.)
"""

import pytest

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "scripts" / "writes.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(SCRIPT, tmp_path_factory, lambda kind: ["clamp", "swap"] + (["bits"] if kind == "zero1" else []))



@pytest.mark.parametrize("world", [2, 4])
def test_a_clamp_after_every_step_equals_ddp(runs, world):
    """WGAN's weight clipping after every step, with accumulation 2 (also between a window's micro-batches)."""
    got, ref = runs.load("zero1", world, "clamp"), runs.load("ddp", world, "clamp")
    assert max(p.abs().max().item() for p in ref["params"].values()) <= 0.05 + 1e-7  # clamped (in float32)
    assert max_diff(got["params"], ref["params"]) <= 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_averaged_weights_swapped_in_for_validation_equal_ddp(runs, world):
    """A running average swapped in at the validation's start and out at its end: the validation loss is the
    average's, and training goes on from the weights swapped back."""
    got, ref = runs.load("zero1", world, "swap"), runs.load("ddp", world, "swap")
    assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-6 * abs(ref["val_loss"])
    assert max_diff(got["params"], ref["params"]) <= 1e-6


@pytest.mark.parametrize("world", [2])
def test_taking_unwritten_bf16_copies_back_leaves_every_master_bit(runs, world):
    """Under bf16-mixed the plain copies are the masters rounded: with nothing written, no master bit changes."""
    got = runs.load("zero1", world, "bits")
    assert got["changed"] == 0
