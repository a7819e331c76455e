"""Activation offload replays the forward's dropout masks and leaves the RNG where the forward left it
([Note: offload and the RNG] in activations.py): in the engine on real ranks, and through ``offload_dropout_check``, the
function a GPU run calls for the CUDA generator (on CPU here)."""

import pytest

from tests.helpers.launch import REPO, run_ranks
from tests.helpers.offload_check import offload_dropout_check

SCRIPT = REPO / "tests" / "engine" / "offload_rng.py"


@pytest.mark.distributed
def test_offload_with_dropout_trains_as_checkpointing_without_it(tmp_path):
    """Fabric, 2 ranks, s = 2, every block with Dropout(0.5), each rank its own masks: with grouped checkpointing,
    with offload on and off, and without checkpointing, the losses, each rank's gradient shards and RNG state after
    every backward, and its parameter shards after every step are bit-equal."""
    for r in run_ranks(SCRIPT, 2, [], tmp_path):
        assert r["offloaded_bytes"] > 0 and r["n_grads"] > 0 and r["rng_advances"], r
        for name in ("plain", "offloaded"):
            for key in ("losses", "grads", "params", "rng"):
                assert r[f"{key}_equal_{name}"], (name, key, r)


def test_offload_dropout_check_on_cpu():
    out = offload_dropout_check("cpu")
    assert out["ok"], out
