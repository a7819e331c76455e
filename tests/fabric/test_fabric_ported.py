"""Lightning's own Fabric sharded-strategy tests with MiCSStrategy in FSDP's / ModelParallel's place.

Ported from Lightning 2.6's ``tests/tests_fabric/strategies/test_fsdp_integration.py`` and
``test_model_parallel_integration.py`` to CPU with 2 ranks, keeping their assertions (they run inside the ranks:
``tests/fabric/fabric_ported.py``; one launch runs every case). Where the original only smoke-tests a step, the
case also trains one plain process on the same global batches and the test bounds the difference; those cases
also run under Lightning's DDP (one more launch, the same seed and data), and the parameters after the steps are
compared with DDP's.
"""

import pytest
import torch

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "fabric" / "fabric_ported.py"
PRECISIONS = ["32-true", "bf16-mixed"]  # Fabric runs "16-mixed" as bf16 AMP on CPU
CLIPS = [f"clip_{k}_{p}" for k in ("norm", "val") for p in PRECISIONS]
CASES = (["train_save_load_32-true", "train_save_load_bf16-mixed", "save_full_32-true", "save_full_bf16-mixed",
          "load_full_into_sharded",
          "move_to_device_True", "move_to_device_False", "param_groups", "reapply_compile", "init_32-true",
          "init_16-true", "init_bf16-true", "save_filter", "manual_ac", "consolidate_32-true",
          "consolidate_bf16-mixed", "consolidate_bf16-true", "load_raw_module_state", "save_over", "compiled_autograd",
          "checkpoint_io", "size_mismatch"] + CLIPS)
STEPPED = ["param_groups", "reapply_compile", "manual_ac", "compiled_autograd"]  # each equals one plain process
CONTROLLED = STEPPED + CLIPS  # also run under DDP


def _launch(tmp_path_factory, kind, cases):
    d = tmp_path_factory.mktemp(f"fabric_ported_{kind}")
    return d, run_ranks(SCRIPT, 2, ["--strategy", kind, "--cases", ",".join(cases)], d, timeout=900)


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    return _launch(tmp_path_factory, "mics", CASES)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """The control: the cases that train, under Lightning's DDP with the same seed and data."""
    return _launch(tmp_path_factory, "ddp", CONTROLLED)


def result(ported, name):
    """The case's rank-0 result; fails with the case's traceback if any rank raised."""
    d, res = ported
    for rank, r in enumerate(res):
        assert name not in r["errors"], f"case {name}, rank {rank}:\n{r['errors'][name]}"
    return torch.load(d / f"{name}.pt", weights_only=False)


def assert_equals_ddp(ported, ddp, name, tol=1e-6):
    """The parameters after the case's steps equal those of Lightning's DDP on the same seed and data."""
    got, want = result(ported, name)["params"], result(ddp, name)["params"]
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        torch.testing.assert_close(g, w, atol=tol, rtol=0)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_train_save_load(ported, precision):
    """A sharded save (DCP files and meta.pt) resumes exactly; user data comes back; a key the checkpoint lacks is
    a ``KeyError`` naming it under strict=True (as every Lightning strategy raises it) and ignored otherwise."""
    result(ported, f"train_save_load_{precision}")


@pytest.mark.parametrize("name", ["save_full_32-true", "save_full_bf16-mixed", "load_full_into_sharded",
                                  "consolidate_32-true", "consolidate_bf16-mixed", "consolidate_bf16-true",
                                  "load_raw_module_state"])
def test_full_state_round_trips(ported, name):
    """A full file loads into MiCS, into one plain process, and back (parameters and optimizer state exactly); a
    plain process's checkpoint and ``load_raw`` (model and optimizer) load into MiCS; a directory consolidated by
    Lightning's own ``_load_distributed_checkpoint`` loads back exactly; a raw state dict with a bare parameter
    and buffers."""
    r = result(ported, name)
    if name == "load_full_into_sharded":  # the raw optimizer state too: the next step equals the plain process's
        assert r["diff"] <= 1e-6, r


@pytest.mark.parametrize("name", ["move_to_device_True", "move_to_device_False", "init_32-true", "init_16-true",
                                  "init_bf16-true", "save_filter"])
def test_setup_and_init(ported, name):
    """The strategy places the shards whatever ``move_to_device`` says; ``init_module`` gives the precision's dtype
    on CPU or meta, sharded after setup; a full save's filter keeps plain tensors."""
    result(ported, name)


@pytest.mark.parametrize("name", STEPPED)
def test_steps_equal_one_plain_process(ported, ddp, name):
    """Two parameter groups with their own learning rates, ``fabric.setup(torch.compile(model),
    _reapply_compile=True)``, a model the user checkpointed with torch's wrapper before setup (the strategy's
    ``activation_checkpointing`` on it refused first), and a compiled model after compiled autograd was refused on
    every rank (with and without fullgraph): each equals one plain process, and Lightning's DDP on the same steps."""
    assert result(ported, name)["diff"] <= 1e-6
    assert_equals_ddp(ported, ddp, name)


@pytest.mark.parametrize("kind", ["norm", "val"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_clip_gradients(ported, ddp, kind, precision):
    """Every gradient equal by construction: by value each becomes clip_val; by norm (max_norm a tenth of the norm,
    which Lightning's own test skips) the norm becomes max_norm and the returned total is the norm before; the
    Adam step then equals one plain process clipped alike, and Lightning's DDP (its norm too)."""
    r = result(ported, f"clip_{kind}_{precision}")
    if kind == "norm":
        assert r["total"] == pytest.approx(r["norm"], rel=1e-6)
        assert r["after"] == pytest.approx(r["norm"] / 10, rel=1e-5)
    assert r["diff"] <= 1e-6, r  # Adam's first step is lr * g / |g|: bf16's rounding of g hardly shows
    control = result(ddp, f"clip_{kind}_{precision}")
    if kind == "norm":
        assert r["total"] == pytest.approx(control["total"], rel=1e-6)
    assert_equals_ddp(ported, ddp, f"clip_{kind}_{precision}")


def test_save_over_an_existing_path(ported):
    """Either form replaces a file or a checkpoint of either form; a directory holding other files is refused on
    every rank with an ``IsADirectoryError`` and left as it was (a save publishes a whole directory in its place)."""
    r = result(ported, "save_over")
    assert r["full"] == r["sharded"] == ["not-a-checkpoint", "over-file", "over-full", "over-sharded"], r


def test_checkpoint_io_plugin(ported):
    """A CheckpointIO plugin saves and loads the full form through the user's path (rank 0 saves, every rank
    loads, exactly); with sharded checkpoints, which it would not see, it is refused when Fabric is made."""
    result(ported, "checkpoint_io")


def test_load_into_other_shapes_names_each_entry(ported):
    """A checkpoint loaded into a module whose parameters have other shapes: refused on every rank, naming each
    entry with both shapes (sharded: before any collective of the read; full: ``load_state_dict``'s own error)."""
    result(ported, "size_mismatch")
