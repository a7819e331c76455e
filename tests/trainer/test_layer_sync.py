"""BatchNorm and Lightning's layer sync under MiCS, against DDP on the same data and seed ([Note: layer sync] in
``lightning_mics/frontends/layer_sync.py``).

Torch's SyncBatchNorm computes on GPUs only (DDP refuses it on CPU), so the syncing runs through a LayerSync plugin
of ``tests/trainer/layer_sync.py`` that sums the batch statistics over every rank with a differentiable all_reduce:
it goes through the very hooks ``Trainer(sync_batchnorm=True)`` goes through (Lightning hands either to the
strategy as its ``_layer_sync``). Before this, MiCS never read it: ``sync_batchnorm=True`` was accepted and each
rank normalized with its own batch. MiCS runs with s = 2, every parameter sharded, on 2 and 4 ranks, and on 4
with ``shard_optimizer_state``.
"""

import pytest

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "trainer" / "layer_sync.py"
CASES = ["batchnorm", "layer_sync", "sync_batchnorm_cpu", "layer_sync_sharded"]
MICS = [("mics", 2), ("mics", 4), ("mics_os", 4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(SCRIPT, tmp_path_factory, lambda kind: CASES)



@pytest.mark.parametrize("kind, world", MICS)
def test_batchnorm_without_sync_equals_ddp_and_each_rank_keeps_its_statistics(runs, kind, world):
    """Training normalizes with each rank's batch under both. The running statistics are each rank's own, as under
    FSDP (DDP broadcasts rank 0's at every forward, so its other ranks hold other values): rank 0's equal DDP's."""
    got, ref = runs.load(kind, world, "batchnorm"), runs.load("ddp", world, "batchnorm")
    assert max_diff(got["params"], ref["params"]) <= 1e-6
    assert max_diff(got["buffers"][0], ref["buffers"][0]) <= 1e-6
    assert max_diff(got["buffers"][1], got["buffers"][0]) > 1e-3  # not synced: rank 1 saw other batches
    assert got["types_in_fit"] == got["types_after"] == ["BatchNorm1d"]


@pytest.mark.parametrize("kind, world", MICS)
def test_layer_sync_swaps_the_layers_before_sharding_and_back_after_fit(runs, kind, world):
    """The plugin's layers compute during the fit (statistics over every rank: the same buffers on each) and the
    module has its BatchNorm1d back afterwards, with parameters and buffers equal to DDP's."""
    got, ref = runs.load(kind, world, "layer_sync"), runs.load("ddp", world, "layer_sync")
    assert got["types_in_fit"] == ref["types_in_fit"] == ["AllReducedBatchNorm1d"]
    assert got["types_after"] == ref["types_after"] == ["BatchNorm1d"]
    assert max_diff(got["params"], ref["params"]) <= 1e-6
    for rank in range(world):
        assert max_diff(got["buffers"][rank], ref["buffers"][rank]) <= 1e-6
        assert max_diff(got["buffers"][rank], got["buffers"][0]) == 0.0


@pytest.mark.parametrize("kind, world", MICS)
def test_torch_sync_batchnorm_on_cpu_is_refused_on_every_rank(runs, kind, world):
    """Torch's SyncBatchNorm refuses CPU tensors (DDP refuses it when it wraps the module): refused at setup on every
    rank alike, naming the option, the model given back with Lightning's reverted layers as under DDP; a fit in the
    same processes afterwards equals DDP's."""
    got, ref = runs.load(kind, world, "sync_batchnorm_cpu"), runs.load("ddp", world, "sync_batchnorm_cpu")
    assert len(set(got["errors"])) == 1, got["errors"]
    for text in ("ValueError: MiCSStrategy: Trainer(sync_batchnorm=True)", "SyncBatchNorm", "not on cpu",
                 "Allowed on cpu: sync_batchnorm=False"):
        assert text in got["error"], got["error"]
    assert "SyncBatchNorm" in (ref["error"] or "")  # DDP refuses it too
    assert got["types_after"] == ref["types_after"]
    assert max_diff(got["params"], ref["params"]) <= 1e-6


@pytest.mark.parametrize("kind, world", MICS)
def test_a_module_left_sharded_keeps_its_synced_layers_for_the_next_fit(runs, kind, world):
    """Larger than max_live_parameters, the module stays sharded after each fit and keeps the synced layers (the
    engine holds them); the second fit continues with them, equal to DDP's two fits (which revert and convert
    again). A module left sharded unsynced cannot be asked to sync: refused."""
    got, ref = runs.load(kind, world, "layer_sync_sharded"), runs.load("ddp", world, "layer_sync_sharded")
    assert got["stayed_sharded"]
    assert got["types_after_0"] == got["types_after_1"] == ["AllReducedBatchNorm1d"]
    assert max_diff(got["params"], ref["params"]) <= 1e-6
    for rank in range(world):
        assert max_diff(got["buffers"][rank], ref["buffers"][rank]) <= 1e-6
    assert "cannot swap the layers of a module a previous fit left sharded" in (got["refused"] or ""), got["refused"]
    assert ref["refused"] is None
