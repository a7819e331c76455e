"""triton_kernels: the Triton path (interpreted on CPU, compiled on a GPU) against the torch fallback and
against plain-torch references (torch.cat / torch.split / torch._chunk_cat / torch.chunk), bit for bit.

"Bit-exact" here: equal shapes and dtypes, the same NaN positions, and identical bits everywhere else
(NaN payloads differ between torch's own CPU and CUDA conversions, so they are not compared).

    python -m pytest -q tests/kernels/test_triton_kernels.py
"""

import importlib.util
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
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module")
def device():
    """CPU under TRITON_INTERPRET=1 (conftest sets it); CUDA when the kernels are compiled for a GPU."""
    pytest.importorskip("triton")
    from lightning_mics_kernels._backend import kernels_interpreted

    if kernels_interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("Triton kernels are compiled (TRITON_INTERPRET unset) and there is no GPU")


def assert_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    a, b = a.reshape(-1).cpu(), b.reshape(-1).cpu()
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), "NaN positions differ"
    assert torch.equal(a[~nan].view(INT_OF[a.dtype]), b[~nan].view(INT_OF[b.dtype]))


def ref_flatten(ts, dtype):
    return torch.cat([t.reshape(-1).to(dtype) for t in ts]) if ts else torch.empty(0, dtype=dtype)


def ref_chunk_cat(ts, n, dtype):
    """From torch.chunk and zero padding, independent of the code under test."""
    rows = [[torch.empty(0, dtype=dtype)] for _ in range(n)]
    for t in ts:
        t = t.reshape(1) if t.dim() == 0 else t
        rest = t[0].numel() if t.shape[0] else 0
        c = -(-t.shape[0] // n)
        chunks = torch.chunk(t, n) if t.shape[0] else ()
        for j in range(n):
            piece = chunks[j].reshape(-1).to(dtype) if j < len(chunks) else torch.empty(0, dtype=dtype)
            rows[j] += [piece, torch.zeros(c * rest - piece.numel(), dtype=dtype)]
    return torch.stack([torch.cat(r) for r in rows])


def rand_tensors(n, dtypes, gen, device="cpu", max_rows=40):
    ts = []
    for i in range(n):
        kind = int(torch.randint(0, 6, (), generator=gen))
        dtype = dtypes[int(torch.randint(0, len(dtypes), (), generator=gen))]
        rows = int(torch.randint(0, max_rows, (), generator=gen))
        shape = [(), (1,), (0,), (rows,), (rows, 3), (17, rows, 2)][kind]
        ts.append(torch.randn(shape, generator=gen).mul(100).to(dtype).to(device))
    return ts


def odd_tensors(device, dtype=torch.float32):
    shapes = [(17,), (257,), (297, 3), (), (1,), (0,), (0, 5), (5, 0), (3, 1, 2), (4100,)]
    return [torch.randn(s).to(dtype).to(device) for s in shapes]


# --- the package itself ------------------------------------------------------------------------------


def test_import_is_ours():
    # Installed as lightning_mics_kernels (the folder is triton_kernels/): this must be the repository's.
    assert Path(tk.__file__).resolve().is_relative_to(REPO)


def test_import_and_fallback_without_triton():
    code = """
import sys
import torch, lightning_mics_kernels as tk
assert "triton" not in sys.modules, "importing lightning_mics_kernels must not import triton"
sys.modules["triton"] = None  # from here on, as if triton were not installed
assert not tk.triton_available()
ts = [torch.randn(5), torch.randn(3, 2)]
assert torch.equal(tk.flatten(ts), torch.cat([t.reshape(-1) for t in ts]))
try:
    tk.flatten(ts, backend="triton")
except RuntimeError as e:
    assert "triton" in str(e)
else:
    raise AssertionError("backend='triton' without triton must fail")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


KERNEL_MODULES = {"pack", "unpack", "quant_pack", "quant_unpack"}  # define @triton.jit kernels (+ their launchers)


def test_module_imports_one_way():
    """The checks and the backend choice import no kernel module; no kernel module imports another;
    only the public api modules reach the kernels (lazily, once the backend is chosen)."""
    import ast

    pkg = REPO / "triton_kernels"
    for path in pkg.glob("*.py"):
        tree = ast.parse(path.read_text())
        defines_kernel = any(isinstance(d, ast.Attribute) and d.attr == "jit" for node in ast.walk(tree)
                             if isinstance(node, ast.FunctionDef) for d in node.decorator_list)
        assert defines_kernel == (path.stem in KERNEL_MODULES) or path.stem == "_copy", path.name
        imported = {(node.module or "").lstrip(".") for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 1}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
                     and not node.module for alias in node.names}
        if "api" not in path.stem:
            assert not imported & KERNEL_MODULES, f"{path.name} imports kernel modules {imported & KERNEL_MODULES}"


# --- agreement with references and between backends ---------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("n", [1, 10, 100])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 8])
def test_random_chunk_cat_split(device, n, num_chunks):
    gen = torch.Generator().manual_seed(1000 * n + num_chunks)
    ts = rand_tensors(n, DTYPES if n > 1 else (torch.float32,), gen, device)
    for dtype in DTYPES if n == 10 else (torch.float32, torch.bfloat16):
        want = ref_chunk_cat([t.cpu() for t in ts], num_chunks, dtype)
        got = {b: tk.chunk_cat(ts, num_chunks, dtype=dtype, backend=b) for b in BACKENDS}
        for b in BACKENDS:
            assert_bits(got[b], want)
        outs = {b: [torch.full_like(t, 7) for t in ts] for b in BACKENDS}
        for b in BACKENDS:
            tk.chunk_split(got["triton"], outs[b], num_chunks, backend=b)
        for t, o_tr, o_to in zip(ts, outs["triton"], outs["torch"]):
            assert_bits(o_tr, o_to)
            assert_bits(o_tr, t.to(dtype).to(t.dtype))  # round trip through the buffer's dtype


@pytest.mark.triton
@pytest.mark.parametrize("n", [1, 10, 100])
def test_random_flatten_scatter(device, n):
    gen = torch.Generator().manual_seed(n)
    ts = rand_tensors(n, DTYPES, gen, device)
    for dtype in DTYPES:
        want = ref_flatten([t.cpu() for t in ts], dtype)
        flats = {b: tk.flatten(ts, dtype=dtype, backend=b) for b in BACKENDS}
        for b in BACKENDS:
            assert_bits(flats[b], want)
        sizes = [t.numel() for t in ts]
        for b in BACKENDS:
            outs = [torch.empty_like(t) for t in ts]
            assert tk.scatter(flats[b], outs, backend=b) is outs
            for o, piece, t in zip(outs, torch.split(want, sizes), ts):
                assert_bits(o, piece.view(t.shape).to(t.dtype).to(device))


@pytest.mark.triton
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_same_dtype_matches_torch_chunk_cat(device, num_chunks):
    for dtype in DTYPES:
        ts = odd_tensors(device, dtype)
        keep = [t.reshape(-1) if t.dim() == 0 else t for t in ts if t.numel()]
        for out_dtype in DTYPES:
            want = torch._chunk_cat(keep, 0, num_chunks, out=torch.empty(0, dtype=out_dtype, device=device))
            for b in BACKENDS:
                got = tk.chunk_cat(ts, num_chunks, dtype=out_dtype, backend=b)
                assert_bits(got, want)
                if out_dtype == dtype:  # round trip, the fallback's split_with_sizes_copy path
                    outs = [torch.empty_like(t) for t in ts]
                    for o, t in zip(tk.chunk_split(got, outs, num_chunks, backend=b), ts):
                        assert_bits(o, t)
            if num_chunks == 1:
                want = torch.cat([t.view(-1) for t in keep]).to(out_dtype)
                assert_bits(tk.flatten(ts, dtype=out_dtype, backend="triton"), want)


@pytest.mark.triton
def test_large_blocks_aligned_and_unaligned(device):
    # > BLOCK (4096) elements: the unmasked, vectorized path (aligned) and the masked one (not aligned).
    base = torch.randn(3 * 8192 + 64, device=device)
    aligned = [base[:8192].view(2, 4096), base[8192:16384 + 40]]  # second: 8232 elements, offset 8192
    unaligned = [base[1:4098], base[16385:16385 + 4103]]  # odd data_ptr, odd sizes
    mixed = [aligned[0].bfloat16(), aligned[1], unaligned[0].half()]
    for ts in (aligned, unaligned, aligned + unaligned, mixed):
        for nc in (1, 2, 3):
            want = ref_chunk_cat([t.cpu() for t in ts], nc, torch.bfloat16)
            got = tk.chunk_cat(ts, nc, dtype=torch.bfloat16, backend="triton")
            assert_bits(got, want)
            outs = [torch.empty_like(t) for t in ts]
            tk.chunk_split(tk.chunk_cat(ts, nc, dtype=torch.float32, backend="triton"), outs, nc, backend="triton")
            for o, t in zip(outs, ts):
                assert_bits(o, t)
    flat = torch.empty(8192 + 3, device=device)[3:]  # unaligned out
    assert_bits(tk.flatten(aligned[:1], out=flat, backend="triton"), aligned[0].reshape(-1))


def test_aligned_flags_are_sound():
    """A tensor is marked ALIGNED (unmasked 128-bit accesses on a GPU) only if every one of its chunk
    starts is 16-byte aligned on both sides; the interpreter ignores alignment, so check it here."""
    from lightning_mics_kernels._checks import make_layout
    from lightning_mics_kernels._table import ALIGNED, MAX_ENTRIES, _CACHE, addresses, descriptors

    base, n_fast = torch.empty(1 << 16), 0
    cases = [[base[:64], base[64:81], base[96:96 + 257]], [base[4:20].view(4, 4), base[1:9]],
             [base[:8].bfloat16(), base[:16].view(8, 2).half(), base[32:33]], [base[:0], base[:4]]]
    for ts in cases:
        for nc in (1, 2, 3, 4):
            layout = make_layout(ts, nc)
            for dtype in DTYPES:
                for shift in (0, 1, 8):
                    buf = torch.empty(nc * layout.total + shift, dtype=dtype)[shift:]
                    ptrs = [t.data_ptr() for t in ts]
                    table = descriptors(ts, layout, buf, ptrs).table
                    rel, first_ptr = addresses(ts, ptrs, buf.device)
                    for t, row, r, seg, off in zip(ts, table.tolist(), rel.tolist(), layout.segs, layout.offsets):
                        sound = all((t.data_ptr() + j * seg * t.element_size()) % 16 == 0
                                    and (buf.data_ptr() + (j * layout.total + off) * buf.element_size()) % 16 == 0
                                    for j in range(nc))
                        assert first_ptr + r == t.data_ptr() and row[:3] == [t.numel(), seg, off]
                        assert not (row[4] & ALIGNED) or sound, (t.shape, nc, dtype, shift)
                        n_fast += bool(row[4] & ALIGNED)
    assert n_fast > 0  # and the fast path is not simply switched off
    assert _CACHE  # tables are cached ...
    assert len(_CACHE) <= MAX_ENTRIES  # ... in a bounded LRU


# --- casts, bit for bit -------------------------------------------------------------------------------

SPECIAL_F32_BITS = [
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # exact ties: to even down, to even up (both signs)
    0x3F808001, 0x3F807FFF, 0x7F7F8000, 0x7F7FFFFF,  # just above/below a tie; ties and near-max that overflow to inf
    0xFF7F8000, 0x00008000, 0x00018000, 0x80008000,  # -overflow; subnormal ties
    0x00000001, 0x80000000, 0x00000000, 0x7F800000,  # tiny subnormal, -0, +0, +inf
    0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,  # -inf, qNaN, -qNaN, sNaN (rounding it naively gives inf)
    0x7FFFFFFF, 0xFFFFFFFF, 0x387FE000, 0x47800000,  # NaNs; fp16 subnormal/overflow edges
]


def special_f32(device):
    bits = torch.tensor(SPECIAL_F32_BITS, dtype=torch.int64).to(torch.int32)  # wraps to int32 bit patterns
    rnd = torch.randint(-2**31, 2**31 - 1, (20000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    return torch.cat([bits, rnd]).view(torch.float32).to(device)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                     (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                     (torch.bfloat16, torch.float16), (torch.float16, torch.float32)])
def test_casts_match_torch(device, src, dst):
    x = special_f32(device)
    if src != torch.float32:  # the top halves: bf16's inf/NaN/ties, random 16-bit patterns
        x = (x.view(torch.int32) >> 16).to(torch.int16).view(src)
    parts = [x[:24], x[24:4121], x[4121:]]  # a small one, and ones with full (unmasked) blocks
    want = torch.cat([p.to(dst) for p in parts])
    for b in BACKENDS:
        assert_bits(tk.flatten(parts, dtype=dst, backend=b), want)
        outs = [torch.empty(p.shape, dtype=dst, device=device) for p in parts]
        tk.scatter(x, outs, backend=b)
        assert_bits(torch.cat(outs), want)


# --- edge cases and the out= contract -----------------------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_edges(device, backend):
    assert tk.flatten([], backend=backend).shape == (0,)
    assert tk.flatten([], dtype=torch.bfloat16, backend=backend).dtype == torch.bfloat16
    assert tk.chunk_cat([], 4, backend=backend).shape == (4, 0)
    assert tk.scatter(torch.empty(0, device=device), [], backend=backend) == []
    assert tk.chunk_split(torch.empty(4, 0, device=device), [], 4, backend=backend) == []
    zero = [torch.empty(0, device=device), torch.empty(0, 3, device=device), torch.empty(3, 0, device=device)]
    assert tk.flatten(zero, backend=backend).shape == (0,)
    assert tk.chunk_cat(zero, 2, backend=backend).shape == (2, 0)
    one = [torch.tensor(3.5, device=device)]
    assert_bits(tk.flatten(one, backend=backend), torch.tensor([3.5]))
    assert_bits(tk.chunk_cat(one, 3, backend=backend), torch.tensor([[3.5], [0.0], [0.0]]))
    out = [torch.empty((), device=device)]
    tk.chunk_split(torch.tensor([[1.0], [0.0], [0.0]], device=device), out, 3, backend=backend)
    assert out[0].item() == 1.0
    grad = torch.randn(5, device=device, requires_grad=True)
    assert not tk.flatten([grad], backend=backend).requires_grad


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffers(device, backend):
    ts = odd_tensors(device)
    total = sum(t.numel() for t in ts)
    out = torch.empty(total, dtype=torch.bfloat16, device=device)
    assert tk.flatten(ts, out=out, backend=backend) is out  # dtype comes from out
    assert_bits(out, ref_flatten([t.cpu() for t in ts], torch.bfloat16))
    want = ref_chunk_cat([t.cpu() for t in ts], 4, torch.float16)
    for shape in ((want.numel(),), tuple(want.shape)):
        buf = torch.empty(shape, dtype=torch.float16, device=device)
        assert tk.chunk_cat(ts, 4, out=buf, dtype=torch.float16, backend=backend) is buf
        assert_bits(buf.view(want.shape), want)
        outs = [torch.empty_like(t) for t in ts]
        tk.chunk_split(buf, outs, 4, backend=backend)
        for o, t in zip(outs, ts):
            assert_bits(o, t.half().float())


@pytest.mark.triton
def test_table_cache_sees_new_values(device):
    ts = [torch.randn(300, device=device), torch.randn(17, device=device)]
    first = tk.flatten(ts, backend="triton")
    ts[0].add_(1)
    second = tk.flatten(ts, backend="triton")  # same pointers: cached table, fresh data
    assert_bits(second, torch.cat([t.reshape(-1) for t in ts]))
    assert not torch.equal(first, second)


# --- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["cuda", "Triton", None, 1])
def test_bad_backend(bad):
    with pytest.raises(ValueError, match=r"backend=.*'auto', 'triton', 'torch'") as e:
        tk.flatten([torch.randn(3)], backend=bad)
    assert repr(bad) in str(e.value)
    for call in (lambda: tk.scatter(torch.randn(3), [torch.empty(3)], backend=bad),
                 lambda: tk.chunk_cat([torch.randn(3)], 2, backend=bad),
                 lambda: tk.chunk_split(torch.randn(2, 2), [torch.empty(3)], 2, backend=bad)):
        with pytest.raises(ValueError, match="backend"):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_errors(backend):
    x, y = torch.randn(4, 6), torch.randn(5)
    kw = dict(backend=backend)
    cases = {
        "not contiguous": lambda: tk.flatten([x.t()], **kw),
        "out .*not contiguous": lambda: tk.flatten([x], out=torch.empty(48)[::2], **kw),
        "outs.*not contiguous": lambda: tk.scatter(torch.randn(24), [x.t()], **kw),
        "size mismatch: out": lambda: tk.flatten([x, y], out=torch.empty(28), **kw),
        "size mismatch: flat": lambda: tk.scatter(torch.randn(30), [x, y], **kw),
        "size mismatch: out.*\\(2, 15\\)": lambda: tk.chunk_cat([x, y], 2, out=torch.empty(3, 10), **kw),
        "size mismatch: flat.*\\(2, 15\\)": lambda: tk.chunk_split(torch.randn(3, 10), [x, y], 2, **kw),
        "mixed devices": lambda: tk.flatten([x, torch.empty(3, device="meta")], **kw),
        "out is on meta.*mixed devices": lambda: tk.flatten([x], out=torch.empty(24, device="meta"), **kw),
        "tensors\\[1\\] has dtype torch.float64": lambda: tk.flatten([x, y.double()], **kw),
        "dtype=torch.int32 is not supported": lambda: tk.flatten([x], dtype=torch.int32, **kw),
        "out has dtype torch.float64": lambda: tk.chunk_cat([x], 2, out=torch.empty(24).double(), **kw),
        "outs\\[0\\] has dtype torch.int64": lambda: tk.scatter(torch.randn(3), [torch.empty(3).long()], **kw),
        "dtype=torch.float16 disagrees": lambda: tk.flatten([x], out=torch.empty(24), dtype=torch.float16, **kw),
        "num_chunks=0": lambda: tk.chunk_cat([x], 0, **kw),
        "num_chunks=2.0": lambda: tk.chunk_split(torch.randn(24), [x], 2.0, **kw),
    }
    for pattern, call in cases.items():
        with pytest.raises(ValueError, match=pattern):
            call()
    with pytest.raises(TypeError):
        tk.flatten(x, backend=backend)  # a tensor, not a list of tensors


# --- the compiled (GPU) path, checked without a GPU ---------------------------------------------------

COMPILE = """
import re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lightning_mics_kernels.pack import pack_kernel
from lightning_mics_kernels.unpack import unpack_kernel
import torch, lightning_mics_kernels as tk
try:
    tk.flatten([torch.randn(3)], backend="triton")
except RuntimeError as e:
    assert "TRITON_INTERPRET" in str(e)
else:
    raise AssertionError("backend='triton' on CPU without the interpreter must fail")
for k, buf, t, mixed in [(pack_kernel, "*bf16", tl.float32, False), (unpack_kernel, "*fp32", tl.float16, True)]:
    names = k.arg_names
    sig = {"table": "*i64", "block_map": "*i64", "rel": "*i64", "first_ptr": "i64", "buf": buf, "total": "i64",
           names[6]: "constexpr", "MIXED": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn=k, signature=sig, constexprs={names[6]: t, "MIXED": mixed, "BLOCK": 4096},
                    attrs={(4,): [["tt.divisibility", 16]]})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert re.search(r"ld\\.global\\.v4\\.b32", ptx) and re.search(r"st\\.global\\.v4\\.b32", ptx), ptx[-3000:]
print("ok")
"""


@pytest.mark.triton
def test_compiles_for_sm90_with_vector_accesses():
    """The interpreter never compiles; this lowers two kernel variants to PTX for an H100 (no GPU
    needed) and checks that full blocks use 128-bit loads and stores."""
    pytest.importorskip("triton")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here")
    nvidia = Path(list(importlib.util.find_spec("triton.backends.nvidia").submodule_search_locations)[0])
    if not (os.environ.get("TRITON_PTXAS_PATH") or (nvidia / "bin" / "ptxas").exists() or shutil.which("ptxas")):
        pytest.skip("no ptxas to assemble the PTX (triton's NVIDIA backend ships one in bin/)")  # else: a failure
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
