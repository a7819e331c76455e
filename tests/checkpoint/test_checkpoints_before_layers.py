"""Checkpoints written before the package was laid out in folders by layer still load: a Trainer's sharded
directory and full file (tests/checkpoint/before_layers/, written by tests/checkpoint/before_layers.py at commit
11b1c00) are consolidated into the same state and resume under the Trainer to the same parameters."""

import pytest
import torch

import lightning_mics
from tests.helpers.launch import REPO, run_ranks

FIXTURES = REPO / "tests" / "checkpoint" / "before_layers"


def test_the_old_sharded_directory_consolidates_to_the_old_full_file():
    sharded = lightning_mics.consolidate(FIXTURES / "sharded.ckpt")
    full = torch.load(FIXTURES / "full.ckpt", map_location="cpu", weights_only=True)
    assert sharded["global_step"] == full["global_step"] == 3
    assert sorted(sharded["state_dict"]) == sorted(full["state_dict"]) == sorted(
        ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias", "head.weight", "head.bias"])
    for k, v in full["state_dict"].items():
        assert torch.equal(sharded["state_dict"][k], v), k


@pytest.mark.distributed
def test_old_checkpoints_resume_under_the_trainer(tmp_path):
    states = []
    for kind in ("sharded", "full"):
        out = tmp_path / kind
        out.mkdir()
        res = run_ranks(REPO / "tests" / "checkpoint" / "before_layers.py", 2,
                        ["--kind", kind, "--resume", str(FIXTURES / f"{kind}.ckpt")], out)
        assert res[0]["global_step"] == 4
        states.append(res[0]["state"])
    assert states[0] == states[1]  # the same parameters and optimizer state, whichever form was resumed
    old = torch.load(FIXTURES / "full.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert any(torch.tensor(states[0][k]).ne(v).any() for k, v in old.items())  # and it stepped once more
