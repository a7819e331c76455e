"""triton_kernels' block-quantized int8 ops: the Triton path (interpreted on CPU, compiled on a GPU) against
the torch fallback bit for bit, and both against a per-block reference written from
[Note: quantized wire format] and [Note: quantized block rule] (triton_kernels/_quant_layout.py) and against the
properties the engine relies on.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_quant_kernels.py
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_mics_kernels as tk

REPO = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("triton", "torch")
U = 2.0**-24  # fp32 unit roundoff
# |x - q * s| <= s * (1/2 + 127 U) with s = (absmax / 127)(1 + U), plus U * |q s| <= U * absmax for the product's
# rounding: absmax / 254 + 2.01 U absmax at most. The scale's and the product's fp32 rounding is all the slack.
SLACK = 3 * U


@pytest.fixture(scope="module")
def device():
    pytest.importorskip("triton")
    from lightning_mics_kernels._backend import kernels_interpreted

    if kernels_interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("Triton kernels are compiled (TRITON_INTERPRET unset) and there is no GPU")


def layout_of(n, block, r):
    c = -(-n // (4 * r)) * 4
    return c, -(-c // block)


def ref_wire(flat, block, r):
    """The wire bytes, block by block, straight from the note (independent of the code under test)."""
    n = flat.numel()
    c, nb = layout_of(n, block, r)
    x = torch.cat([flat.float().cpu(), torch.zeros(r * c - n)]).view(r, c)
    rows = []
    for j in range(r):
        scales, qs = [], []
        for k in range(nb):
            b = x[j, k * block: min((k + 1) * block, c)]
            s = torch.tensor(float("nan")) if not torch.isfinite(b).all() else b.abs().max() / 127
            q = torch.round(torch.clamp(b / s, -127, 127)) if s > 0 else torch.zeros_like(b)
            scales.append(s.reshape(1))
            qs.append(q.to(torch.int8))
        rows.append(torch.cat([torch.cat(scales or [torch.empty(0)]).view(torch.uint8),
                               torch.cat(qs or [torch.empty(0, dtype=torch.int8)]).view(torch.uint8)]))
    return torch.stack(rows)


def ref_dequant(wire, n, block, r):
    """fp32 (r * c,) flat from the wire: float(q) * its block's scale."""
    c, nb = layout_of(n, block, r)
    w = wire.cpu().view(r, 4 * nb + c)
    s = w[:, : 4 * nb].contiguous().view(torch.float32).repeat_interleave(block, dim=1)[:, :c]
    return (w[:, 4 * nb:].contiguous().view(torch.int8).float() * s).reshape(-1)


def blocks_of(values, n, block, r):
    """Yield (flat index range) of every block of the layout that holds real elements."""
    c, nb = layout_of(n, block, r)
    for j in range(r):
        for k in range(nb):
            lo, hi = j * c + k * block, min(j * c + min((k + 1) * block, c), n)
            if hi > lo:
                yield lo, hi


def assert_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    a, b = a.reshape(-1).cpu(), b.reshape(-1).cpu()
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), "NaN positions differ"
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    assert torch.equal(a[~nan].view(ints[a.dtype]), b[~nan].view(ints[b.dtype]))


# The interpreter runs a kernel's programs one after another, one per block: one-element blocks get a smaller
# bucket with the same kinds of tensor (every dtype, 0-d, empty, one element, 2-d, tensors across chunk edges).
BUCKET = (37, (5, 3), 100, (), 0, 1, (2, 64), 300)
BUCKET_FOR_BLOCK_1 = (37, (5, 3), 10, (), 0, 1, (2, 6), 30)


def bucket(gen, device, sizes=BUCKET, scale=1.0):
    ts = []
    for i, s in enumerate(sizes):
        mag = 10.0 ** float(torch.randint(-3, 4, (), generator=gen))  # blocks of very different magnitudes
        ts.append((torch.randn(s, generator=gen) * mag * scale).to(DTYPES[i % 3]).to(device))
    return ts


def flat_of(ts):
    return torch.cat([t.reshape(-1).float().cpu() for t in ts]) if ts else torch.empty(0)


# --- the layout and agreement: reference == torch fallback == Triton, bit for bit ------------------------


@pytest.mark.triton
@pytest.mark.parametrize("r", [1, 2, 3, 5])
@pytest.mark.parametrize("block", [1, 3, 16, 100])
def test_matches_reference_and_backends_agree(device, r, block):
    gen = torch.Generator().manual_seed(r * 1000 + block)
    ts = bucket(gen, device, sizes=BUCKET_FOR_BLOCK_1 if block == 1 else BUCKET)
    n = sum(t.numel() for t in ts)
    want = ref_wire(flat_of(ts), block, r)
    c, nb = layout_of(n, block, r)
    assert tk.quant_layout(n, block, r) == (n, r, block, c, nb, 4 * nb + c)
    for b in BACKENDS:
        got = tk.quantize(ts, block, num_chunks=r, backend=b)
        assert got.wire.shape == (r, 4 * nb + c) and got.wire.dtype == torch.uint8
        assert torch.equal(got.wire.cpu(), want), b
        assert got.q.shape == (r, c) and got.scales.shape == (r, nb)
        outs = [torch.full_like(t, 7) for t in ts]
        tk.dequantize(got.wire, outs, block, num_chunks=r, backend=b)
        deq = ref_dequant(want, n, block, r)[:n]
        for o, piece in zip(outs, torch.split(deq, [t.numel() for t in ts])):
            assert_bits(o, piece.view(o.shape).to(o.dtype).to(device))  # cast rounds to nearest even, as torch


@pytest.mark.triton
@pytest.mark.parametrize("n,r,block", [(1, 1, 1), (1, 4, 2), (3, 2, 5), (17, 3, 4), (257, 4, 64), (891, 7, 100),
                                       (4100, 2, 2048), (4100, 1, 4096), (61, 2, 1)])
def test_odd_sizes(device, n, r, block):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(device)
    want = ref_wire(x, block, r)
    c, _ = layout_of(n, block, r)
    for b in BACKENDS:
        got = tk.quantize([x], block, num_chunks=r, backend=b)
        assert torch.equal(got.wire.cpu(), want)
        assert not got.q.reshape(-1)[n:].any()  # the flat's padding (at most 4r - 1 elements) quantizes to 0
        assert r * c - n < 4 * r
        out = torch.empty(n, device=device)
        tk.dequantize(got.wire, [out], block, num_chunks=r, backend=b)
        check_bound(x, out, n, block, r)


def check_bound(x, deq, n, block, r):
    x64, d64 = x.double().reshape(-1).cpu(), deq.double().reshape(-1).cpu()
    for lo, hi in blocks_of(x, n, block, r):
        absmax = x64[lo:hi].abs().max()
        err = (x64[lo:hi] - d64[lo:hi]).abs().max()
        assert err <= absmax / 254 + SLACK * absmax, (lo, hi, float(err), float(absmax))


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [1, 7, 64, 2048])
def test_error_bound_per_block(device, backend, block):
    """|x - dequant(quant(x))| <= absmax / 254 per block (fp32 rounding of the scale aside: SLACK)."""
    gen = torch.Generator().manual_seed(block)
    # a first tensor of several blocks of each size (5000 elements for the large ones, 500 for 7)
    sizes = {1: BUCKET_FOR_BLOCK_1, 7: (500, 33, (7, 11), 1)}.get(block, (5000, 33, (7, 11), 1))
    ts = bucket(gen, device, sizes=sizes)
    n = sum(t.numel() for t in ts)
    for r in (1, 3):
        got = tk.quantize(ts, block, num_chunks=r, backend=backend)
        out = torch.empty(n, device=device)
        tk.dequantize(got.wire, [out], block, num_chunks=r, backend=backend)
        check_bound(flat_of(ts), out, n, block, r)


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_on_the_grid_round_trip_exactly(device, backend):
    gen, block, nblocks = torch.Generator().manual_seed(0), 32, 40
    k = torch.randint(-127, 128, (nblocks, block), generator=gen)
    k[torch.arange(nblocks), torch.randint(0, block, (nblocks,), generator=gen)] = 127  # absmax = 127 s exactly
    k[::3] *= -1
    mant = torch.randint(1, 2**16, (nblocks, 1), generator=gen).double()  # 16-bit mantissas: 127 s and k s exact
    s = mant * torch.pow(2.0, torch.randint(-40, 10, (nblocks, 1), generator=gen).double())
    x = (k * s).float().reshape(-1)
    assert torch.equal(x.double(), (k * s).reshape(-1))
    got = tk.quantize([x.to(device)], block, backend=backend)
    assert torch.equal(got.q.cpu().reshape(nblocks, block).long(), k)
    assert torch.equal(got.scales.cpu().reshape(-1).double(), s.reshape(-1))
    out = tk.dequantize(got.wire, [torch.empty(x.shape, device=device)], block, backend=backend)[0]
    assert_bits(out, x.to(device))


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_blocks_and_one_element_blocks(device, backend):
    x = torch.tensor([0.0, -0.0, 0.0, 0.0, 1e-3, -2.0, 0.0, 5.0, 0.0, 1e-45, 0.0, 0.0], device=device)
    got = tk.quantize([x], 4, backend=backend)
    want = torch.stack([torch.tensor(0.0), torch.tensor(5.0) / 127, torch.tensor(0.0)])  # fp32 division
    assert torch.equal(got.scales.cpu(), want.view(1, 3))  # 1e-45 / 127 underflows: a zero scale too
    assert not got.q[0, :4].any() and not got.q[0, 8:].any()
    out = tk.dequantize(got.wire, [torch.full_like(x, 9.0)], 4, backend=backend)[0]
    assert torch.equal(out[:4], torch.zeros(4, device=device)) and torch.equal(out[8:], torch.zeros(4, device=device))
    assert out[7] == 5.0 and out[5] == -51 * want[1]  # 127 * (5 / 127), round(-2 / (5 / 127)) * (5 / 127)
    ones = torch.tensor([3.0, -0.5, 0.0, 1e-30, 7.25], device=device)
    got = tk.quantize([ones], 1, backend=backend)  # one element per block: q = +-127 or 0
    assert got.q.cpu().tolist() == [[127, -127, 0, 127, 127, 0, 0, 0]]
    out = tk.dequantize(got.wire, [torch.empty_like(ones)], 1, backend=backend)[0]
    check_bound(ones, out, 5, 1, 1)


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_values_are_not_hidden(device, backend):
    block, r = 8, 2
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    bad = {3: float("nan"), 20: float("inf"), 37: -float("inf"), 63: float("nan")}
    for i, v in bad.items():
        x[i] = v
    got = tk.quantize([x.to(device)], block, num_chunks=r, backend=backend)
    clean = tk.quantize([torch.nan_to_num(x, 0.0, 0.0, 0.0).to(device)], block, num_chunks=r, backend=backend)
    bad_blocks = {i // block for i in bad}
    for dtype in DTYPES:
        out = tk.dequantize(got.wire, [torch.empty(64, dtype=dtype, device=device)], block, num_chunks=r,
                            backend=backend)[0].cpu()
        ref = tk.dequantize(clean.wire, [torch.empty(64, dtype=dtype, device=device)], block, num_chunks=r,
                            backend=backend)[0].cpu()
        for k in range(8):
            blk = slice(k * block, (k + 1) * block)
            if k in bad_blocks:  # every value of the block, finite inputs included, comes out NaN
                assert torch.isnan(out[blk]).all(), (dtype, k)
            else:
                assert torch.equal(out[blk], ref[blk])
    assert torch.isnan(got.scales.cpu().reshape(-1)[sorted(bad_blocks)]).all()
    # reduced: a rank's NaN block poisons that block of the sum, nothing else
    recv = torch.stack([got.wire[0], clean.wire[0]])
    total = tk.dequantize_sum(recv, 2, block, backend=backend).cpu()
    for k in range(32 // block):  # chunk 0 = blocks 0 .. 3 of the flat
        blk = total[k * block: (k + 1) * block]
        assert torch.isnan(blk).all() if k in bad_blocks else torch.isfinite(blk).all(), k


# --- error feedback, the reduction, and one launch per bucket ----------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
def test_error_feedback(device, res_dtype):
    """residual <- x + residual - dequant(q), in the same launch; the sum over steps of what was sent equals
    the sum of the inputs minus the final residual, so the quantization error does not accumulate."""
    gen, block, r, steps = torch.Generator().manual_seed(5), 16, 2, 6
    res = {b: torch.zeros(300, dtype=res_dtype, device=device) for b in BACKENDS}
    sent, inputs = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    tol = 0.0  # per step: the fp32 rounding of x = input + residual, and the rounding of x - dequant to res_dtype
    eps = {torch.float32: U, torch.bfloat16: 2.0**-9}[res_dtype]
    for _ in range(steps):
        ts = bucket(gen, device, sizes=(100, (10, 10), 99, 1))
        before = res["torch"].clone()
        got = {b: tk.quantize(ts, block, num_chunks=r, residual=res[b], backend=b) for b in BACKENDS}
        assert torch.equal(got["triton"].wire, got["torch"].wire)
        assert_bits(res["triton"], res["torch"])
        deq = ref_dequant(got["torch"].wire, 300, block, r)[:300]
        x = flat_of(ts) + before.float().cpu()
        assert_bits(res["torch"].cpu(), (x - deq).to(res_dtype))  # the residual is exactly what was not sent
        sent += deq.double()
        inputs += flat_of(ts).double()
        tol += U * x.abs().max().item() + eps * (x - deq).abs().max().item()
    final = res["torch"].double().cpu()
    assert (sent - (inputs - final)).abs().max() <= tol
    check_bound(x, deq, 300, block, r)  # and the residual stays within one step's block error


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_dequantize_sum_is_the_fp32_sum_of_the_chunks(device, backend, r):
    """r ranks quantize their own flats; rank j receives chunk j of each (the all-to-all, simulated by
    stacking rows); dequantize_sum == the fp32 sum, in rank order, of the chunks dequantized one by one.
    Then the reduced chunks are re-quantized and all-gathered (stacked) and dequantized: the all-reduce."""
    gen, block, n = torch.Generator().manual_seed(r), 16, 203
    flats = [(torch.randn(n, generator=gen) * 4).to(device) for _ in range(r)]
    wires = [tk.quantize([f], block, num_chunks=r, backend=backend).wire for f in flats]
    c, _ = layout_of(n, block, r)
    parts = []
    for j in range(r):
        recv = torch.stack([w[j] for w in wires])
        got = tk.dequantize_sum(recv, r, block, backend=backend)
        want = torch.zeros(c)
        for w in wires:
            want += ref_dequant(w, n, block, r).view(r, c)[j]
        assert_bits(got, want.to(device))
        other = tk.dequantize_sum(recv, r, block, backend="torch" if backend == "triton" else "triton")
        assert_bits(got, other)
        parts.append(tk.quantize([got], block, backend=backend).wire)
    gathered = torch.cat(parts)
    total = tk.dequantize(gathered, [torch.empty(n, device=device)], block, num_chunks=r, backend=backend)[0]
    exact = sum(f.double().cpu() for f in flats)
    bound = sum(f.abs().max().double().cpu() for f in flats) * (2 / 254 + 4 * r * U)  # two quantizations
    assert (total.double().cpu() - exact).abs().max() <= bound


@pytest.mark.triton
def test_one_launch_per_bucket(device, monkeypatch):
    from lightning_mics_kernels import quant_pack, quant_unpack

    calls = []
    for mod, name in ((quant_pack, "quantize_kernel"), (quant_unpack, "dequantize_kernel"),
                      (quant_unpack, "dequantize_sum_kernel")):
        kernel = getattr(mod, name)
        run = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _run=run, _n=name, **kw: (calls.append(_n), _run(*a, **kw))[1])
    gen = torch.Generator().manual_seed(1)
    ts = bucket(gen, device, sizes=[(int(torch.randint(1, 90, (), generator=gen)),) for _ in range(100)])
    n = sum(t.numel() for t in ts)
    res = torch.zeros(n, device=device)
    for b in ("torch", "triton"):
        calls.clear()
        got = tk.quantize(ts, 64, num_chunks=2, residual=res, backend=b)
        tk.dequantize(got.wire, [torch.empty_like(t) for t in ts], 64, num_chunks=2, backend=b)
        tk.dequantize_sum(got.wire, 2, 64, backend=b)
        assert calls == ([] if b == "torch" else ["quantize_kernel", "dequantize_kernel", "dequantize_sum_kernel"])


# --- edges and errors --------------------------------------------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_edges_and_out_buffers(device, backend):
    empty = tk.quantize([], 8, num_chunks=3, backend=backend)
    assert empty.wire.shape == (3, 0) and empty.q.shape == (3, 0) and empty.scales.shape == (3, 0)
    assert tk.dequantize(empty.wire, [], 8, num_chunks=3, backend=backend) == []
    assert tk.dequantize_sum(empty.wire, 3, 8, backend=backend).shape == (0,)
    x = torch.randn(50, device=device)
    out = torch.empty(tk.quant_layout(50, 8, 2).row_bytes * 2, dtype=torch.uint8, device=device)
    got = tk.quantize([x], 8, num_chunks=2, out=out, backend=backend)
    assert got.wire.data_ptr() == out.data_ptr() and torch.equal(got.wire.cpu(), ref_wire(x, 8, 2))
    acc = torch.empty(tk.quant_layout(50, 8, 2).chunk, device=device)
    assert tk.dequantize_sum(got.wire, 2, 8, out=acc, backend=backend) is acc
    grad = torch.randn(5, device=device, requires_grad=True)
    assert not tk.quantize([grad], 4, backend=backend).wire.requires_grad


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_value_errors(backend):
    x = torch.randn(10)
    w = tk.quantize([x], 4, backend="torch").wire
    kw = dict(backend=backend)
    cases = {
        r"block_size=0 must be an int in \[1, 65536\]": lambda: tk.quantize([x], 0, **kw),
        "block_size=1.5": lambda: tk.quantize([x], 1.5, **kw),
        "block_size=True": lambda: tk.dequantize(w, [x], True, **kw),
        "block_size=65537": lambda: tk.dequantize_sum(w, 1, 65537, **kw),
        "num_chunks=0": lambda: tk.quantize([x], 4, num_chunks=0, **kw),
        "size mismatch: residual": lambda: tk.quantize([x], 4, residual=torch.zeros(9), **kw),
        "residual has dtype torch.float64": lambda: tk.quantize([x], 4, residual=torch.zeros(10).double(), **kw),
        "tensors\\[0\\] has dtype torch.int64": lambda: tk.quantize([x.long()], 4, **kw),
        "out has dtype torch.int8": lambda: tk.quantize([x], 4, out=w.view(torch.int8), **kw),
        "size mismatch: out has 20 bytes": lambda: tk.quantize([x], 4, out=torch.empty(20, dtype=torch.uint8), **kw),
        "4-byte boundary": lambda: tk.quantize([x], 4, out=torch.empty(w.numel() + 1, dtype=torch.uint8)[1:], **kw),
        "size mismatch: wire": lambda: tk.dequantize(w, [torch.empty(13)], 4, **kw),  # 10 to 12 share a layout
        "rows of 23 bytes are not a quantized chunk": lambda: tk.dequantize_sum(w.view(-1)[:23], 1, 4, **kw),
        "not a multiple of num_chunks=5": lambda: tk.dequantize_sum(w, 5, 4, **kw),
        "out must be a float32": lambda: tk.dequantize_sum(w, 1, 4, out=torch.empty(12).half(), **kw),
        "size mismatch: out": lambda: tk.dequantize_sum(w, 1, 4, out=torch.empty(11), **kw),
        "mixed devices": lambda: tk.quantize([x, torch.empty(3, device="meta")], 4, **kw),
        "backend=": lambda: tk.quantize([x], 4, backend="cuda"),
    }
    for pattern, call in cases.items():
        with pytest.raises(ValueError, match=pattern):
            call()


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.language as tl
from lightning_mics_kernels.quant_pack import quantize_kernel
from lightning_mics_kernels.quant_unpack import dequantize_kernel, dequantize_sum_kernel
i64, i32 = "i64", "i32"
T = dict(table="*i64", rel="*i64", first_ptr=i64)  # the tensor table and the addresses ([Note: descriptor tables])
cases = [
    (quantize_kernel, dict(**T, n_rows=i64, residual="*bf16", wire="*u8", n=i64, chunk=i64, nblocks=i64,
                           row_bytes=i64, block_size=i32), dict(SRC=tl.float32, MIXED=True, HAS_RES=True,
                           LOG_ROWS=7, BLOCK=2048)),
    (quantize_kernel, dict(**T, n_rows=i64, residual="*u8", wire="*u8", n=i64, chunk=i64, nblocks=i64,
                           row_bytes=i64, block_size=i32), dict(SRC=tl.bfloat16, MIXED=False, HAS_RES=False,
                           LOG_ROWS=1, BLOCK=4096)),
    (quantize_kernel, dict(**T, residual="*fp32", wire="*u8", chunk=i64, nblocks=i64, row_bytes=i64),
     dict(n_rows=1, n=1, block_size=1, SRC=tl.float16, MIXED=False, HAS_RES=True, LOG_ROWS=1, BLOCK=16)),
    (dequantize_sum_kernel, dict(wire="*u8", out="*fp32", chunk=i64, nblocks=i64, row_bytes=i64),
     dict(num_chunks=1, block_size=1, BLOCK=16)),  # ints equal to 1 arrive as constants (Triton specializes them)
    (dequantize_kernel, dict(**T, n_rows=i64, wire="*u8", n=i64, chunk=i64, nblocks=i64, row_bytes=i64,
                             block_size=i32), dict(DST=tl.bfloat16, MIXED=True, LOG_ROWS=7, BLOCK=4096)),
    (dequantize_kernel, dict(**T, wire="*u8", chunk=i64, nblocks=i64, row_bytes=i64),
     dict(n_rows=1, n=1, block_size=1, DST=tl.float32, MIXED=False, LOG_ROWS=1, BLOCK=16)),
    (dequantize_sum_kernel, dict(wire="*u8", out="*fp32", num_chunks=i32, chunk=i64, nblocks=i64, row_bytes=i64,
                                 block_size=i32), dict(BLOCK=2048)),
]
for k, sig, const in cases:
    src = ASTSource(fn=k, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
print("ok")
"""


@pytest.mark.triton
def test_quant_kernels_compile_for_sm90():
    """The interpreter never compiles; lower every kernel variant to PTX for an H100 (no GPU needed)."""
    pytest.importorskip("triton")
    import importlib.util

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here")
    nvidia = Path(list(importlib.util.find_spec("triton.backends.nvidia").submodule_search_locations)[0])
    if not (os.environ.get("TRITON_PTXAS_PATH") or (nvidia / "bin" / "ptxas").exists() or shutil.which("ptxas")):
        pytest.skip("no ptxas to assemble the PTX (triton's NVIDIA backend ships one in bin/)")  # else: a failure
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
