"""quantize_gradients / quantize_allgather in training: real Trainer + MiCSStrategy on gloo ranks.

Equivalence: parameters after N steps of each quantized run within the bound derived in
tests/engine/quant_equiv.py ([Note: the equivalence bound]) of a float64 single-process reference on the same
global batches, 2 and 4 ranks, s = 2 (s = 4 over 2 simulated nodes for the gather), accumulation 1 and 4.
Dispatch: bytes across replica groups per optimizer step, and across nodes in the gather's first hop, at most
0.3x of the fp32 runs (scales included), counted by the TorchDispatchMode in tests/helpers/comm_mode.py.
"""

import json

import lightning as L
import pytest
import torch

from lightning_mics import MiCSStrategy
from tests.helpers.launch import REPO, run_ranks

EQUIV = REPO / "tests" / "engine" / "quant_equiv.py"
GPT = REPO / "tests" / "engine" / "equiv.py"
pytestmark = pytest.mark.distributed

B = 32  # elements per scale: small, so that the linear model's 264 parameters span many blocks
QG = {"quantize_gradients": True, "quantization_block_size": B}
EF = {"quantize_gradients": "error_feedback", "quantization_block_size": B}
QA = {"quantize_allgather": True, "quantization_block_size": B}


def _check_bounds(res, variants):
    r0 = res[0]
    for k, (v, run) in enumerate(zip(variants, r0["runs"])):
        ref = torch.tensor(r0["ref"][str(v["accum"])], dtype=torch.float64)
        base = next(i for i, b in enumerate(variants) if b["accum"] == v["accum"] and len(b) == 1)
        fp32_noise = (torch.tensor(r0["runs"][base]["params"], dtype=torch.float64) - ref).norm().item()
        dist = (torch.tensor(run["params"], dtype=torch.float64) - ref).norm().item()
        bound = r0["bounds"][k]
        # the derived bound, plus twice the fp32 rounding the unquantized run shows against float64 (an unquantized
        # variant's bound is 0: it rounds as the plain run does)
        assert dist <= bound + 2 * fp32_noise, (v, dist, bound, fp32_noise)
        if v.get("quantize_gradients") or v.get("quantize_allgather"):
            assert dist > 10 * fp32_noise, (v, dist)  # the quantization did act
            assert bound < 0.1 * torch.tensor(run["params"]).norm().item()  # and the bound says something


def test_four_ranks_s2_each_option_within_the_derived_bound(tmp_path):
    variants = []
    for accum in (1, 4):
        variants += [{"accum": accum}, {"accum": accum, **QG}, {"accum": accum, **EF},
                     {"accum": accum, "s": 4, "ranks_per_node": 2, **QA}]
    res = run_ranks(EQUIV, 4, ["--s", "2", "--steps", "6", "--variants", json.dumps(variants)], tmp_path)
    _check_bounds(res, variants)
    for r in res:  # the replica all-reduce goes as int8 (an all-to-all and an all-gather), never as an all-reduce
        replica = (r["rank"] % 2, r["rank"] % 2 + 2)
        for v, run in zip(variants, r["runs"]):
            ops = {op for batch in run["comms"] for op, g, _ in batch if g and tuple(g) == replica}
            assert ("all_to_all" in ops) == bool(v.get("quantize_gradients")), (v, ops)
            assert ("all_reduce" in ops) == (not v.get("quantize_gradients") and v.get("s", 2) == 2), (v, ops)


def test_two_ranks_s2_quantized_gather_within_the_derived_bound(tmp_path):
    """Two simulated nodes of one rank: the whole gather is the cross-node hop."""
    variants = [{"accum": 1, "ranks_per_node": 1}, {"accum": 1, "ranks_per_node": 1, **QA},
                {"accum": 4, "ranks_per_node": 1}, {"accum": 4, "ranks_per_node": 1, **QA}]
    res = run_ranks(EQUIV, 2, ["--s", "2", "--steps", "6", "--variants", json.dumps(variants)], tmp_path)
    for v in variants:  # the baseline of each accumulation is the one without a quantization option
        v.pop("ranks_per_node")
    _check_bounds(res, variants)


def _sent(events, group):
    """Bytes this rank sends under the usual algorithms (ring all-reduce 2 (k-1)/k of the buffer; all-gather and
    all-to-all (k-1)/k of the output / input); the dispatch counter records the largest buffer of each op."""
    k = len(group)
    return sum(n * (k - 1) / k * (2 if op == "all_reduce" else 1) for op, g, n in events if g and tuple(g) == group)


def test_bytes_across_replicas_and_nodes_at_most_0_3_of_fp32(tmp_path):
    """The demo GPT (4 ranks, accumulation 2, 2 steps): per optimizer step, what crosses the replica groups
    (s = 2) and the gather's cross-node hop (s = 4 over 2 nodes of 2), fp32 against int8 with 2048-element blocks.
    The telemetry's all_reduce/replicate bytes are the int8 wire's, as the dispatcher sees it."""
    variants = [{"s": 2}, {"s": 2, "quantize_gradients": True}, {"s": 4, "ranks_per_node": 2},
                {"s": 4, "ranks_per_node": 2, "quantize_allgather": True}]
    accum, steps = 2, 2
    res = run_ranks(GPT, 4, ["--model", "gpt", "--steps", str(steps), "--accum", str(accum), "--count",
                             "--variants", json.dumps(variants)], tmp_path)
    for r in res:
        rank = r["rank"]
        replica, inter = (rank % 2, rank % 2 + 2), (rank % 2, rank % 2 + 2)
        runs = r["variants"]
        assert all("error" not in run for run in runs), [run.get("error") for run in runs]
        for step in range(steps):
            window = slice(step * accum, (step + 1) * accum)
            per = [[e for batch in run["comms"][window] for e in batch] for run in runs]
            fp32, int8 = _sent(per[0], replica), _sent(per[1], replica)
            assert fp32 > 0 and int8 <= 0.3 * fp32, (rank, step, int8, fp32)
            wire = sum(n for op, g, n in per[1] if op == "all_to_all" and tuple(g) == replica)
            assert runs[1]["stats"][window.stop - 1]["comm/all_reduce/replicate/bytes"] == wire
            hop_fp32 = sum(n for op, g, n in per[2] if op == "all_gather" and tuple(g) == inter)
            hop_int8 = sum(n for op, g, n in per[3] if op == "all_gather" and tuple(g) == inter)
            assert hop_fp32 > 0 and hop_int8 <= 0.3 * hop_fp32, (rank, step, hop_int8, hop_fp32)
        # one sequence of collectives on each replica group, the same on its two ranks ([Note: quantized replica sync]
        # in the engine): the all-gather of one unit's int8 all-reduce never crosses another's all-to-all
        peer = res[(rank + 2) % 4]["variants"][1]["comms"]
        mine = [[(op, n) for op, g, n in batch if g and tuple(g) == replica] for batch in runs[1]["comms"]]
        assert mine == [[(op, n) for op, g, n in batch if g and tuple(g) == replica] for batch in peer]
        # the optimizer still learns: the quantized runs' validation loss is that of the fp32 runs to 1%
        assert runs[1]["val_loss"] == pytest.approx(runs[0]["val_loss"], rel=0.01)
        assert runs[3]["val_loss"] == pytest.approx(runs[2]["val_loss"], rel=0.01)


def test_bf16_mixed_quantized_gradients_within_bound_fp32_masters_int8_replica_traffic(tmp_path):
    """precision="bf16-mixed", 4 ranks, s = 2, r = 2, accumulation 1 and 2, quantize_gradients=True.

    The derived bound of [Note: the equivalence bound] is for the quantization alone; under bf16 autocast the
    forward and backward also round to bf16 (8 bits of mantissa, about the int8 blocks' own resolution), which the
    derivation does not cover. As in _check_bounds, that rounding is measured, not assumed: the unquantized
    bf16-mixed run's distance to the float64 reference (bf16_noise) is the yardstick, and the quantized run may be
    at most the derived bound plus twice that from the reference, and the derived bound plus three times it from
    the unquantized bf16-mixed run (triangle inequality)."""
    variants = [{"accum": 1}, {"accum": 1, **QG}, {"accum": 2}, {"accum": 2, **QG}]
    res = run_ranks(EQUIV, 4, ["--s", "2", "--steps", "6", "--precision", "bf16-mixed",
                               "--variants", json.dumps(variants)], tmp_path)
    r0 = res[0]
    for k in (1, 3):
        v = variants[k]
        ref = torch.tensor(r0["ref"][str(v["accum"])], dtype=torch.float64)
        plain = torch.tensor(r0["runs"][k - 1]["params"], dtype=torch.float64)
        quant = torch.tensor(r0["runs"][k]["params"], dtype=torch.float64)
        bf16_noise, bound = (plain - ref).norm().item(), r0["bounds"][k]
        assert (quant - ref).norm().item() <= bound + 2 * bf16_noise, (v, (quant - ref).norm().item(), bound,
                                                                        bf16_noise)
        assert (quant - plain).norm().item() <= bound + 3 * bf16_noise, (v, (quant - plain).norm().item(), bound,
                                                                          bf16_noise)
        assert bound + 3 * bf16_noise < 0.1 * quant.norm().item()  # and the allowance says something
        assert (quant - plain).norm().item() > bf16_noise  # the quantization did act, beyond bf16's rounding
    for r in res:
        replica = (r["rank"] % 2, r["rank"] % 2 + 2)
        for v, run in zip(variants, r["runs"]):
            # what the user gets back is the fp32 masters: the gathered state dict and the module's parameters
            if r["rank"] == 0:
                assert run["dtypes"] == ["torch.float32"], (v, run["dtypes"])
            assert run["param_dtypes"] == ["torch.float32"], (v, run["param_dtypes"])
            ops = {op for batch in run["comms"] for op, g, _ in batch if g and tuple(g) == replica}
            q = bool(v.get("quantize_gradients"))
            assert ("all_to_all" in ops) == q and ("all_reduce" in ops) == (not q), (v, ops)


@pytest.mark.parametrize("precision, rows", [("32-true", False), ("bf16-mixed", False), ("32-true", True),
                                             ("bf16-mixed", True)])
def test_error_feedback_residuals_resume_through_the_trainer(tmp_path, precision, rows):
    """quantize_gradients='error_feedback' under the Trainer (4 ranks, s = 2, 32-element blocks), saved by
    ModelCheckpoint at the end of epoch 0 and resumed with fit(ckpt_path=...) from step 3 to 6
    (tests/engine/feedback_resume.py): the sharded checkpoint carries every rank's residuals, so the resumed run
    is the uninterrupted one exactly; from the full checkpoint they restart from zero, the load says so, and the
    run differs (without the residuals the sharded resume differs by the same 6.5e-4). What the user gets back is
    the fp32 masters in bf16-mixed too. A model that stays sharded after fit keeps them for a save after it (in
    32-true only: it does not depend on the precision). ``rows``: with shard_optimizer_state=True, whose residuals
    are the int8 reduce-scatter's and the rows' change's ([Note: quantized optimizer rows])."""
    args = ["--precision", precision] + (["--shard-optimizer-state"] if rows else [])
    res = run_ranks(REPO / "tests" / "engine" / "feedback_resume.py", 4, args, tmp_path)
    for r in res:
        for kind in ("sharded", "full"):
            assert (r[kind]["start"], r[kind]["step"]) == (3, 6), r
    r0 = res[0]
    assert r0["sharded"]["max_abs"] == 0.0 and r0["sharded"]["warned"] == [], r0
    assert r0["full"]["max_abs"] > 1e-5, r0
    assert len(r0["full"]["warned"]) == 1 and "a full checkpoint holds only" in r0["full"]["warned"][0], r0
    assert r0["sharded"]["dtypes"] == r0["full"]["dtypes"] == ["torch.float32"], r0
    if precision == "32-true":
        assert r0["after_fit_ranks"] == ["rank0", "rank1", "rank2", "rank3"], r0  # kept past the end of fit


def test_optimizer_rows_over_replicas_in_int8_within_the_derived_bound(tmp_path):
    """shard_optimizer_state=True at s = 2, r = 2 ([Note: quantized optimizer rows] in optimizer_rows.py): the
    reduce-scatter in int8 (``True``; the rows' all-gather in fp32), and with error feedback the rows' change too.
    Each within the bound of the same option on the all-reduce (the reduce-scatter is its first half; the int8
    delta's residual is the requantized chunk's, scaled by the learning rate); every replica of a shard rank
    holds the same bits; on the replica group an all-to-all and an all-gather, and no all-reduce but of a 4-byte
    flag a unit on the forwards no step precedes ([Note: rows between steps]). The model is
    nn.Linear(22, 11): each replica's rows (3 x 22 + 3 = 69 elements) are padded to a whole quantized chunk (72)."""
    OS = {"shard_optimizer_state": True}
    variants = []
    for accum in (1, 3):
        variants += [{"accum": accum}, {"accum": accum, **OS}, {"accum": accum, **OS, **QG},
                     {"accum": accum, **OS, **EF}]
    res = run_ranks(EQUIV, 4, ["--s", "2", "--steps", "6", "--in-features", "22", "--variants", json.dumps(variants)],
                    tmp_path)
    _check_bounds(res, variants)
    for r in res:
        replica = (r["rank"] % 2, r["rank"] % 2 + 2)
        peer = res[(r["rank"] + 2) % 4]
        for v, run, other in zip(variants, r["runs"], peer["runs"]):
            assert run["chunks"] == other["chunks"], v  # bit for bit across the replicas
            ops = {op for batch in run["comms"] for op, g, _ in batch if g and tuple(g) == replica}
            if v.get("quantize_gradients"):  # and the all-reduces of a flag a unit ([Note: rows between steps])
                assert ops == {"all_to_all", "all_gather", "all_reduce"}, (v, ops)
                flags = {n for batch in run["comms"] for op, g, n in batch
                         if op == "all_reduce" and tuple(g) == replica}
                assert flags == {4}, (v, flags)  # one unit


def test_optimizer_rows_over_replicas_bytes_in_int8(tmp_path):
    """The demo GPT (4 ranks, s = 2, accumulation 2, 2 steps), shard_optimizer_state=True: what crosses the replica
    groups with the rows in fp32, with the reduce-scatter in int8 (``True``: at most 0.3x of its fp32 bytes, the
    all-gather of the updated rows stays fp32) and with the rows' change in int8 too (``"error_feedback"``: both at
    most 0.3x, scales included); the telemetry's bytes are the dispatcher's; the two ranks of a replica group
    issue one sequence on it; the validation loss is the fp32 run's to 1%. The all-gathers of a step's rows start
    the next window's first forward ([Note: rows between steps]); the last step's go at the end of the fit, outside
    the batches, so the 2 windows hold 2 reduce-scatters and 1 all-gather per unit. Beside them, one all-reduce of
    a 4-byte flag a unit on each forward no step precedes."""
    variants = [{"s": 2, "shard_optimizer_state": True},
                {"s": 2, "shard_optimizer_state": True, "quantize_gradients": True},
                {"s": 2, "shard_optimizer_state": True, "quantize_gradients": "error_feedback"}]
    accum, steps = 2, 2
    res = run_ranks(GPT, 4, ["--model", "gpt", "--steps", str(steps), "--accum", str(accum), "--count",
                             "--variants", json.dumps(variants)], tmp_path)
    for r in res:
        rank = r["rank"]
        replica = (rank % 2, rank % 2 + 2)
        runs = r["variants"]
        assert all("error" not in run for run in runs), [run.get("error") for run in runs]
        units = runs[0]["state_bytes"]["n_units"]
        per = [[e for batch in run["comms"] for e in batch if e[1] and tuple(e[1]) == replica] for run in runs]
        flags = [[n for op, _, n in p if op == "all_reduce"] for p in per]
        assert flags[1] == flags[2] == [4 * units] * 3, flags  # the first forward and each window's second
        rows = [[e for e in p if e[0] != "all_reduce"] for p in per]
        assert [op for op, _, _ in rows[2]] == ["all_to_all"] * units + ["all_gather"] * units + \
            ["all_to_all"] * units, rows[2]
        rs = [_sent([e for e in p if e[0] == "all_to_all"], replica) for p in rows]
        ag = [_sent([e for e in p if e[0] == "all_gather"], replica) for p in rows]
        per_rs, per_ag = rs[0] / steps, ag[0] / (steps - 1)  # the two halves of one ring all-reduce
        assert per_rs > 0 and abs(per_rs - per_ag) <= 0.02 * per_rs, (rank, rs, ag)
        assert rs[1] <= 0.3 * rs[0] and ag[1] == ag[0], (rank, rs, ag)  # the rows stay fp32
        assert rs[2] <= 0.3 * rs[0] and ag[2] <= 0.3 * ag[0], (rank, rs, ag)
        for run, events in zip(runs[1:], rows[1:]):
            stats = {}
            for st in run["stats"][accum - 1::accum]:  # published at each optimizer step, for its window
                for k, v in st.items():
                    stats[k] = stats.get(k, 0) + v
            for op, name in (("all_to_all", "reduce_scatter"), ("all_gather", "all_gather")):
                seen = sum(n for o, g, n in events if o == op)
                assert stats[f"comm/{name}/replicate/bytes"] == seen, (op, stats, seen)
        peer = res[(rank + 2) % 4]["variants"]
        for run, other in zip(runs, peer):
            mine = [[(op, n) for op, g, n in batch if g and tuple(g) == replica] for batch in run["comms"]]
            assert mine == [[(op, n) for op, g, n in batch if g and tuple(g) == replica] for batch in other["comms"]]
        for run in runs[1:]:
            assert run["val_loss"] == pytest.approx(runs[0]["val_loss"], rel=0.01)
