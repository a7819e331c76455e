"""Layout of groups (pure, no processes) and option validation (raised before any collective); the timeout
option reaching the process group (real ranks)."""

import inspect
from datetime import timedelta

import lightning as L
import pytest

import lightning_mics
from lightning_mics import MiCSConfig, MiCSStrategy
from lightning_mics import fabric as mics_fabric
from lightning_mics.layout.topology import plan_layout
from tests.helpers.launch import REPO, run_ranks


@pytest.mark.parametrize("s", [2, 4, 8])
def test_seed_layout_8_way(s):
    lay = plan_layout(8, s, 8)
    assert lay.replicas == 8 // s
    assert lay.shard_groups() == [list(range(g * s, (g + 1) * s)) for g in range(8 // s)]  # contiguous
    assert lay.replica_groups() == [list(range(j, 8, s)) for j in range(s)]  # strided
    for rank in range(8):
        assert rank in lay.shard_group_of(rank) and rank in lay.replica_group_of(rank)
        assert set(lay.shard_group_of(rank)) & set(lay.replica_group_of(rank)) == {rank}


def test_node_subgroups_when_a_shard_group_spans_nodes():
    lay = plan_layout(8, 4, 2)  # two ranks per node, shard groups of 4 span 2 nodes
    assert lay.spans_nodes and lay.hierarchical_possible
    assert lay.intra_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.inter_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_registered_and_config_roundtrip():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mics", logger=False)
    assert isinstance(trainer.strategy, MiCSStrategy)
    assert MiCSConfig(reduce_bucket_size=5e8).reduce_bucket_size == 500_000_000
    assert set(MiCSConfig.names()) <= set(inspect.signature(MiCSStrategy).parameters)  # [Note: one option list]
    assert lightning_mics.MiCSStrategy is MiCSStrategy


@pytest.mark.distributed
@pytest.mark.parametrize("front, given", [("fabric", "timedelta"), ("trainer", "timedelta"), ("trainer", "seconds")])
def test_timeout_reaches_the_process_group(tmp_path, front, given):
    """``timeout`` in seconds or as a ``datetime.timedelta`` (what Lightning's own strategies take): the process
    group the strategy creates waits that long in a collective, on every rank, and so does every sub-group of its
    mesh (torch's default there was 30 minutes)."""
    results = run_ranks(REPO / "tests" / "options" / "pg_timeout.py", 2,
                        ["--front", front, "--timeout", given], tmp_path)
    assert [r["pg_timeout_s"] for r in results] == [33.0, 33.0], results
    assert all(r["group_timeouts_s"] and set(r["group_timeouts_s"]) == {33.0} for r in results), results


def test_timeout_as_timedelta_is_seconds():
    assert MiCSConfig(timeout=timedelta(minutes=2)).timeout == 120.0
    assert mics_fabric.MiCSStrategy(timeout=timedelta(seconds=5)).options.timeout == 5.0
