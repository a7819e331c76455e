"""Optimizers that move the masters outside their own step ([Note: masters moved outside a step] in
lightning_mics/engine/user_code/write_back.py, [Note: steps the engine hears of] in lightning_mics/engine/user_code/optimizer_watch.py): the Trainer against
DDP on the same data and seed (``tests/user_code/masters_moved.py``); Fabric's SAM loop is in test_step_closure.py.

On the code before: SAM under manual optimization ended 0.19 from DDP at s = 2 and under ZeRO-1 (2 ranks), 0.15
with the rows over replicas (4 ranks): the root (ZeRO-1: every parameter) ran its second forward on copies of the
masters before the climb, and its stale copies were taken back into the masters as writes. timm's Lookahead (no
``Optimizer.__init__``, so no step hooks) failed at setup with ``AttributeError``. SAM's reference code, which puts
the weights back with ``p.data = w``, ran on from the climbed weights without a word (as under FSDP2: torch ignores
``.data =`` on a DTensor): 0.025 from DDP at s = 2 and ZeRO-1, 0.024 with the rows over replicas, once SAM itself
was right. The optimizer's parameters decayed by hand after each batch under ZeRO-1 ended 0.32 from DDP (0.021 from one
process under Fabric)."""

from copy import deepcopy

import pytest
import torch

from lightning_mics.engine.user_code.optimizer_watch import StepWatch, held_optimizers
from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO
from tests.user_code.masters_moved import SAM, Lookahead
LAYOUTS = [("mics", 2), ("zero1", 2), ("mics_os", 4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(REPO / "tests" / "user_code" / "masters_moved.py", tmp_path_factory,
                    lambda kind: ["sam_manual", "sam_closure", "lookahead", "adamw", "decay", "decay_acc2", "sam_heard",
                                  "sam_manual_bf16", "sam_heard_bf16", "sam_data"])


def close(world):
    return 1e-6 if world == 2 else 5e-6  # AdamW on 4 ranks: the reduction order shows


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_sam_under_manual_optimization_equals_ddp(runs, kind, world):
    """The climb moves the masters after a backward, the second forward runs inside the same ``training_step``
    (inside the root's forward), the masters are put back by hand and the base optimizer steps alone."""
    got, ref = runs.load(kind, world, "sam_manual"), runs.load("ddp", world, "sam_manual")
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
@pytest.mark.parametrize("precision", ["", "_bf16"])
def test_sam_moving_by_hand_is_sam_whose_moves_the_engine_hears_of_bit_for_bit(runs, kind, world, precision):
    """The same SAM with its climb and its putting back run inside the step of an optimizer it holds (the engine
    hears of them as of a step): the same bits, under bf16-mixed too (bf16 copies of the root, fp32 masters), where
    DDP's autocast is no bitwise control. The by-hand run all-gathers once less per step (no refresh after the
    putting back, which the base step's refresh covers)."""
    got, heard = runs.load(kind, world, "sam_manual" + precision), runs.load(kind, world, "sam_heard" + precision)
    assert all(torch.equal(got["params"][n], heard["params"][n]) for n in heard["params"])
    assert all(t.dtype == torch.float32 for t in got["params"].values())  # the fp32 masters, after fit
    assert got["all_gathers"] < heard["all_gathers"]
    if not precision:
        assert max_diff(heard["params"], runs.load("ddp", world, "sam_heard")["params"]) <= close(world)


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_sam_evaluating_lightnings_closure_twice_equals_ddp(runs, kind, world):
    got, ref = runs.load(kind, world, "sam_closure"), runs.load("ddp", world, "sam_closure")
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_timms_lookahead_equals_ddp_with_the_gathers_of_its_base_optimizer(runs, kind, world):
    """Its step has no torch hooks; its base step runs inside it and the slow weights are copied in after that: the
    engine hears of the outer step only, so the batches all-gather exactly as under AdamW alone (ZeRO-1: one refresh
    per step)."""
    got, ref = runs.load(kind, world, "lookahead"), runs.load("ddp", world, "lookahead")
    assert max_diff(got["params"], ref["params"]) <= close(world)
    assert got["all_gathers"] == runs.load(kind, world, "adamw")["all_gathers"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_the_optimizers_parameters_decayed_by_hand_after_each_batch_equal_ddp(runs, kind, world):
    """No backward between that move and the next forward: ZeRO-1's pinned copies are gathered again because the
    optimizer's DTensors were written in place since they were filled (before, the forward ran on the stale copies
    and the next step's take put them back: 0.32 from DDP). One all-gather more per decayed batch followed by a
    forward under ZeRO-1; none in the other layouts, whose module holds the DTensors between steps."""
    got, ref = runs.load(kind, world, "decay"), runs.load("ddp", world, "decay")
    assert max_diff(got["params"], ref["params"]) <= close(world)
    extra = got["all_gathers"] - runs.load(kind, world, "adamw")["all_gathers"]
    assert extra == (7 if kind == "zero1" else 0)  # 8 batches, the last decay followed by no forward


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_a_decay_by_hand_between_the_micro_batches_of_a_window_equals_ddp(runs, kind, world):
    """Accumulation 2: between a window's micro-batches the root stays gathered for the next forward (lent to user
    code) while the decay moves its masters through the optimizer's DTensors. The version counters show it: those
    parameters keep the moved masters (no copy of the masters is needed for that) and the root is gathered again."""
    got, ref = runs.load(kind, world, "decay_acc2"), runs.load("ddp", world, "decay_acc2")
    assert max_diff(got["params"], ref["params"]) <= close(world)


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_the_root_copies_its_masters_only_where_a_window_ends_with_it_lent(runs, kind, world):
    """[Note: the user-code boundary]: a plain fit (AdamW, and the decays by hand, accumulation 1 and 2) never has the
    root keep a copy of its masters at s > 1, where before every gather of the root cloned its shard; SAM under
    manual optimization does (its backward ends a window inside the root's forward); ZeRO-1's pinned unit copies at
    every fill."""
    looks = {case: runs.load(kind, world, case) for case in ("adamw", "decay", "decay_acc2", "sam_manual")}
    assert all(got["looks"] > 0 for got in looks.values())
    if kind == "zero1":
        assert all(got["snapshots"] == got["looks"] for got in looks.values())
    else:
        assert all(looks[case]["snapshots"] == 0 for case in ("adamw", "decay", "decay_acc2"))
        assert looks["sam_manual"]["snapshots"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_rebinding_data_on_a_dtensor_parameter_is_refused_by_name(runs, kind, world):
    """``p.data = w`` on the optimizer's DTensor leaves the masters as they were: the next step refuses the run,
    naming the parameter and the in-place write to use, where DDP (plain parameters) runs it."""
    err = runs.load(kind, world, "sam_data")["error"]
    assert "`p.data = x` on the parameter 'net." in err and "p.copy_(x)" in err
    assert "params" in runs.load("ddp", world, "sam_data")


def test_the_outermost_step_is_heard_once_and_a_step_that_raised_does_not_silence_the_next():
    """[Note: steps the engine hears of]: SAM's base step alone, Lookahead's step (its base step inside), an LR
    scheduler built after the hooks (it wraps ``step`` again through ``__func__``), and a step that raises."""
    events = []
    watch = StepWatch(lambda: events.append("begin"), lambda: events.append("end"))
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    sam = SAM([w], torch.optim.SGD, lr=0.1)
    look = Lookahead(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    hooks = [watch.watch(opt) for opt in held_optimizers(sam) + held_optimizers(look)]
    sam.base_optimizer.step()
    look.step()
    sched = torch.optim.lr_scheduler.StepLR(look._base_optimizer, step_size=1)
    look._base_optimizer.step()
    sched.step()
    assert events == ["begin", "end"] * 3 and look._base_optimizer._opt_called
    events.clear()
    boom = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    boom.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # noqa: E731
    hooks.append(watch.watch(boom))
    with pytest.raises(RuntimeError, match="boom"):
        boom.step()
    sam.base_optimizer.step()
    assert events == ["begin", "begin", "end"]  # the failed step is not heard to end; the next one is heard whole
    copy = deepcopy(sam.base_optimizer)  # steps its own parameters, unwatched
    copy.param_groups[0]["params"][0].grad = torch.ones(3)
    copy.step()
    assert events == ["begin", "begin", "end"] and not torch.equal(copy.param_groups[0]["params"][0], w)
    for h in hooks:
        h.remove()
    sam.base_optimizer.step()
    assert events == ["begin", "begin", "end"] and "step" not in vars(sam.base_optimizer)
