"""The Triton kernels' descriptor tables ([Note: descriptor tables] in triton_kernels/_table.py): built once per
bucket shape and never again after warm-up, however many buckets there are and whatever the allocator does to
the buffers; and `kernels="auto"`'s size rule ([Note: auto's size rule] in triton_kernels/_backend.py).

    python -m pytest -q tests/kernels/test_kernel_tables.py
"""

import math

import pytest
import torch

import lightning_mics_kernels as tk
from tests.helpers.launch import REPO, run_ranks
from lightning_mics_kernels import _backend, _table

SCRIPT = REPO / "tests" / "kernels" / "kernel_tables.py"


@pytest.fixture
def interpreted():
    """The kernels interpreted on CPU; the ranks forked for the engine's case inherit the interpreter from here."""
    pytest.importorskip("triton")
    if not _backend.kernels_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it)")


class FakeUnit:
    """What the engine hands the kernels for one unit, allocated as the engine allocates it: a flat shard that
    stays, full parameters as views of one storage that is freed and allocated again at every gather, and
    gathered buffers, gradients and reduce-scatter outputs that are new at every call."""

    def __init__(self, i: int, s: int, gen: torch.Generator) -> None:
        self.shapes = [(3 + i, 2 + i % 3), (3 + i,), ()]  # distinct per unit: no two units share a table
        self.s = s
        self.numels = [math.prod(sh) for sh in self.shapes]
        self.rows = [-(-(sh[0] if sh else 1) // s) * (n // (sh[0] if sh else 1)) for sh, n in zip(self.shapes,
                                                                                                   self.numels)]
        self.shard = torch.randn(sum(self.rows), generator=gen)
        self.full_flat = torch.empty(sum(self.numels), dtype=torch.bfloat16)
        starts = [0, *torch.tensor(self.numels).cumsum(0).tolist()]
        self.views = [self.full_flat[a:a + n].view(sh) for a, n, sh in zip(starts, self.numels, self.shapes)]

    def step(self, backend: str, gen: torch.Generator):
        """One step's copies, as unit.py / collectives.py / quantized.py make them; returns what they wrote."""
        send = tk.flatten([self.shard], dtype=torch.bfloat16, backend=backend)  # the gather's cast
        gathered = torch.cat([send] * self.s).view(self.s, -1)  # a new all-gather output
        self.full_flat.untyped_storage().resize_(0)  # released, then gathered again: new storage
        self.full_flat.untyped_storage().resize_(self.full_flat.numel() * 2)
        tk.chunk_split(gathered, self.views, self.s, backend=backend)  # copy_out
        grads = [torch.randn(sh, generator=gen).bfloat16() for sh in self.shapes]  # autograd's, new
        staging = torch.empty(self.s, sum(self.rows))
        rs = tk.chunk_cat(grads, self.s, out=staging, dtype=torch.float32, backend=backend)
        wire = tk.quantize([rs.view(-1)[1:]], 16, num_chunks=self.s, backend=backend).wire  # a slice: new pointer
        outs = [torch.empty(n) for n in (3, rs.numel() - 4)]
        tk.dequantize(wire, outs, 16, num_chunks=self.s, backend=backend)
        return [send, self.full_flat.clone(), rs.clone(), wire, *outs]


@pytest.mark.triton
def test_engine_shaped_calls_build_no_table_after_the_first_step(interpreted):
    """70 units (more distinct buckets than the 64 tables the cache used to hold), every buffer as the engine
    allocates it: the first step builds each table once; the next builds none and sends pointers only for
    the gradients (not views of one storage), without a host sync on a GPU; results equal the torch fallback."""
    gen = torch.Generator().manual_seed(0)
    units = [FakeUnit(i, 2, gen) for i in range(70)]
    tk.reset_table_stats(clear=True)
    for step in range(2):  # the first step builds every table, the second (new storage, new buffers) none
        before = tk.table_stats()
        gt, gr = torch.Generator().manual_seed(step), torch.Generator().manual_seed(step)
        for u in units:
            got, want = u.step("triton", gt), u.step("torch", gr)
            for a, b in zip(got, want):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        after = tk.table_stats()
        builds, copies = after.builds - before.builds, after.pointer_copies - before.pointer_copies
        if step == 0:
            # per unit: 3 geometries (chunk_split / chunk_cat share none: different dtypes) + 2 quantize tables,
            # plus the shared offsets of one tensor and each unit's views; some units' geometries coincide
            assert 140 <= builds <= 6 * 70 + 1, builds
        else:
            assert builds == 0, (step, builds)
        assert copies == 2 * 70, copies  # the gradients' chunk_cat and dequantize's two new outputs, per unit
    assert after.cached == len(_table._CACHE) > 64


@pytest.mark.triton
def test_views_of_one_storage_send_no_pointers(interpreted):
    flat = torch.zeros(1000)
    views = [flat[:300].view(100, 3), flat[300:301], flat[301:1000]]
    src = torch.randn(1000)
    tk.scatter(src, views, backend="triton")  # builds the geometry and the views' offsets
    before = tk.table_stats()
    for _ in range(3):
        flat.untyped_storage().resize_(0)
        flat.untyped_storage().resize_(4000)  # new storage, same views
        tk.scatter(src, views, backend="triton")
        assert torch.equal(flat, src)
    after = tk.table_stats()
    assert (after.builds, after.pointer_copies) == (before.builds, before.pointer_copies)
    assert after.lookups - before.lookups == 6  # a geometry and the offsets per call


@pytest.mark.triton
def test_cache_is_bounded_and_counts_rebuilds(interpreted, monkeypatch):
    monkeypatch.setattr(_table, "MAX_ENTRIES", 3)
    tk.reset_table_stats(clear=True)
    ts = [[torch.randn(10 + i)] for i in range(5)]
    for t in ts:
        tk.flatten(t, backend="triton")  # five geometries (one shared single-tensor offset)
    assert tk.table_stats().cached == 3
    builds = tk.table_stats().builds
    tk.flatten(ts[0], backend="triton")  # evicted: built again, and counted
    assert tk.table_stats().builds == builds + 1
    monkeypatch.setattr(_table, "MAX_ELEMENTS", 1)  # a limit below one table still keeps the newest
    tk.flatten(ts[1], backend="triton")
    assert tk.table_stats().cached == 1
    tk.reset_table_stats(clear=True)
    assert tk.table_stats() == (0, 0, 0, 0)


def test_auto_takes_torch_below_the_size_rule(monkeypatch):
    """[Note: auto's size rule]: on CUDA, Triton from AUTO_MIN_NUMEL buffer elements (chunk_split with a cast at
    any size), torch below; checked on CPU by pretending the device is CUDA and recording the choice."""
    monkeypatch.setattr(_backend, "_TRITON_FOUND", True)
    monkeypatch.setattr(_backend, "_INTERPRETED", False)
    cuda, n = torch.device("cuda"), tk.AUTO_MIN_NUMEL
    assert not _backend.use_triton("auto", cuda, n - 1) and _backend.use_triton("auto", cuda, n)
    assert _backend.use_triton("auto", cuda, None) and _backend.use_triton("triton", cuda, 1)
    assert not _backend.use_triton("auto", torch.device("cpu"), n) and not _backend.use_triton("torch", cuda, n)
    import lightning_mics_kernels.api as api

    asked = []
    monkeypatch.setattr(api, "use_triton", lambda backend, device, numel=None: asked.append(numel) or False)
    ts = [torch.randn(5, 3), torch.randn(7)]
    buf = tk.chunk_cat(ts, 2)
    tk.flatten(ts)
    tk.scatter(torch.randn(22), ts)
    tk.chunk_split(buf, ts, 2)
    tk.chunk_split(buf, [t.bfloat16() for t in ts], 2)  # a cast: Triton's at any size
    assert asked == [2 * (9 + 4), 22, 22, 2 * (9 + 4), None]  # padded: rows of ceil(5 / 2) and ceil(7 / 2)


@pytest.mark.triton
@pytest.mark.parametrize("int8", [False, True], ids=["copies", "int8-gather"])
def test_engine_builds_no_table_after_warm_up(interpreted, tmp_path, int8):
    """The real engine (Fabric, s = 2, bf16-mixed, units of distinct shapes) with kernels="triton": the tables are
    built in the first step (int8: one more in the second, the first that follows an optimizer step: the round
    trip of the last unit's shard), none after; the parameters equal those of kernels="torch" bit for bit."""
    units, warm_up = (20, 2) if int8 else (40, 1)
    args = ["--units", str(units), "--steps", str(warm_up + 1)] + (["--int8"] if int8 else [])
    (tmp_path / "triton").mkdir()
    (tmp_path / "torch").mkdir()
    res = run_ranks(SCRIPT, 2, args, tmp_path / "triton", extra_env={"TRITON_INTERPRET": "1"})
    ref = run_ranks(SCRIPT, 2, [*args, "--kernels", "torch"], tmp_path / "torch")
    for r, want in zip(res, ref):
        assert r["units"] == units + 1  # the blocks and the root
        steps = r["steps"]
        assert sum(s["builds"] for s in steps[:warm_up]) > 64  # more distinct tables than the old cache held ...
        assert all(s["builds"] == 0 and s["lookups"] > 64 for s in steps[warm_up:]), steps  # ... none after
        if not int8:  # pointers sent per call only for the gradients' chunk_cat: one bucket per block
            assert all(s["pointer_copies"] == units for s in steps), steps
        assert r["params"] == want["params"]
        assert all(s["lookups"] == 0 for s in want["steps"])
