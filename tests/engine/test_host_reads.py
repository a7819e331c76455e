"""The host-read budget ([Note: host reads per step] in reliability.py): 4 ranks on gloo train a tiny model under
each option through Fabric and the Trainer, and a dispatch mode (tests/helpers/host_reads.py) counts every host read
of tensor data in each steady-state optimizer step (after 2 warm-up steps). Only the engine's reads are held to the
budget (the package's frames, ``triton_kernels`` included); Lightning's own and the optimizer's are reported beside.
On CPU a host tensor and a device tensor look alike, so the budget names each site and whether it reads device data
(a wait on a GPU) or host memory by design."""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "engine" / "host_reads.py"
TRAINABLE = 15  # the script's model: embedding, 3 blocks of 2 linears, the head; every parameter sharded
S2 = {"sharded_data_parallel_degree": 2}
ROWS = {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True}
ZERO1 = {"sharded_data_parallel_degree": 1, "shard_optimizer_state": True}
OFFLOAD = {"sharded_data_parallel_degree": 2, "activation_checkpointing": "Block", "activation_offload": True}
INT8 = {"sharded_data_parallel_degree": 2, "quantize_gradients": True}
VARIANTS = [
    {"name": "s2", "options": S2},
    {"name": "rows", "options": ROWS},
    {"name": "rows_accum3", "options": ROWS, "accum": 3},
    {"name": "zero1_bf16", "options": ZERO1, "precision": "bf16-mixed"},
    {"name": "nonfinite", "options": dict(S2, stop_on_nonfinite=True)},
    {"name": "clip_norm", "options": S2, "clip": "norm"},
    {"name": "clip_norm_unchecked", "options": S2, "clip": "norm_nocheck"},
    {"name": "offload", "options": OFFLOAD},
    {"name": "int8", "options": INT8},
]
VARIANTS += [dict(v, name="trainer_" + v["name"], trainer=True) for v in VARIANTS if v["name"] != "clip_norm_unchecked"]


def budget(v):
    """The engine's reads allowed per steady-state optimizer step, by ``file:function``."""
    out = {  # host memory by design ([Note: flags without a wait] in replicated.py): no wait on a GPU
        "lightning_mics/engine/gradients.py:publish": TRAINABLE,  # each trainable parameter's summed flag
        "lightning_mics/engine/replicated.py:<genexpr>": 1,  # this rank's own flags, one per replicated bucket
    }
    # device data: each a wait on a GPU
    if v["options"].get("stop_on_nonfinite"):
        out["lightning_mics/frontends/reliability.py:check_finite"] = 1
    if v["options"] is ROWS:
        out["lightning_mics/engine/optimizer_rows.py:exchange"] = v.get("accum", 1) - 1  # forwards no step precedes
    if v.get("clip") == "norm" and not v.get("trainer"):
        out["lightning_mics/frontends/fabric.py:clip_gradients_norm"] = 1  # error_if_nonfinite=True, as torch's clip
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(SCRIPT, 4, ["--variants", json.dumps(VARIANTS), "--steps", "5", "--warmup", "2"],
                     tmp_path_factory.mktemp("host_reads"), timeout=900)


@pytest.mark.parametrize("v", VARIANTS, ids=[v["name"] for v in VARIANTS])
def test_steady_state_host_reads_stay_in_the_budget(runs, v):
    allowed = budget(v)
    for rank, res in enumerate(runs):
        got = {r["name"]: r for r in res}[v["name"]]["per_step"]
        assert len(got) == 3, (rank, got)
        assert all(step["by_site"] == got[0]["by_site"] for step in got), (rank, got)  # the same every step
        for site, n in got[0]["by_site"].items():
            assert n <= allowed.get(site, 0), (rank, v["name"], site, n, got[0]["sites"])
