"""Clipping by norm where a rank holds no gradient ([Note: the norm's device] in clip.py): it still joins every
reduction, on the mesh's device, and every rank ends with the norm of the unsharded gradients."""

import pytest
import torch

from lightning_mics.frontends.clip import norm_device
from tests.helpers.launch import REPO, run_ranks


@pytest.mark.distributed
def test_a_rank_without_gradients_clips_with_its_peers_on_the_mesh_device(tmp_path):
    res = run_ranks(REPO / "tests" / "engine" / "clip_devices.py", 4, [], tmp_path)
    for rank, r in enumerate(res):
        for case, c in r.items():
            assert c["total"] == pytest.approx(c["expected"], rel=1e-6, abs=1e-7), (rank, case, c)
            assert c["clipped_ok"], (rank, case, c)
            assert c["total_device"] == c["mesh_device"], (rank, case, c)
            assert c["reduced_devices"] and set(c["reduced_devices"]) == {c["mesh_device"]}, (rank, case, c)
        assert r["shard1_none"]["had_grad"] == (rank % 2 == 0)
    assert res[0]["all"]["total"] > res[0]["shard1_none"]["total"] > res[0]["none"]["total"] == 0.0


def test_the_norm_is_made_on_the_mesh_device_type_not_the_host():
    """The device choice alone, for a device this machine lacks: a rank with no gradient whose only tensors are on
    the host (a CUDA mesh) sums on the mesh's device type; tensors of the mesh's type give their own device."""
    host = torch.zeros(2)
    assert norm_device([], [host], "cuda").type == "cuda"
    assert norm_device([], [], "cuda").type == "cuda"
    assert norm_device([], [host], "cpu") == host.device
    assert norm_device([host], [], "cpu") == host.device
