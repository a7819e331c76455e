"""What runs inside an optimizer step's closure ([Note: evaluations inside a step] in lightning_mics/engine/user_code/boundary.py), and
the gradients user code reaches through ZeRO-1's plain parameters ([Note: gradients on the plain parameters] in
lightning_mics/engine/user_code/mirrored_grads.py): the Trainer against DDP on the same data and seed (``tests/scripts/step_closure.py``),
Fabric against one plain process on the union of the ranks' batches (``tests/scripts/fabric_step.py``).

On the code before, each of these failed (max abs from the control): forwards without backward then a step reusing
the gradients, 0.010 at s = 2 and with the rows over replicas (the update taken back from the units the forward
left gathered); under ZeRO-1, a clamp in ``on_before_optimizer_step``, 4.07 (lost); LBFGS, 0.16 (its re-evaluations
ran on the copies of the step's start) and 0.23 under Fabric (it stepped the module's plain copies);
``self.zero_grad()`` in manual optimization, 0.061 (and 0.055 at s = 2, the root's gradients), and
``model.zero_grad()`` under Fabric, 0.036 (the next window added to the last one's gradients); gradients read in
``on_before_optimizer_step``, none; a clip by hand over
``model.parameters()``, 0.041 (it saw no gradients)."""

import pytest
import torch

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
LAYOUTS = [("mics", 2), ("zero1", 2), ("mics_os", 4)]


def trainer_cases(kind):
    cases = ["no_backward", "clamp_before_step"]
    if kind in ("mics", "zero1", "ddp"):  # LBFGS at 4 ranks: the rows over replicas split unevenly, refused
        cases.append("lbfgs")
    if kind in ("zero1", "ddp"):  # a DTensor's ``.data = x`` leaves its local tensor as it was (torch, as FSDP2)
        cases.append("data_assign")
    return cases + ["module_zero_grad", "grads_seen"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(REPO / "tests" / "scripts" / "step_closure.py", tmp_path_factory, trainer_cases)


def close(world):
    return 1e-6 if world == 2 else 5e-6  # AdamW on 4 ranks: the reduction order shows


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_a_step_after_forwards_without_backward_equals_ddp(runs, kind, world):
    """The last epoch's forwards leave the root and the last unit gathered for a backward that never comes; the
    closing step reuses the last gradients. Its update is kept, not taken back as a write from those copies."""
    got, ref = runs.load(kind, world, "no_backward"), runs.load("ddp", world, "no_backward")
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_a_clamp_in_on_before_optimizer_step_equals_ddp(runs, kind, world):
    got, ref = runs.load(kind, world, "clamp_before_step"), runs.load("ddp", world, "clamp_before_step")
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.parametrize("kind,world", [("mics", 2), ("zero1", 2)])
def test_lbfgs_reevaluating_its_closure_equals_ddp(runs, kind, world):
    got, ref = runs.load(kind, world, "lbfgs"), runs.load("ddp", world, "lbfgs")
    assert max_diff(got["params"], ref["params"]) <= close(world)


def test_zero1_rebinding_data_between_steps_equals_ddp(runs):
    """``p.data = p.data.clamp(...)`` moved ZeRO-1's plain parameter off the unit's storage: the clamp was never
    taken and the step's refresh never reached it again (4.09 from DDP); its values are now taken back into the
    storage before the masters are read."""
    got, ref = runs.load("zero1", 2, "data_assign"), runs.load("ddp", 2, "data_assign")
    assert max_diff(got["params"], ref["params"]) <= close(2)


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_zero_grad_through_the_module_in_manual_optimization_equals_ddp(runs, kind, world):
    """``self.zero_grad()`` after each step (set to None, and in place on odd steps), the gradient norms read after
    each backward: under ZeRO-1 the module holds plain parameters, at s > 1 the root unit is gathered for the whole
    ``training_step`` (it runs inside the root's forward), and either shows the optimizer's gradients."""
    got, ref = runs.load(kind, world, "module_zero_grad"), runs.load("ddp", world, "module_zero_grad")
    assert_norms_equal(got["norms"], ref["norms"])
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_gradients_read_and_written_in_on_before_optimizer_step_equal_ddp(runs, kind, world):
    """``on_before_optimizer_step`` logs the module's gradient norms (``lightning_mics.grad_norm``; Lightning's
    ``grad_norm`` under DDP) and doubles the gradients in place: the same norms, and the doubling acts."""
    got, ref = runs.load(kind, world, "grads_seen"), runs.load("ddp", world, "grads_seen")
    assert_norms_equal(got["norms"], ref["norms"])
    assert max_diff(got["params"], ref["params"]) <= close(world)


def assert_norms_equal(got, ref):
    assert len(got) == len(ref) == 8
    for a, b in zip(got, ref):
        assert sorted(a) == sorted(b) and len(b) > 10  # every parameter's norm and the total
        assert max(abs(a[k] - b[k]) for k in b) <= 1e-5


# -- Fabric ------------------------------------------------------------------------------------------------------
FABRIC_FP32 = ["zero1_opt", "zero1_module", "zero1_module_false", "zero1_clip", "zero1_lbfgs", "mics_module",
               "mics_clip", "mics_lbfgs", "zero1_sam", "mics_sam", "zero1_decay", "mics_decay", "zero1_lookahead",
               "mics_lookahead", "zero1_lamb", "mics_lamb", "zero1_lion", "mics_lion"]
FABRIC_BF16 = [c + "_bf16" for c in FABRIC_FP32 if c != "zero1_module_false"] + ["zero1_module_false_bf16"]
FABRIC_CASES = FABRIC_FP32 + FABRIC_BF16


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fabric_step")
    res = run_ranks(REPO / "tests" / "scripts" / "fabric_step.py", 2,
                    ["--strategy", "fabric", "--cases", ",".join(FABRIC_CASES)], d)
    errors = {c: e for r in res for c, e in r["errors"].items()}

    def load(case):
        assert case not in errors, f"{case}:\n{errors[case]}"
        return torch.load(d / f"{case}.pt", weights_only=False)
    return load


def off(result):
    return max((a - b).abs().max().item() for a, b in zip(result["params"], result["reference"]))


@pytest.mark.parametrize("case", FABRIC_FP32)
def test_fabric_loops_equal_one_process(fabric_runs, case):
    assert off(fabric_runs(case)) <= 1e-6


@pytest.mark.parametrize("case", [c for c in FABRIC_BF16 if c != "zero1_clip_bf16"])
def test_fabric_loops_under_bf16_equal_one_process_under_the_precision_policy(fabric_runs, case):
    """Under ``bf16-mixed`` the optimizer's fp32 masters equal one process running MiCS's precision policy on the
    ranks' batches (``fabric_step.policy_loss``): the engine adds nothing to the rounding the policy itself does.
    Measured: 0.0, LAMB 3.0e-8, the clip by hand at s = 2 1.5e-8; against one fp32 process 1.0e-4 to 2.0e-2 (Lion's
    sign turns rounding into whole steps). What the module shows: under ZeRO-1 the bf16 copies of the masters it
    lends; at s = 2 the masters (DTensors), or their bf16 copies where a last forward left a unit gathered."""
    got = fabric_runs(case)
    assert all(m.dtype == torch.float32 for m in got["masters"])
    assert max((m - p).abs().max().item() for m, p in zip(got["masters"], got["policy"])) <= 1e-6
    shown = [m.to(torch.bfloat16).float() for m in got["masters"]]
    if case.startswith("mics") and case != "mics_decay_bf16":  # the decay's last forward leaves the root gathered
        shown = got["masters"]
    assert all(torch.equal(p, s) for p, s in zip(got["params"], shown))


def test_fabric_zero1_module_gradients_follow_the_optimizers_zero_grad(fabric_runs):
    """After ``opt.zero_grad()`` and a forward, the module shows no gradient, as under DDP (the gradients it
    showed were the optimizer's)."""
    got = fabric_runs("zero1_opt")
    assert not any(got["after_forward"])


def test_fabric_zero1_zeroing_through_the_module_under_bf16_is_zeroing_through_the_optimizer(fabric_runs):
    """Under bf16-mixed the plain parameters show bf16 copies of the optimizer's gradients: set to None or zeroed
    in place, the optimizer's are too; the run is the one zeroing through the optimizer, bit for bit."""
    ref = fabric_runs("zero1_opt_bf16")
    for case in ("zero1_module_bf16", "zero1_module_false_bf16"):
        got = fabric_runs(case)
        assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"])), case


def test_fabric_zero1_clip_by_hand_under_bf16_acts(fabric_runs):
    """The clip by hand scales the bf16 copies; the elements it wrote are taken into the optimizer's gradients: the
    run ends within bf16 of one fp32 process that clips (without the clip it ends 0.04 away), and 2.1e-4 from one
    process under the precision policy, which clips the fp32 gradients (the taken ones are rounded to bf16)."""
    got = fabric_runs("zero1_clip_bf16")
    assert off(got) <= 5e-3
    assert max((m - p).abs().max().item() for m, p in zip(got["masters"], got["policy"])) <= 1e-3
