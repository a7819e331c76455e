"""DTensors a checkpoint holds beside the model ([Note: DTensors beside the model] in
``lightning_mics/checkpoint/beside.py``): a hand-written EMA of the parameters, kept as clones of them and saved
from ``on_save_checkpoint`` (Trainer) or as an entry of ``fabric.save``'s dict (``tests/checkpoint/beside.py``).

Rank 0 alone writes those entries. Before, every rank read rank 0's shards back: the resumed fit failed at its
first ``lerp_`` (a shard of 19 rows against 18, 2 ranks), and with even shards it would have averaged into the
wrong rows without a word. Lightning's FSDP and ModelParallel strategies write them the same way."""

import pytest
import torch

from tests.helpers.cases import CaseRuns, max_diff
from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "checkpoint" / "beside.py"
# (kind, world): s = 2 with 1 and 2 replicas, the rows over replicas, the full format, ZeRO-1 (plain parameters)
LAYOUTS = [("mics", 2), ("mics_os", 4), ("mics_full", 4), ("zero1", 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return CaseRuns(SCRIPT, tmp_path_factory, lambda kind: ["fabric"] if kind.startswith("fabric_")
                    else ["ema", "trainable", "partial", "ema_bf16"] if kind == "mics" else ["ema", "trainable"])


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_an_ema_saved_beside_the_model_resumes_as_under_ddp(runs, kind, world):
    """The resumed fit reads the EMA the first fit saved (DTensors again wherever the parameters are DTensors,
    the nested list's entries too), goes on as the uninterrupted fit and as DDP, and the checkpoint consolidated in
    one process holds the full EMA DDP's file holds."""
    got, ref = runs.load(kind, world, "ema"), runs.load("ddp", world, "ema")
    assert got["types"] == (["Tensor"] if kind == "zero1" else ["DTensor"]) and got["pair_alike"], got["types"]
    assert got["updates"] == ref["updates"] == 12
    assert max_diff(got["ema_loaded"], ref["ema_loaded"]) <= 1e-6
    assert max_diff(got["consolidated"], ref["saved"]) <= 1e-6
    assert max_diff(got["ema_end"], got["first_end"]) == 0.0  # the resumed run is the uninterrupted one
    assert max_diff(got["ema_end"], ref["ema_end"]) <= 1e-6
    assert max_diff(got["params"], ref["params"]) <= 1e-6


@pytest.mark.parametrize("kind", ["mics", "mics_full"])
def test_an_ema_saved_at_4_ranks_loads_at_2(runs, tmp_path, kind):
    """Saved with the optimizer's rows over 2 replicas on 4 ranks (sharded, or full), read by a fit on 2 ranks at
    s = 2 (resharded by DCP, or sliced from the full file): the EMA the resumed fit starts from is the saved one."""
    saved = "mics_os" if kind == "mics" else "mics_full"
    runs.load(saved, 4, "ema")
    path = runs.done[(saved, 4)][0] / f"ema_{saved}.ckpt"
    run_ranks(SCRIPT, 2, ["--strategy", kind, "--cases", "ema_from"], tmp_path, extra_env={"BESIDE_FROM": str(path)})
    got = torch.load(tmp_path / "ema_from.pt", weights_only=False)
    assert got["types"] == ["DTensor"]
    assert max_diff(got["ema_loaded"], runs.load("ddp", 4, "ema")["saved"]) <= 1e-6


@pytest.mark.parametrize("kind", ["fabric_mics", "fabric_mics_os", "fabric_mics_os_full"])
def test_fabric_save_of_an_ema_beside_the_model_loads_it_back(runs, kind):
    """``fabric.save(path, {"model", "optimizer", "ema"})`` and ``fabric.load`` into a fresh model, optimizer and
    EMA, 4 ranks: the EMA comes back as DTensors equal to the saved one, and three more steps from the load equal
    three more steps of the run that saved."""
    got = runs.load(kind, 4, "fabric")
    assert got["types"] == ["DTensor"]
    assert max_diff(got["loaded"], got["at_save"]) == 0.0
    assert max_diff(got["end"], got["straight_end"]) == 0.0


def test_a_partial_dtensor_beside_the_model_is_refused_on_every_rank(runs):
    got = runs.load("mics", 2, "partial")
    assert len(set(got["refused"])) == 1 and not got["written"], got
    assert "'sums/loss'" in got["refused"][0] and "Partial" in got["refused"][0], got["refused"][0]


@pytest.mark.parametrize("kind,world", LAYOUTS)
def test_the_state_dict_as_on_save_checkpoint_left_it_is_saved_as_under_ddp(runs, kind, world):
    """A finetuning run that keeps only its trainable weights in the checkpoint (a frozen embedding deleted from
    ``state_dict``) and adds an entry: the checkpoint holds DDP's names, and a fit resumed from it with
    ``strict_loading = False`` equals DDP's. Before, the sharded save wrote the module's own shards whatever the
    hook had done: the frozen weights in, the added entry out."""
    got, ref = runs.load(kind, world, "trainable"), runs.load("ddp", world, "trainable")
    assert "net.emb.weight" not in ref["names"] and "extra.scale" in ref["names"]
    assert got["names"] == ref["names"]
    assert max_diff(got["params"], ref["params"]) <= 1e-6 and max_diff(got["resumed"], ref["resumed"]) <= 1e-6


def test_an_ema_saved_beside_the_model_under_bf16_mixed_keeps_the_fp32_shards(runs):
    """Under bf16-mixed at s = 2 the parameters between steps are the fp32 masters' shards, and so are the clones:
    the checkpoint holds them in fp32 and the resumed fit is the uninterrupted one bit for bit."""
    got = runs.load("mics", 2, "ema_bf16")
    assert got["types"] == ["DTensor"]
    assert {str(t.dtype) for t in got["consolidated"].values()} == {"torch.float32"}
    assert max_diff(got["ema_end"], got["first_end"]) == 0.0
