"""Fault-tolerant replica groups (``MiCSStrategy(fault_tolerance=True)``) on torchft, with real processes: a real
lighthouse, each replica group a ``torchrun`` job of its own (2 ranks, MiCS s = 2 inside), a real kill
(tests/helpers/ft_groups.py), rank script tests/fault_tolerance/ft_trainer.py. Where a test checks what the groups
compute (the equivalences, the resumed checkpoint), a group's ranks, the 4-rank job and the plain process are forked
from the test launcher's preloaded server with torchrun's environment (some 15 s of imports saved per group); the
main job and the lost host start every group with ``torchrun``, as a user does.

- with no failure, two groups equal each other bit for bit, the same 4-rank job without fault tolerance and one
  plain process on the same global batches within fp32 rounding, under the Trainer and under Fabric;
- on two network-namespace hosts, one host's processes killed mid-run: the other group keeps stepping without
  it, the host restarted joins from its live peer at the job's step, both reach the last step with bit-equal
  parameters, every group read only its own part of the data and no sample twice, and no process is left;
- a checkpoint written under it resumes, with the committed-step count (Trainer), and under Fabric with the
  loop's position (the committed steps, or DiLoCo's inner steps);
- the options and environments it rules out are refused before any process or group exists.

Bounds such as "within 60 s" are timeouts here; the measured figures are benchmarks/fault_tolerance.py's.
"""

import json
import os

import pytest
import torch

from tests.helpers.ft_groups import FTJob, records, wait_for
from tests.helpers.launch import REPO, free_port, run_ranks, start
from tests.helpers.netns import HOSTS, namespace_hosts

pytestmark = pytest.mark.distributed
pytest.importorskip("torchft")
SCRIPT = REPO / "tests" / "fault_tolerance" / "ft_trainer.py"


def _load(path):
    return torch.load(path, weights_only=False)


def _bit_equal(a, b):
    return [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]


def _close(a, b, rtol=1e-5, atol=2e-6):
    return [k for k in a["params"] if not torch.allclose(a["params"][k], b["params"][k], rtol=rtol, atol=atol)]


def _four_ranks(out, args):
    """The same job without fault tolerance: 4 ranks on one node (s = 2, r = 2), forked as torchrun's workers."""
    run_ranks(SCRIPT, 4, args, out, timeout=300, extra_env={"LOCAL_WORLD_SIZE": "4"})


def _plain(out, args):
    """One plain process (forked from the launcher's server: what it computes is checked, not how it starts)."""
    log = out / "plain.log"
    proc = start(SCRIPT, ["--mode", "plain", "--out", str(out), *args],
                 dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), out, log)
    assert proc.wait(300) == 0, log.read_text()[-5000:]


def _two_groups(out, args, min_replicas=2, per_group=None):
    """Both groups on this host under one lighthouse (``min_replicas=2``: every quorum holds both, from step 0).
    Their ranks are forked with torchrun's environment (tests/helpers/ft_groups.py): these tests check what the
    groups compute; the main job's test and the lost host's start each group with ``torchrun``, as a user does."""
    ports = [free_port() for _ in range(2)]
    with FTJob(out, [None, None], ["127.0.0.1"] * 2, ports[0], ports[1]) as job:
        job.lighthouse(min_replicas=min_replicas)
        for g in range(2):
            job.start(g, [*args, *(per_group[g] if per_group else [])], forked=True)
        codes = [job.wait(g, timeout=400) for g in range(2)]
        logs = [job.log(job.current(g))[-4000:] for g in range(2)]
    assert codes == [0, 0], "\n".join(f"--- group {g} (exit {c}) ---\n{t}" for g, (c, t) in
                                      enumerate(zip(codes, logs)))


@pytest.mark.parametrize("accum", [2])
def test_two_groups_equal_the_job_without_fault_tolerance(tmp_path, accum):
    """Trainer: 2 groups x 2 ranks (s = 2 each) against the 4-rank job (s = 2, r = 2) and one plain process."""
    steps = ["--steps", "4", "--accum", str(accum), "--opt", "sgd"]
    _two_groups(tmp_path, ["--mode", "ft", "--out", str(tmp_path), *steps])
    _four_ranks(tmp_path, ["--mode", "mics", "--out", str(tmp_path), *steps])
    _plain(tmp_path, [*steps, "--world", "4"])
    ft0, ft1, mics, plain = (_load(tmp_path / f"{t}.pt") for t in ("ft0", "ft1", "mics", "plain"))
    assert ft0["global_step"] == ft1["global_step"] == 4
    assert _bit_equal(ft0, ft1) == []
    assert _close(ft0, mics, rtol=1e-6, atol=1e-6) == []  # the same sums, in another order for the small params
    assert _close(ft0, plain) == []
    for s in (ft0["summary"], ft1["summary"]):
        assert (s["committed"], s["failed"], s["participants_min"], s["participants_max"]) == (4, 0, 2, 2), s


def test_fabric_two_groups_equal_one_process(tmp_path):
    """Fabric: the loop resumes at the committed step; 2 groups x 2 ranks against one plain process."""
    steps = ["--steps", "3", "--accum", "2", "--opt", "sgd"]
    _two_groups(tmp_path, ["--mode", "fabric", "--out", str(tmp_path), *steps])
    _plain(tmp_path, [*steps, "--world", "4", "--fabric-data"])
    f0, f1, plain = (_load(tmp_path / f"{t}.pt") for t in ("fabric0", "fabric1", "plain"))
    assert f0["global_step"] == f1["global_step"] == 3
    assert _bit_equal(f0, f1) == []
    assert _close(f0, plain) == []


def test_checkpoint_resumes_with_the_committed_steps(tmp_path):
    """A sharded checkpoint per group after 2 steps; both groups resumed from theirs to 4 steps equal one plain
    process of 4 steps, and the manager's committed-step count continued from the checkpoint."""
    base = ["--mode", "ft", "--out", str(tmp_path), "--resumable", "--opt", "sgd"]
    ckpts = [str(tmp_path / f"ckpt{g}") for g in range(2)]
    _two_groups(tmp_path, [*base, "--steps", "2"], per_group=[["--ckpt", c] for c in ckpts])
    _two_groups(tmp_path, [*base, "--steps", "4"], per_group=[["--resume", c] for c in ckpts])
    _plain(tmp_path, ["--steps", "4", "--world", "4", "--opt", "sgd"])
    ft0, ft1, plain = (_load(tmp_path / f"{t}.pt") for t in ("ft0", "ft1", "plain"))
    assert ft0["global_step"] == ft1["global_step"] == 4
    assert _bit_equal(ft0, ft1) == []
    assert _close(ft0, plain) == []
    assert ft0["summary"]["committed_steps"] == 4 and ft0["summary"]["steps"] == 2, ft0["summary"]


@pytest.mark.parametrize("sync", ["exact", "diloco"])
def test_fabric_checkpoint_resumes_at_the_jobs_position(tmp_path, sync):
    """Fabric: each group saves after 2 steps (``fabric.save``, sharded), both are started again and load theirs
    after setup; the loop resumes at ``step_count`` = 2 (the manager's committed steps, or under DiLoCo with H = 3 the
    inner steps, mid-window) and the result equals one plain process of 4 steps (exact) or, bit for bit, the 4-rank
    Fabric DiLoCo job of 6 steps without fault tolerance."""
    diloco = ["--diloco", "3"] if sync == "diloco" else []
    steps = 6 if diloco else 4
    loop = ["--out", str(tmp_path), "--accum", "2", "--opt", "sgd", *diloco]
    base = ["--mode", "fabric", *loop]
    ckpts = [str(tmp_path / f"ckpt{g}") for g in range(2)]
    _two_groups(tmp_path, [*base, "--steps", "2"], per_group=[["--ckpt", c] for c in ckpts])
    _two_groups(tmp_path, [*base, "--steps", str(steps)], per_group=[["--resume", c] for c in ckpts])
    f0, f1 = _load(tmp_path / "fabric0.pt"), _load(tmp_path / "fabric1.pt")
    assert f0["first_step"] == f1["first_step"] == 2 and f0["global_step"] == f1["global_step"] == steps
    assert _bit_equal(f0, f1) == []
    if diloco:
        _four_ranks(tmp_path, ["--mode", "fabric-mics", *loop, "--steps", str(steps)])
        assert _bit_equal(f0, _load(tmp_path / "fabric-mics.pt")) == []
        s = f0["summary"]  # after the resume, the syncs ending steps 3 and 6 (none before the checkpoint)
        assert (s["steps"], s["committed"], s["committed_steps"]) == (2, 2, 2), s
    else:
        _plain(tmp_path, ["--steps", str(steps), "--world", "4", "--opt", "sgd", "--accum", "2", "--fabric-data"])
        assert _close(f0, _load(tmp_path / "plain.pt")) == []
        assert f0["summary"]["committed_steps"] == 4 and f0["summary"]["steps"] == 2, f0["summary"]


def test_the_main_job_under_fault_tolerance(tmp_path):
    """``lightning-mics-train strategy.fault_tolerance=true`` as two replica groups of 2 ranks each: both groups end
    at the last step with the same validation loss (bit-equal models), the quorum in the progress bar and a quorum
    line in the report. The ranks are forked with the environment torchrun gives its workers (what the groups
    compute is checked here; the lost-host tests below start every group as a torchrun job)."""
    ports = [free_port() for _ in range(2)]
    with FTJob(tmp_path, [None, None], ["127.0.0.1"] * 2, ports[0], ports[1]) as job:
        job.lighthouse(min_replicas=2)
        for g in range(2):
            job.start(g, ["strategy.fault_tolerance=true", "trainer.max_steps=12", "trainer.val_check_interval=6",
                          "data.max_bytes=300000", "model.n_layer=2", "callbacks.progress_bar.refresh_rate=1",
                          f"hydra.run.dir={tmp_path / f'run{g}'}"], module="lightning_mics.app.train", forked=True)
        codes = [job.wait(g, timeout=400) for g in range(2)]
        logs = [job.log(job.current(g)) for g in range(2)]
    assert codes == [0, 0], "\n".join(f"--- group {g} (exit {c}) ---\n{t[-4000:]}" for g, (c, t) in
                                      enumerate(zip(codes, logs)))
    reports = [json.loads((tmp_path / f"run{g}" / "report.json").read_text()) for g in range(2)]
    assert reports[0]["steps"] == reports[1]["steps"] == 12
    assert reports[0]["val_loss_final"] == reports[1]["val_loss_final"]
    for g, (report, log) in enumerate(zip(reports, logs)):
        ft = report["fault_tolerance"]
        assert (ft["group"], ft["committed"], ft["failed"], ft["participants_min"]) == (g, 12, 0, 2), ft
        assert "quorum=2" in log and f"[report] fault tolerance: group {g} of 2" in log


# -- a lost host -----------------------------------------------------------------------------------------------
@pytest.fixture
def two_hosts():
    with namespace_hosts("f") as names:
        yield names


def _samples(out, tag, ranks=(0, 1)):
    return [i for r in ranks for line in (out / f"{tag}_r{r}_samples.jsonl").read_text().splitlines()
            for i in json.loads(line)]


def test_a_lost_host_is_dropped_and_rejoins_from_its_peer(two_hosts, tmp_path):
    """Host B's group killed (SIGKILL to its agent and workers) after 6 steps and started again at once. The
    survivor pauses 0.75 s after each step it takes alone (0.25 s otherwise), so that it still runs, as a long job
    would, when the restarted group is back (within 60 s: the wait's timeout)."""
    steps = 80
    args = ["--mode", "ft", "--out", str(tmp_path), "--steps", str(steps), "--record", "--pause", "0.25",
            "--pause-alone", "0.75", "--resumable"]
    a, b = tmp_path / "ft0_steps.jsonl", tmp_path / "ft1_steps.jsonl"
    with FTJob(tmp_path, two_hosts, HOSTS, 29540, 29550) as job:
        job.lighthouse(min_replicas=1, heartbeat_ms=2000, host=0)
        job.start(0, args)
        job.start(1, args)
        wait_for(lambda: job.check() and len(records(a)) >= 6 and len(records(b)) >= 6, 240,
                 what="6 steps on both hosts")
        killed = job.kill(1)
        before = len(records(b))
        # the survivor steps without the lost group: a quorum of 1 (a timeout, not a measured figure)
        wait_for(lambda: job.check() and any(r["t"] > killed and r["quorum"] == 1 for r in records(a)), 60,
                 what="a step of the surviving group without the lost one")
        job.start(1, args)
        restarted = job.started_at[1][-1]
        wait_for(lambda: job.check() and len(records(b)) > before, 60,
                 what="the restarted group's first step in the quorum")
        codes = [job.wait(g, timeout=400) for g in range(2)]
        logs = {g: job.log(job.current(g))[-4000:] for g in range(2)}
        job.stop_lighthouse()
        left = job.alive()
    assert codes == [0, 0], "\n".join(f"--- group {g} (exit {c}) ---\n{t}" for g, (c, t) in
                                      zip(range(2), (codes, logs)))
    assert left == [], f"processes left behind: {left}"
    ra, rb = records(a), records(b)
    rejoined = rb[before]
    assert rejoined["t"] > restarted and rejoined["quorum"] == 2 and rejoined["step"] > before, rejoined
    assert any(r["quorum"] == 1 for r in ra) and ra[-1]["quorum"] == 2 and ra[-1]["step"] == steps
    ft0, ft1 = _load(tmp_path / "ft0.pt"), _load(tmp_path / "ft1.pt")
    assert ft0["global_step"] == ft1["global_step"] == steps
    assert _bit_equal(ft0, ft1) == []
    assert ft1["summary"]["recoveries"] >= 1 and ft0["summary"]["participants_min"] == 1, (ft0, ft1)
    # every group read its own part of the data, and no sample twice (the restarted one continued at the
    # job's position, not at its part's start)
    seen0, seen1 = _samples(tmp_path, "ft0"), _samples(tmp_path, "ft1")
    assert len(set(seen0)) == len(seen0) and len(set(seen1)) == len(seen1)
    assert not set(seen0) & set(seen1)


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, names", [
    ({"shard_optimizer_state": True, "sharded_data_parallel_degree": 2}, "shard_optimizer_state"),
    ({"shard_optimizer_state": True}, "shard_optimizer_state"),
    ({"quantize_gradients": True}, "quantize_gradients"),
    ({"quantize_gradients": "error_feedback"}, "quantize_gradients"),
    ({"tensor_parallel_degree": 2}, "tensor_parallel_degree"),
    ({"fault_tolerance": "yes"}, "fault_tolerance"),
])
def test_options_it_rules_out_are_refused(options, names):
    from lightning_mics import MiCSStrategy
    from lightning_mics.fabric import MiCSStrategy as FabricMiCS

    for cls in (MiCSStrategy, FabricMiCS):
        with pytest.raises(ValueError, match=names):
            cls(**{"fault_tolerance": True, **options})


def test_a_shard_group_spanning_groups_is_refused():
    from lightning_mics.options import MiCSConfig

    with pytest.raises(ValueError, match="sharded_data_parallel_degree=4 .*a shard group cannot span groups"):
        MiCSConfig(sharded_data_parallel_degree=4, fault_tolerance=True).validate_world(2, 2)


@pytest.mark.parametrize("env, match", [
    ({}, "TORCHFT_LIGHTHOUSE"),
    ({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}, "REPLICA_GROUP_ID"),
    ({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1", "REPLICA_GROUP_ID": "0"}, "NUM_REPLICA_GROUPS"),
    ({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1", "REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "2"}, "not below"),
])
def test_the_environment_is_checked(monkeypatch, env, match):
    """Before any process is launched (``_configure_launcher``): a Trainer built under the wrong environment."""
    import lightning as L
    from lightning_mics import MiCSStrategy

    for k in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        L.Trainer(accelerator="cpu", devices=2, strategy=MiCSStrategy(fault_tolerance=True), logger=False)
