"""Optimizers written by hand (``tests/user_code/custom_optimizers.py``: LAMB with its per-parameter trust ratio of
whole-parameter norms, Lion), against DDP on the same data and seed: the parameters after 2 epochs with
accumulation 2. Measured: Lion 0.0 everywhere, LAMB 1.6e-7 to 3.0e-7 (the norms' summation order).

Under ``bf16-mixed`` DDP runs MiCS's precision policy (``compat.Bf16Copies``: bf16 copies of the fp32 masters in the
forward, fp32 gradients reduced): the optimizers step the fp32 masters with what DDP's step with. Measured: Lion 0.0,
LAMB 1.2e-7 to 2.4e-7; against DDP under autocast alone, 2.0e-3 and 2.3e-3 (the forward's rounding)."""

import torch

import pytest

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(REPO / "tests" / "user_code" / "custom_optimizers.py", tmp_path_factory, lambda kind: CASES)


CASES = ["lamb", "lion", "lamb_bf16", "lion_bf16"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind,world", [("mics", 2), ("zero1", 2), ("mics_os", 4), ("zero1", 4)])
def test_a_hand_written_optimizer_equals_ddp(runs, kind, world, case):
    got, ref = runs.load(kind, world, case), runs.load("ddp", world, case)
    assert max_diff(got["params"], ref["params"]) <= 1e-6
    if case.endswith("_bf16"):  # the masters the optimizer stepped, not bf16 copies of them
        assert all(p.dtype == torch.float32 for p in got["params"].values())
        values = torch.cat([p.reshape(-1) for p in got["params"].values()])
        assert (values.view(torch.int32) & 0xFFFF != 0).float().mean() > 0.99
