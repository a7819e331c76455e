"""MiCS under Lightning Fabric: real processes (gloo, CPU), a real ``L.Fabric`` in the usual Fabric
loop, each case against one plain process on the same global batches (``tests/fabric/fabric_loop.py``).

4 ranks: s = 2 and s = 4, accumulation 2 and 4, clipping by norm and by value, SGD and AdamW, the three ways
to set up (``fabric.setup(model, opt)``, setup_module + setup_optimizers, ``init_module(empty_init=True)``),
``bf16-mixed``, a two-model two-optimizer loop, resuming from ``fabric.save`` halfway (sharded and full) and
the collectives per step with and without ``no_backward_sync``. 2 ranks: resuming the 4-rank checkpoints in
another layout, ``load_raw``, and the wrong setup order refused.
"""

import lightning as L
import pytest
import torch

from lightning_mics.fabric import MiCSStrategy
from tests.helpers.launch import REPO, run_ranks

SCRIPT = REPO / "tests" / "fabric" / "fabric_loop.py"
pytestmark = pytest.mark.distributed

EQUIV = ["equiv:2:2:sgd:norm:split", "equiv:4:4:adamw:value:joint", "equiv:2:4:adamw:norm:meta",
         "equiv:4:2:sgd:none:joint", "equiv:2:2:adamw:norm:split:bf16-mixed", "equiv:2:2:sgd:value:split:bf16-true",
         "equiv:2:2:adamw:norm:split:32-true:os",  # the optimizer's rows over the 2 replicas
         "equiv:2:2:sgd:torchnorm:split", "equiv:4:2:adamw:torchvalue:joint",  # torch's clip_grad_*_ on DTensors
         "equiv:4:2:sgd:value:joint:bf16-mixed", "equiv:2:4:adamw:norm:meta:bf16-mixed",
         "equiv:2:2:adamw:torchnorm:split:bf16-mixed:os"]
FOUR = [*EQUIV, "count:2:4", "gan:2", "resume:2", "feedback:2", "feedback:2:bf16-mixed", "feedback_load:2:64",
        "feedback_rows:2", "torchsd:2", "torchsd:2:bf16-mixed", "filter:2:sharded", "filter:2:full",
        "filter:2:sharded:bf16-mixed", "filter:2:full:bf16-mixed"]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric4")
    return out, run_ranks(SCRIPT, 4, ["--world", "4", "--cases", *FOUR], out)


@pytest.mark.parametrize("case", EQUIV)
def test_fabric_loop_equals_one_plain_process(four, case):
    _, results = four
    r0 = results[0][case]
    bf16 = "bf16" in case
    if "bf16-mixed" in case:  # one process under MiCS's precision policy (fabric_loop.policy_loss): 0.0 to 2.4e-7
        assert r0["policy_max_abs"] <= 1e-6, r0
    assert r0["moved_global"] > 5e-3, r0  # the reference trained: its distance from the initial state
    if ":meta" in case:  # the reference starts from MiCS's initial state: that state is the seeded model's
        assert r0["init_vs_seeded"] == 0.0, r0
    if bf16:  # against the fp32 reference under autocast: rounding to bf16 in another summation order, a fifth of
        # what training moved at most (1.8e-4 to 6.8e-3 measured against 8.8e-3 to 4.9e-2: a run that never
        # stepped would be the whole distance away)
        assert r0["rel_global"] <= min(2e-2, r0["moved_global"] / 5), r0
    elif ":adamw:" in case:
        assert r0["rel_global"] <= 1e-4, r0  # AdamW: globally
    else:
        assert r0["rel"] <= 1e-5, r0  # SGD: every tensor
    # the module called outside the loop computes with full parameters (bf16: gathered in bf16, so the embedding's
    # output and the residual stream are bf16 where the fp32 reference's autocast keeps them fp32)
    assert r0["outside_loop_rel"] <= (1e-1 if bf16 else 1e-5), r0
    # the head called directly outside Fabric's precision context ([Note: calls outside the precision's context]):
    # under bf16-mixed it runs under autocast, as the training forward (bf16 out), within bf16's rounding of fp32's
    # (the largest element's error against the largest element: 1.4e-2 to 2.0e-2 measured)
    head = r0["head_outside"]
    assert head["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), r0
    assert head["rel"] <= (5e-2 if bf16 else 1e-6), r0
    # the state comes from the masters: fp32, bf16-mixed included; bf16-true trains bf16 parameters
    assert r0["dtypes"] == ["torch.bfloat16" if case.endswith("bf16-true") else "torch.float32"], r0
    s = int(case.split(":")[1])
    rows = r0["whole_bytes"] / 4 if case.endswith(":os") else 0  # a copy of this replica's rows: 1 / (s r) of 4 ranks
    for r in results:  # each rank holds about 1/s of the parameters (small ones replicated)
        assert r[case]["held_params"] <= 1.05 * r0["whole_bytes"] / s + rows + 4 * 61 * 4 + 4 * 24 * 8, (r[case], r0)
    if case.endswith(":meta"):
        assert all(r[case]["on_meta"] for r in results)  # init_module(empty_init=True): never a full model


def test_replica_all_reduce_once_per_step_under_no_backward_sync(four):
    _, results = four
    for r in results:
        c = r["count:2:4"]
        deferred, every = c["nbs=True"], c["nbs=False"]
        assert deferred["replica_all_reduce"] > 0
        assert every["replica_all_reduce"] == 4 * deferred["replica_all_reduce"], c  # accumulation 4
        assert every["world_all_reduce"] == 4 * deferred["world_all_reduce"], c
        assert every["shard_reduce_scatter"] == deferred["shard_reduce_scatter"] > 0, c  # every micro-batch


def test_two_models_two_optimizers(four):
    _, results = four
    assert results[0]["gan:2"]["gen_rel"] <= 1e-4
    assert results[0]["gan:2"]["critic_rel"] <= 1e-5


def test_resume_from_fabric_save_halfway_equals_uninterrupted(four):
    _, results = four
    for fmt in ("sharded", "full"):
        r = results[0]["resume:2"][fmt]
        assert r["rel"] <= 1e-6 and r["step"] == 2, (fmt, r)
        assert r["dtypes"] == ["torch.float32"] and r["n_model"] > 0, (fmt, r)  # consolidate works on both
        assert r["optimizer_keys"] == ["param_groups", "state"], (fmt, r)


def test_error_feedback_residuals_resume_from_a_sharded_checkpoint(four):
    """quantize_gradients='error_feedback' (s = 2, r = 2, 32-element blocks): the sharded checkpoint holds every
    rank's residuals and the resumed run is the uninterrupted one exactly. A full checkpoint holds none: the load
    says so and the run differs (what the residuals carry is not nothing). Loaded with another block size, the
    residuals do not fit and restart from zero, with a warning naming the change. The same under bf16-mixed,
    where both checkpoints hold the fp32 masters."""
    _, results = four
    for case in ("feedback:2", "feedback:2:bf16-mixed"):
        r = results[0][case]
        assert r["sharded"]["rel"] == 0.0 and r["sharded"]["warned"] == [], (case, r)
        assert r["sharded"]["ranks"] == ["rank0", "rank1", "rank2", "rank3"], (case, r)
        assert r["full"]["rel"] > 1e-4, (case, r)
        assert len(r["full"]["warned"]) == 1 and "a full checkpoint holds only" in r["full"]["warned"][0], (case, r)
        assert r["sharded"]["dtypes"] == r["full"]["dtypes"] == ["torch.float32"], (case, r)
    for res in results:  # residuals whose size does not match their bucket: refused, none of them taken
        foreign = res["feedback:2"]["foreign"]
        assert foreign["error"] and "the checkpoint is of another model" in foreign["error"], foreign
        assert foreign["kept"] and foreign["entries"] >= 1, foreign
    warned = results[0]["feedback_load:2:64"]["warned"]
    assert len(warned) == 1 and "another layout (block_size 32 -> 64)" in warned[0], warned
    assert all(res["feedback_load:2:64"]["warned"] == [] for res in results[1:])  # said once, by rank 0


def test_error_feedback_rows_over_replicas_load_into_a_live_model(four):
    """shard_optimizer_state=True with error feedback (s = 2, r = 2, AdamW): a sharded checkpoint loaded into the
    model and optimizer that saved it, mid-training, and into a fresh one: both continue exactly as the
    uninterrupted run (the residuals come back; the load's rows are what every replica holds, not a change to
    send); the replicas of a shard rank end with the same bits."""
    _, results = four
    for res in results:
        r = res["feedback_rows:2"]
        assert r["same"], r
    r0 = results[0]["feedback_rows:2"]
    assert r0["live"] == 0.0 and r0["fresh"] == 0.0, r0


def test_two_ranks_resume_four_rank_checkpoints_load_raw_setup_order_nonfinite(four, tmp_path):
    src, _ = four
    results = run_ranks(SCRIPT, 2, ["--world", "2", "--cases", f"load:2:{src}", "equiv:2:2:sgd:norm:split", "order",
                                    "nonfinite", "nonfinite:loss"], tmp_path)
    load = results[0][f"load:2:{src}"]
    for fmt in ("sharded", "full"):
        assert load[fmt]["rel"] <= 1e-5 and load[fmt]["step"] == 2, (fmt, load)
    assert load["load_raw_rel"] == 0.0
    assert results[0]["equiv:2:2:sgd:norm:split"]["rel"] <= 1e-5
    for r in results:
        assert "fabric.setup_module(model)" in r["order"]["error"], r["order"]
        assert "SGD(fused=True)" in r["order"]["fused_error"] and "aten._fused_sgd_" in r["order"]["fused_error"] \
            and "Allowed: SGD(foreach=True)" in r["order"]["fused_error"], r["order"]
        assert "Rprop" in (r["order"]["rprop_error"] or "") and "param_persistence_threshold" in r["order"]["rprop_error"]
        # stop_on_nonfinite acts under Fabric: a NaN on rank 1 stops every rank before the step, named as what it was
        assert "non-finite loss on rank(s) [1] and gradient norm" in (r["nonfinite"]["error"] or ""), r["nonfinite"]
        # a non-finite loss whose gradients are finite, in an accumulated micro-batch (before: the step was taken)
        assert "non-finite loss on rank(s) [1] at" in (r["nonfinite:loss"]["error"] or ""), r["nonfinite:loss"]
    assert results[0]["nonfinite"]["unchanged"] and results[0]["nonfinite:loss"]["unchanged"]  # before the step


def test_registered():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="mics")
    assert isinstance(fabric.strategy, MiCSStrategy)
    # its refusals before any process: tests/options/test_refusals.py


@pytest.mark.parametrize("case", ["quant:2:2:32", "quant:2:2:32:os"])
def test_quantize_gradients_under_no_backward_sync_within_the_derived_bound(tmp_path, case):
    """quantize_gradients=True through lightning_mics.fabric.MiCSStrategy (4 ranks, s = 2, r = 2, accumulation 2
    under no_backward_sync, 32-element blocks): quant_equiv.py's linear least-squares model, so that the bound of
    [Note: the equivalence bound] applies: the quantized run's parameters within it (plus twice the unquantized
    run's own fp32 rounding) of the float64 single-process reference, the unquantized run within 1e-5 of it. The
    replica group sees the int8 wire (an all-to-all and an all-gather of bytes) once per optimizer step where the
    unquantized run has its fp32 all-reduce, and never an all-reduce. ``:os``: error feedback with the optimizer's
    rows over the replicas, the reduce-scatter and the rows' change in int8 ([Note: quantized optimizer rows]):
    the optimizers' pre-step hook under Fabric, with two optimizers (weight, bias) stepped one after the other."""
    res = run_ranks(SCRIPT, 4, ["--world", "4", "--cases", case], tmp_path)
    r0 = res[0][case]
    ref = torch.tensor(r0["ref"], dtype=torch.float64)
    plain, quant = (torch.tensor(run["params"], dtype=torch.float64) for run in r0["runs"])
    fp32_noise, bound = (plain - ref).norm().item(), r0["bounds"][1]
    assert fp32_noise <= 1e-5 * ref.norm().item(), fp32_noise
    dist = (quant - ref).norm().item()
    assert dist <= bound + 2 * fp32_noise, (dist, bound, fp32_noise)
    assert dist > 10 * fp32_noise and bound < 0.1 * quant.norm().item(), (dist, bound)  # it acted; bound says something
    assert all(run["dtypes"] == ["torch.float32"] for run in r0["runs"])  # the state comes from the fp32 masters
    for r in res:
        fp32, int8 = r[case]["runs"]
        assert fp32["replica"] == [["all_reduce", "torch.float32"]], fp32
        if case.endswith(":os"):  # [Note: rows between steps] in optimizer_rows.py. One unit: per step its reduce-
            # scatter's all-to-all and, once both optimizers have stepped, one all-gather of its rows when the next
            # forward starts (5 in the loop, the last step's at the state dict after it); the all-reduce of a flag
            # on the forwards no step precedes (the first, and the second micro-batch of each of the 6 windows)
            assert int8["replica"] == [["all_gather", "torch.uint8"], ["all_reduce", "torch.float32"],
                                       ["all_to_all", "torch.uint8"]], int8
            assert int8["replica_ops"] == 6 + 5 + 7, int8
        else:
            assert int8["replica"] == [["all_gather", "torch.uint8"], ["all_to_all", "torch.uint8"]], int8
            assert int8["replica_ops"] == 2 * fp32["replica_ops"], (fp32, int8)  # the same sync points, deferred


@pytest.mark.parametrize("case", ["torchsd:2", "torchsd:2:bf16-mixed"])
def test_torch_distributed_state_dict_api(four, case):
    """torch.distributed.checkpoint.state_dict (get/set model and optimizer state dicts) with dcp.save / dcp.load,
    as torchtitan checkpoints FSDP2, on the strategy's model and optimizer (4 ranks, s = 2; fp32 and bf16-mixed):
    the full state dict equals the strategy's own, and a save loaded back after more steps resumes exactly
    (optimizer state included: the steps after it repeat bit for bit)."""
    _, results = four
    r = results[0][case]
    assert r["full_keys"] and r["full_max"] == 0.0, r
    assert r["moved"] > 1e-3 and r["resumed_max"] == 0.0, r
    # and a full state dict on rank 0 alone, broadcast into the shards (set_model_state_dict with
    # full_state_dict=True, broadcast_from_rank0=True: how torchtitan loads pretrained weights)
    assert r["broadcast_max"] == 0.0, r


@pytest.mark.parametrize("precision", ["", ":bf16-mixed"])
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_save_with_filter_as_litgpt_saves_lora_weights(four, fmt, precision):
    """``fabric.save(path, state, filter={"model": fn, "info": fn})`` keeps only the entries the filters accept,
    in both formats, and under bf16-mixed the fp32 masters; ``fabric.load(..., strict=False)`` into a fresh model
    restores exactly those and leaves the rest as they were; ``strict=True`` names the missing ones; a filter on
    an optimizer is refused on every rank before any collective."""
    _, results = four
    case = f"filter:2:{fmt}{precision}"
    r0 = results[0][case]
    assert r0["saved"] == r0["kept"] == ["blocks.0.down.bias", "blocks.0.down.weight", "blocks.0.up.bias",
                                         "blocks.0.up.weight"], r0
    assert r0["saved_dtypes"] == ["torch.float32"] and r0["saved_equal"] == 0.0, r0
    assert r0["differs"] > 1e-3 and r0["from_ckpt"] == 0.0 and r0["untouched"] == 0.0, r0
    for r in results:
        r = r[case]
        assert r["info"] == {"a": 1}, r
        assert ("missing ['emb.weight'" if fmt == "sharded" else 'Missing key(s) in state_dict: "emb.weight"') \
            in r["strict_error"], r  # full: torch's own error (the load runs through load_state_dict)
        assert "fabric.save(filter={'optimizer'" in r["bad_error"] and "allowed are keys" in r["bad_error"], r
