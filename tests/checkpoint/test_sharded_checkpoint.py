"""Checkpoints through torch.distributed.checkpoint: exact resume, resharding, consolidation, file sizes, crash
safety, clear errors. Real processes (gloo) run tests/checkpoint/sharded_ckpt.py: one 4-rank run (s=2) saves and
resumes; 2-rank and 1-rank runs load what it saved. References come from the full-state path
(``lightning_module_state_dict`` and the consolidated optimizer state), which shares no code with DCP's."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import lightning_mics
from lightning_mics import MiCSConfig
from lightning_mics.checkpoint import files as files
from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "checkpoint" / "sharded_ckpt.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    return out, [r["save"] for r in run_ranks(SCRIPT, 4, ["--phase", "save"], out)]


@pytest.fixture(scope="module")
def crashed(saved):
    """A save after fit, then a second save to the same path killed on rank 1 halfway through its shard file (the
    launcher then ends the job). What is on disk is looked at right away, before anything reads or resaves it.
    Rank 0 fails at once too (its peer reset the connection), and the launcher may find both ended at one look and
    name either; which rank was killed is checked by its exit status (-9) in the test."""
    out, _ = saved
    with pytest.raises(AssertionError, match="rank [01] failed") as failure:
        run_ranks(SCRIPT, 2, ["--phase", "crash"], out)
    path = out / "crash.ckpt"
    leftovers = sorted(path.parent.glob(f".{path.name}.tmp-*"))
    return {"out": out, "failure": str(failure.value), "leftovers": leftovers,
            "leftover_files": [sorted(p.name for p in d.iterdir()) for d in leftovers],
            "consolidated": lightning_mics.consolidate(path)}


@pytest.fixture(scope="module")
def two_ranks(saved):
    out, _ = saved
    res = run_ranks(SCRIPT, 2, ["--phase", "load", "--phase", "bf16", "--ckpt", "sharded.ckpt=ref_save.pt"], out)
    return res


@pytest.fixture(scope="module")
def one_rank(saved, crashed):
    out, _ = saved
    return run_ranks(SCRIPT, 1, ["--phase", "load", "--s", "1", "--resave", "crash.ckpt",
                                 "--ckpt", "sharded.ckpt=ref_save.pt", "--ckpt", "crash.ckpt=crash_ref.pt"], out)


OVER = json.dumps({"shard_optimizer_state": True})  # [Note: optimizer rows over replicas]


@pytest.fixture(scope="module")
def saved_over(tmp_path_factory, saved):
    """The save phase with the optimizer's rows over replicas (4 ranks, s = 2, r = 2): its optimizer state is cut
    over all 4 ranks; then the checkpoint that the plain s = 2 run saved is loaded into this layout."""
    out = tmp_path_factory.mktemp("ckpt_over")
    res = [r["save"] for r in run_ranks(SCRIPT, 4, ["--phase", "save", "--extra", OVER], out)]
    plain_out, _ = saved
    loaded = run_ranks(SCRIPT, 4, ["--phase", "load", "--extra", OVER, "--ckpt", "sharded.ckpt=ref_save.pt"],
                       plain_out)
    return res, [r["load"]["sharded.ckpt"] for r in loaded]


def test_optimizer_rows_over_replicas_save_resume_and_reshard(saved_over):
    """Resume from the sharded and the full checkpoint equals the uninterrupted run; the sharded one loads at
    s = 4 without the option and consolidates to the full state; a checkpoint of plain s = 2 loads into it."""
    res, loaded = saved_over
    for r in res:
        assert r["resume_sharded_step"] == 6 and r["resume_full_step"] == 6, r
        at = r["at_s4"]
        assert at["steps"] == 3 and at["model_equal"] and at["optimizer_equal"] and at["validate_model_equal"], at
        assert {e["type"] for e in r["errors"].values()} == {"CheckpointError"}, r["errors"]
    assert res[0]["resume_sharded_rel"] <= 1e-6 and res[0]["resume_full_rel"] <= 1e-6, res[0]
    assert res[0]["consolidated_equal"] and res[0]["consolidated_optimizer_equal"], res[0]
    for r in loaded:
        assert r["steps"] == 3 and r["model_equal"] and r["optimizer_equal"] and r["validate_model_equal"], r


def test_sharded_is_the_default():
    assert MiCSConfig().state_dict_type == "sharded"
    assert OmegaConf.load(REPO / "conf" / "strategy" / "mics.yaml").state_dict_type == "sharded"


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_resume_equals_uninterrupted(saved, kind):
    """3 steps, save (ModelCheckpoint at the end of the epoch), resume to 6 == 6 uninterrupted steps: AdamW with
    two groups and a per-step lr schedule, tied, frozen and unused parameters."""
    _, res = saved
    assert all(r[f"resume_{kind}_step"] == 6 for r in res), res
    assert res[0][f"resume_{kind}_rel"] <= 1e-6, res[0]


def test_bf16_resume_from_a_model_kept_sharded_after_fit(two_ranks):
    """bf16-mixed, a model larger than max_live_parameters (it stays sharded after fit, engine alive), saved after
    fit: the checkpoint holds the fp32 masters, and the resumed run equals the uninterrupted one."""
    assert all(r["bf16"]["stays_sharded"] for r in two_ranks)
    assert two_ranks[0]["bf16"]["saved_dtypes"] == ["torch.float32"]
    assert two_ranks[0]["bf16"]["rel"] <= 1e-6, two_ranks[0]


@pytest.mark.parametrize("layout", ["4 ranks s=4", "2 ranks s=2", "1 rank"])
def test_sharded_save_at_4x2_loads_at_other_layouts(request, saved, layout):
    """Model and optimizer state (and the scheduler's lr) after loading equal the saved ones exactly; the
    saved epoch was the last, so no step runs. ``validate(ckpt_path=...)`` loads the model alone."""
    if layout == "4 ranks s=4":
        ranks = [r["at_s4"] for r in saved[1]]
    else:
        res = request.getfixturevalue("two_ranks" if layout == "2 ranks s=2" else "one_rank")
        ranks = [r["load"]["sharded.ckpt"] for r in res]
    for r in ranks:
        assert r["steps"] == 3 and r["model_equal"] and r["optimizer_equal"] and r["validate_model_equal"], r
        assert r["lr"] == r["ref_lr"], r


def _payload(index, mi):
    md = index.state_dict_metadata[mi.fqn]
    if not isinstance(md, TensorStorageMetadata):
        return None
    return md.chunks[mi.index].sizes.numel() * md.properties.dtype.itemsize


def test_no_file_holds_more_than_its_shard(saved):
    """Each rank's file holds at most one shard (ceil(d0/s) rows) of every sharded tensor of model and optimizer
    state plus the replicated ones, every chunk is written once (replicas write no duplicate bytes), each item
    is its own bytes plus torch.save's container (no view saved with its whole flat-shard storage), and
    Lightning's metadata lives in meta.pt alone."""
    out, _ = saved
    ckpt = out / "sharded.ckpt"
    ref = torch.load(out / "ref_save.pt", weights_only=True)
    index = files.read_index(ckpt)
    container = 2 * len(_saved_bytes(torch.zeros(())))
    per_file, chunks = {}, set()
    for mi, info in index.storage_data.items():
        payload = _payload(index, mi)
        if payload is not None:
            assert info.length <= payload + container, (mi, info)
            assert (mi.fqn, tuple(mi.offset)) not in chunks, mi
            chunks.add((mi.fqn, tuple(mi.offset)))
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + payload
    total = sum(md.size.numel() * md.properties.dtype.itemsize for md in index.state_dict_metadata.values()
                if isinstance(md, TensorStorageMetadata))
    assert sum(per_file.values()) == total
    bound = ref["shard_bytes"] + ref["repl_bytes"]
    assert len(per_file) == 4 and max(per_file.values()) <= bound, (per_file, bound)
    meta = torch.load(ckpt / files.META_FILE, weights_only=True)
    assert "state_dict" not in meta and "optimizer_states" not in meta
    assert {"loops", "callbacks", "lr_schedulers", "hyper_parameters"} <= set(meta)


def _saved_bytes(t):
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_consolidate_equals_full_state_dict(saved, tmp_path):
    """In process and through the console script: the consolidated state dict equals
    ``lightning_module_state_dict()`` at the save, the optimizer state equals the gathered full one, the file
    loads with weights_only=True and into the plain module with strict=True; the full checkpoint saved at the
    same point of the same run (state_dict_type="full") consolidates to the same state."""
    out, res = saved
    r0 = res[0]
    assert r0["consolidated_keys"] and r0["consolidated_equal"] and r0["consolidated_optimizer_equal"], r0
    assert r0["consolidated_hparams"] == {"seed": 0}
    assert {"loops", "callbacks", "lr_schedulers", "hyper_parameters"} <= set(r0["consolidated_meta"])
    script = shutil.which("lightning-mics-consolidate", path=str(Path(sys.executable).parent)) or shutil.which(
        "lightning-mics-consolidate")
    assert script, "the console script is installed with the package (pip install -e .)"
    proc = subprocess.run([script, str(out / "sharded.ckpt"), str(tmp_path / "full.pt")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    ref = torch.load(out / "ref_save.pt", weights_only=True)
    assert sorted(full["state_dict"]) == sorted(ref["state_dict"])
    assert all(torch.equal(full["state_dict"][k], v) for k, v in ref["state_dict"].items())
    from tests.checkpoint.sharded_ckpt import Lit

    Lit(3).load_state_dict(full["state_dict"], strict=True)
    same_point = lightning_mics.consolidate(out / "full.ckpt")  # a full file: read with weights_only=True
    assert all(torch.equal(same_point["state_dict"][k], v) for k, v in ref["state_dict"].items())
    bad = subprocess.run([script, str(out / "truncated.ckpt"), str(tmp_path / "bad.pt")], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and str(out / "truncated.ckpt") in bad.stderr and "truncated or incomplete" in bad.stderr
    assert not (tmp_path / "bad.pt").exists()


def test_killed_save_keeps_the_previous_checkpoint(crashed, one_rank):
    """Rank 1 was SIGKILLed while writing its shards of the second save: the path still holds the first save,
    complete (consolidated: equal to the state at that save; loaded at 1 rank by fit and validate), the dead
    save's temporary holds no index; the next save to the path removes it."""
    out = crashed["out"]
    assert "--- rank 1 (exit -9)" in crashed["failure"] and (out / "killed_mid_write").exists()
    assert len(crashed["leftovers"]) == 1 and files.DCP_METADATA not in crashed["leftover_files"][0]
    assert files.META_FILE not in crashed["leftover_files"][0]
    ref = torch.load(out / "crash_ref.pt", weights_only=True)
    got = crashed["consolidated"]
    assert all(torch.equal(got["state_dict"][k], v) for k, v in ref["state_dict"].items())
    r = one_rank[0]["load"]["crash.ckpt"]
    assert r["model_equal"] and r["optimizer_equal"] and r["validate_model_equal"], r
    assert not list(out.glob(".crash.ckpt.*"))  # the resave at 1 rank removed the dead temporary
    again = lightning_mics.consolidate(out / "crash.ckpt")  # written at 1 rank after the load
    assert again["lightning_mics"]["consolidated_from"]["world_size"] == 1
    assert all(torch.equal(again["state_dict"][k], v) for k, v in ref["state_dict"].items())


@pytest.mark.parametrize("name", ["truncated", "truncated_full", "version", "foreign", "missing"])
def test_bad_checkpoint_fails_clearly_on_every_rank(saved, name):
    """A truncated shard file, a truncated full file, another format version, a directory without the marker and
    a missing path: ``fit(ckpt_path=...)`` raises CheckpointError naming the path on all 4 ranks (no hang)."""
    out, res = saved
    for r in res:
        err = r["errors"][name]
        assert err["type"] == "CheckpointError" and str(out / f"{name}.ckpt") in err["message"], err
    expected = {"truncated": "truncated", "truncated_full": "truncated", "version": "version 99",
                "foreign": "not a lightning_mics checkpoint", "missing": "no checkpoint"}[name]
    assert expected in res[0]["errors"][name]["message"]


def test_interrupted_publish_is_recovered(tmp_path):
    """The fallback publish (two renames) stopped between them: the path is gone, the previous checkpoint sits
    under .old-<token>. Loading reads it (with a warning); the next save puts it back before writing."""
    path = tmp_path / "x.ckpt"
    old = tmp_path / ".x.ckpt.old-abc"
    old.mkdir()
    (old / files.META_FILE).write_bytes(b"m")
    (old / files.DCP_METADATA).write_bytes(b"i")
    dead = tmp_path / ".x.ckpt.tmp-dead"
    dead.mkdir()
    with pytest.warns(UserWarning, match="previous checkpoint"):
        assert files.resolve(path) == old
    files.prepare(path, "new")
    assert (path / files.META_FILE).read_bytes() == b"m" and not old.exists() and not dead.exists()
    tmp = files.temporary(path, "new")
    tmp.mkdir()
    (tmp / files.META_FILE).write_bytes(b"n")
    files.publish(tmp, path, "new")
    assert (path / files.META_FILE).read_bytes() == b"n" and sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


def test_a_load_into_a_live_model_mid_loop_equals_the_straight_run(tmp_path):
    """Fabric, 2 ranks (tests/checkpoint/live_load.py): save after 2 steps, one more step, load, the last 2 steps,
    against 4 steps straight; sharded and full checkpoints. ZeRO-1's pinned unit is gathered when the load comes:
    before the load released it, the module went on computing with the replaced parameters and the next step took
    them back into the masters (0.28 from the straight run, both formats)."""
    run_ranks(REPO / "tests" / "checkpoint" / "live_load.py", 2, [], tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert sorted(result) == ["mics:full", "mics:sharded", "zero1:full", "zero1:sharded"], result
    for case, r in result.items():
        assert r["n"] > 10 and r["rel"] <= 1e-6, (case, r)
