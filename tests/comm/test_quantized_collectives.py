"""lightning_mics/comm/quantized.py on real gloo ranks (2 and 4): the int8 all-reduce and all-gathers against exact
float64 references, with bounds derived from the per-block error (tests/comm/quant_collectives.py states them),
non-finite and zero blocks, odd sizes, error feedback, the async form, and the bytes the dispatcher sees."""

import pytest

from tests.helpers.launch import REPO, run_ranks

SCRIPT = REPO / "tests" / "comm" / "quant_collectives.py"
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(SCRIPT, world, [], tmp_path_factory.mktemp(f"quant{world}"))


def test_sum_within_the_block_bound_on_every_rank_identically(ranks):
    world, res = ranks
    for r in res:
        sizes = [c["n"] for c in r["bound"]]
        assert sizes == [1, 3, 7, 1001, 4099, 10_000, 0, 2053]  # odd sizes, one-element blocks, empty
        for c in r["bound"]:
            assert c["ok"], (world, c)  # |out - sum x_i| <= 2 sum_i A_i / 254 + fp32 rounding, per element
            assert c["same"], c  # every replica holds the same bits
        # the bound is not loose by orders of magnitude: some case comes within 2x of it
        assert max(c["worst_ratio"] for c in r["bound"]) > 0.5


def test_nonfinite_blocks_stay_nan_and_feedback_recovers(ranks):
    _, res = ranks
    for r in res:
        c = r["nonfinite"]
        assert c["nan_blocks"] == c["expected"]  # NaN, +inf, -inf each make their whole block NaN in the sum
        assert c["finite_elsewhere"] and c["same"]
        assert c["next_finite"]  # the residual's NaN was reset: the next call is finite


def test_zero_blocks_exact(ranks):
    _, res = ranks
    for r in res:
        assert r["zero_blocks"]["zero_exact"] and r["zero_blocks"]["ok"]


def test_error_feedback_does_not_accumulate(ranks):
    _, res = ranks
    for r in res:
        c = r["error_feedback"]
        assert c["ok"], c  # after 20 calls, within the last call's residual bound
        # without feedback the same error repeats 20 times; with it, less than one call's bound on average
        assert c["ef_mean"] < c["single_bound_mean"] < c["plain_mean"], c


def test_async_matches_sync_bit_for_bit(ranks):
    _, res = ranks
    for r in res:
        assert r["async"]["equal"]


def test_bytes_at_most_0_3_of_fp32(ranks):
    world, res = ranks
    for r in res:
        c = r["bytes"]
        assert c["ops"] == ["all_gather", "all_to_all"]  # no all-reduce: nothing is summed in int8
        # bytes sent per rank (scales included): 2 (k-1)/k of the int8 wire against 2 (k-1)/k of 4 n for fp32
        assert c["quant"] == pytest.approx(2 * (world - 1) / world * c["wire"])
        assert c["quant"] <= 0.3 * c["plain"], c


def test_quantized_all_gather(ranks):
    _, res = ranks
    for r in res:
        for key, c in r["all_gather"].items():
            assert c["ok"] and c["same"], (key, c)  # each row within absmax / 254 (+ output rounding)
            assert c["dtype"] == key.split("/")[2]


def test_quantized_reduce_scatter_and_feedback_gather(ranks):
    """The halves of the optimizer rows' replica sync ([Note: quantized optimizer rows] in optimizer_rows.py)."""
    _, res = ranks
    for r in res:
        c = r["reduce_scatter"]
        sizes = [k for k in c if "/" in k]
        assert len(sizes) == 3, c  # whole chunks, an odd size, one short block per chunk
        for key in sizes:
            assert c[key]["ok"] and c[key]["async_equal"] and c[key]["chunk"] and c[key]["padding_zero"], (key, c)
            assert c[key]["ops"] == ["all_to_all"], c[key]
        assert c["feedback"]["ok"], c  # error feedback: T calls within the last residuals' bound
        assert c["gather_feedback"]["ok"] and c["gather_feedback"]["same"], c
        assert c["gather_feedback"]["own_equal"], c  # the sender's own row at once: the bits the others get


@pytest.mark.parametrize("ranks", [4], indirect=True)  # two hops: 2 nodes of 2 ranks
def test_two_hop_gather_cross_node_hop_quantized(ranks):
    _, res = ranks
    for r in res:
        c = r["two_hop"]
        assert c["ref_exact"] and c["ok"] and c["same"], c
        assert c["quant_inter"] <= 0.3 * c["plain_inter"], c  # the cross-node hop, against fp32
