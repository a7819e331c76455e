"""One rank of the quantized collectives' checks (lightning_mics/comm/quantized.py) on real gloo ranks.

Every rank draws every rank's input from a seed, so each one computes the exact reference (float64) and the
bound itself; the results (errors, bounds, flags) go to result<rank>.json for the test to judge.
Bounds ([Note: quantized all-reduce]): per element of block b, with A_i = absmax of rank i's block,
  |out - sum_i x_i| <= 2 sum_i A_i / 254 + (r + 6) U sum_i A_i          (U = 2**-24)
the second term being fp32 rounding: each quantization's scale and product (3 U A, as in test_quant_kernels.py),
the fp32 sum of r dequantized values ((r - 1) U sum A), the requantization's own 3 U.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from lightning_mics.comm import quantized  # noqa: E402
from lightning_mics.comm.collectives import NodeGroups, all_gather_two_hop, gathered, wait  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

U = 2.0 ** -24


def inputs(n, r, seed, spread=True):
    """r contributions of n elements, block magnitudes spread over 1e-3..1e3 so a per-block bound matters."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(r):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        if spread:
            x *= 10.0 ** torch.randint(-3, 4, ((n + 15) // 16,), generator=g).repeat_interleave(16)[:n]
        xs.append(x.float())
    return xs


def block_absmax(x, r, block):
    """Per element, the absmax of its block in the quantized layout (chunks of c, blocks of B from each chunk's
    start): written from the note, independent of the kernels."""
    n = x.numel()
    c = -(-n // (4 * r)) * 4
    nb = -(-c // block)
    padded = torch.zeros(r * c, dtype=torch.float64)
    padded[:n] = x.double().abs()
    rows = torch.zeros(r, nb * block, dtype=torch.float64)
    rows[:, :c] = padded.view(r, c)
    amax = rows.view(r, nb, block).amax(-1, keepdim=True).expand(r, nb, block).reshape(r, -1)[:, :c]
    return amax.reshape(-1)[:n]


def all_same(t, group=None):
    """Whether every rank of the group holds bit-identical values (NaNs compared by bits)."""
    mine = t.detach().contiguous().reshape(-1).view(torch.uint8)
    out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.uint8)
    dist.all_gather_single(out, mine.contiguous(), group=group)
    rows = out.view(dist.get_world_size(group), -1)
    return bool((rows == rows[0]).all())


def case_bound(r, rank, n, block, dtype, seed):
    xs = inputs(n, r, seed)
    flat = xs[rank].to(dtype, copy=True)
    quantized.quantized_all_reduce(flat, dist.group.WORLD, block)
    ref = sum(x.to(dtype).double() for x in xs)
    amax = sum(block_absmax(x.to(dtype), r, block) for x in xs)
    bound = 2 * amax / 254 + (r + 6) * U * amax
    if dtype != torch.float32:  # the output rounded to its dtype: half an ulp of |out| (8 bits for bf16)
        bound = bound + (ref.abs() + bound) * torch.finfo(dtype).eps / 2
    err = (flat.double() - ref).abs()
    ratio = (err / bound.clamp_min(1e-300)).max().item() if n else 0.0
    return {"n": n, "block": block, "dtype": str(dtype), "ok": bool((err <= bound).all()), "worst_ratio": ratio,
            "same": all_same(flat)}


def case_nonfinite(r, rank):
    n, block = 4 * 64 * r, 64  # r chunks of 4 blocks
    xs = inputs(n, r, 7)
    bad = {0: (5, float("nan")), 1: (3 * 64 + 1, float("inf")), 2: (70, -float("inf"))}
    for who, (i, v) in bad.items():
        if who < r:
            xs[who][i] = v
    flat = xs[rank].clone()
    res = quantized.feedback_buffers(n, r, block, torch.float32, flat.device)
    quantized.quantized_all_reduce(flat, dist.group.WORLD, block, residual=res)
    blocks = {i // block for who, (i, _) in bad.items() if who < r}
    nan_blocks = sorted(b for b in range(n // block) if torch.isnan(flat[b * block:(b + 1) * block]).all())
    finite_elsewhere = all(bool(torch.isfinite(flat[b * block:(b + 1) * block]).all())
                           for b in range(n // block) if b not in blocks)
    # the next call, finite inputs: the residual's NaN was reset, nothing stays poisoned
    again = inputs(n, r, 8)[rank]
    quantized.quantized_all_reduce(again, dist.group.WORLD, block, residual=res)
    return {"nan_blocks": nan_blocks, "expected": sorted(blocks), "finite_elsewhere": finite_elsewhere,
            "next_finite": bool(torch.isfinite(again).all()), "same": all_same(flat)}


def case_zero_blocks(r, rank):
    n, block = 8 * 32 * r, 32
    xs = inputs(n, r, 11)
    for x in xs:
        x[0:32] = 0.0  # a block zero on every rank
    xs[0][64:96] = 0.0  # a block zero on one rank only
    flat = xs[rank].clone()
    quantized.quantized_all_reduce(flat, dist.group.WORLD, block)
    ref = sum(x.double() for x in xs)
    amax = sum(block_absmax(x, r, block) for x in xs)
    ok = bool(((flat.double() - ref).abs() <= 2 * amax / 254 + (r + 6) * U * amax).all())
    return {"zero_exact": bool((flat[0:32] == 0).all()), "ok": ok}


def case_error_feedback(r, rank, steps=20):
    """The same contributions every call: without feedback each call makes the same error, so it adds up T times;
    with it, sum_t out_t - T sum_i x_i = -(sum_i e_i,T + g_T), bounded by the last call's residuals:
    |e_i| <= A_i / 253 and |g| <= A_S / 253 with A_S <= sum_i A_i (1 + 1/253) (the residual enlarges each block's
    absmax by at most its own bound: e <= (A + e) / 254), plus T calls of fp32 rounding."""
    n, block = 3001, 128
    xs = inputs(n, r, 21)
    res = quantized.feedback_buffers(n, r, block, torch.float32, torch.device("cpu"))
    acc_ef = torch.zeros(n, dtype=torch.float64)
    acc_plain = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        a = xs[rank].clone()
        quantized.quantized_all_reduce(a, dist.group.WORLD, block, residual=res)
        acc_ef += a.double()
        b = xs[rank].clone()
        quantized.quantized_all_reduce(b, dist.group.WORLD, block)
        acc_plain += b.double()
    ref = steps * sum(x.double() for x in xs)
    amax = sum(block_absmax(x, r, block) for x in xs)
    bound = amax / 253 + amax * (1 + 1 / 253) / 253 + steps * (r + 8) * U * amax * (1 + 2 / 253)
    err_ef, err_plain = (acc_ef - ref).abs(), (acc_plain - ref).abs()
    return {"ok": bool((err_ef <= bound).all()), "ef_mean": err_ef.mean().item(), "plain_mean": err_plain.mean().item(),
            "single_bound_mean": (2 * amax / 254).mean().item()}


def case_async(r, rank):
    n, block = 5003, 256
    xs = inputs(n, r, 31)
    ys = inputs(777, r, 32)
    sync_x, sync_y = xs[rank].clone(), ys[rank].clone()
    quantized.quantized_all_reduce(sync_x, dist.group.WORLD, block)
    quantized.quantized_all_reduce(sync_y, dist.group.WORLD, block)
    ax, ay = xs[rank].clone(), ys[rank].clone()
    px = quantized.quantized_all_reduce(ax, dist.group.WORLD, block, async_op=True)
    py = quantized.quantized_all_reduce(ay, dist.group.WORLD, block, async_op=True)
    busy = torch.randn(200, 200) @ torch.randn(200, 200)  # compute while both all-to-alls are in flight
    px.advance()  # x's all-gather issued while y's all-to-all may still run
    assert not px.done and not py.done
    wait(py)
    px.wait()
    assert px.done and py.done
    return {"equal": bool(torch.equal(ax, sync_x) and torch.equal(ay, sync_y)), "busy": float(busy.sum()) != 0}


def sent_bytes(events, group):
    """Bytes this rank sends under the usual algorithms, from the dispatch counts (largest buffer per op): ring
    all-reduce 2 (k-1)/k of the buffer, all-gather (k-1)/k of the output, all-to-all (k-1)/k of the input."""
    total = 0.0
    for op, g, nbytes in events:
        if g != group:
            continue
        k = len(g)
        total += nbytes * (k - 1) / k * (2 if op == "all_reduce" else 1)
    return total


def case_bytes(r, rank):
    n, block = 100_003, 2048
    world = tuple(range(r))
    x = inputs(n, r, 41)[rank]
    with CommCounter() as plain:
        dist.all_reduce(x.clone())
    with CommCounter() as quant:
        quantized.quantized_all_reduce(x.clone(), dist.group.WORLD, block)
    ops = sorted({op for op, g, _ in quant.events})
    return {"plain": sent_bytes(plain.events, world), "quant": sent_bytes(quant.events, world), "ops": ops,
            "wire": quantized.wire_bytes(n, r, block)}


def case_all_gather(r, rank):
    out = {}
    for size, block, dtype in [(7, 4, torch.float32), (4099, 64, torch.bfloat16), (1000, 2048, torch.float32)]:
        shards = inputs(size, r, 51 + size)
        res = quantized.quantized_all_gather(shards[rank], dist.group.WORLD, r, block, dtype=dtype, async_op=True)
        got = gathered(res)
        errs, oks = [], []
        for j in range(r):
            amax = block_absmax(shards[j], 1, block)
            bound = amax / 254 + 3 * U * amax
            if dtype != torch.float32:
                bound = bound + (shards[j].double().abs() + bound) * torch.finfo(dtype).eps / 2
            err = (got[j].double() - shards[j].double()).abs()
            oks.append(bool((err <= bound).all()))
            errs.append((err / bound.clamp_min(1e-300)).max().item())
        out[f"{size}/{block}/{dtype}"] = {"ok": all(oks), "worst_ratio": max(errs), "dtype": str(got.dtype),
                                          "shape": list(got.shape), "same": all_same(got)}
    return out


def case_reduce_scatter(r, rank):
    """quantized_reduce_scatter ([Note: quantized optimizer rows]): this rank's chunk of the sum within
    sum_i A_i / 254 + (r + 6) U sum_i A_i per element (one quantization, no requantization), async bit-equal to
    sync, one all-to-all of the int8 wire; with error feedback, T calls of the same inputs sum to T sum_i x_i within
    the last residuals' bound (as case_error_feedback); and quantized_all_gather with a residual the same way."""
    out = {}
    for n, block in [(4 * r * 250, 64), (4099, 128), (8 * r, 2048)]:
        xs = inputs(n, r, 71 + n)
        c = -(-n // (4 * r)) * 4
        mine = slice(rank * c, min(n, (rank + 1) * c))
        with CommCounter() as seen:
            got = quantized.quantized_reduce_scatter(xs[rank].clone(), dist.group.WORLD, block).output
        handle = quantized.quantized_reduce_scatter(xs[rank].clone(), dist.group.WORLD, block, async_op=True)
        wait(handle.work)
        ref = sum(x.double() for x in xs)[mine]
        amax = sum(block_absmax(x, r, block) for x in xs)[mine]
        err = (got[:mine.stop - mine.start].double() - ref).abs()
        out[f"{n}/{block}"] = {"ok": bool((err <= amax / 254 + (r + 6) * U * amax).all()),
                               "async_equal": bool(torch.equal(handle.output, got)), "chunk": got.numel() == c,
                               "ops": sorted({op for op, _, _ in seen.events}), "padding_zero":
                               bool((got[mine.stop - mine.start:] == 0).all())}
    n, block, steps = 3001, 128, 20
    xs = inputs(n, r, 81)
    c = -(-n // (4 * r)) * 4
    mine = slice(rank * c, min(n, (rank + 1) * c))
    res = torch.zeros(n)
    acc = torch.zeros(c, dtype=torch.float64)
    for _ in range(steps):
        acc += quantized.quantized_reduce_scatter(xs[rank].clone(), dist.group.WORLD, block, residual=res).output.double()
    ref = steps * sum(x.double() for x in xs)[mine]
    amax = sum(block_absmax(x, r, block) for x in xs)[mine]
    bound = amax / 253 + steps * (r + 8) * U * amax * (1 + 2 / 253)
    out["feedback"] = {"ok": bool(((acc[:mine.stop - mine.start] - ref).abs() <= bound).all())}
    shards = inputs(1001, r, 91)
    res, acc, own = torch.zeros(1001), torch.zeros(r, 1001, dtype=torch.float64), torch.empty(1001)
    for _ in range(steps):
        got = gathered(quantized.quantized_all_gather(shards[rank], dist.group.WORLD, r, 64, residual=res, own=own))
        acc += got.double()
    amax = torch.stack([block_absmax(s, 1, 64) for s in shards])
    bound = amax / 253 + steps * 4 * U * amax
    out["gather_feedback"] = {"ok": bool(((acc - steps * torch.stack(shards).double()).abs() <= bound).all()),
                              "same": all_same(acc), "own_equal": bool(torch.equal(own, got[rank]))}
    return out


def case_two_hop(r, rank):
    """4 ranks as 2 nodes of 2: the quantized two-hop gather against the unquantized one, and its bytes."""
    per_node, n_nodes = 2, r // 2
    inter = [dist.new_group([a * per_node + l for a in range(n_nodes)]) for l in range(per_node)]
    intra = [dist.new_group([a * per_node + l for l in range(per_node)]) for a in range(n_nodes)]
    nodes = NodeGroups(inter[rank % per_node], intra[rank // per_node], n_nodes, per_node)
    inter_ranks = tuple(a * per_node + rank % per_node for a in range(n_nodes))
    size, block = 50_001, 2048
    shards = inputs(size, r, 61)
    with CommCounter() as plain:
        ref = gathered(all_gather_two_hop(shards[rank], nodes, dtype=torch.float32))
    with CommCounter() as quant:
        got = gathered(quantized.quantized_all_gather_two_hop(shards[rank], nodes, block, dtype=torch.float32,
                                                      async_op=True))
    oks = []
    for j in range(r):
        amax = block_absmax(shards[j], 1, block)
        oks.append(bool(((got[j].double() - ref[j].double()).abs() <= amax / 254 + 3 * U * amax).all()))
    return {"ok": all(oks), "ref_exact": bool(torch.equal(ref, torch.stack(shards))), "same": all_same(got),
            "plain_inter": sent_bytes(plain.events, inter_ranks), "quant_inter": sent_bytes(quant.events, inter_ranks)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="all")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, r = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank}
    want = lambda name: args.cases == "all" or name in args.cases.split(",")  # noqa: E731
    if want("bound"):
        result["bound"] = [case_bound(r, rank, n, block, dtype, seed)
                           for seed, (n, block, dtype) in enumerate([
                               (1, 2048, torch.float32), (3, 1, torch.float32), (7, 5, torch.float32),
                               (1001, 64, torch.float32), (4099, 2048, torch.float32), (10_000, 256, torch.float32),
                               (0, 2048, torch.float32), (2053, 128, torch.bfloat16)])]
    for name, fn in [("nonfinite", case_nonfinite), ("zero_blocks", case_zero_blocks),
                     ("error_feedback", case_error_feedback), ("async", case_async), ("bytes", case_bytes),
                     ("all_gather", case_all_gather), ("reduce_scatter", case_reduce_scatter)]:
        if want(name):
            result[name] = fn(r, rank)
    if want("two_hop") and r % 2 == 0 and r >= 4:
        result["two_hop"] = case_two_hop(r, rank)
    Path(args.out, f"result{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
