"""One rank fails alone: the whole job ends within 60 s (not at the 30-minute collective timeout), non-zero, with
that rank's traceback in the output and no process of the job left ([Note: a lone failure] in reliability.py).

Each case is a real job of 2 ranks (tests/trainer/fail_fast.py) started the user's way: a plain ``python
script.py`` (Lightning's launcher starts the other rank) or ``torchrun``. Nothing here kills a rank: the job has to
end by itself. The 60 s bound is the specification (the issue's "Done when"), not a performance figure.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import lightning_mics
from tests.helpers.launch import REPO, free_port, run_ranks

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests" / "trainer" / "fail_fast.py"
BOUND_S = 60


def _job_pids(out):
    """Processes still running this job's script (their command line names the job's own folder)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if str(SCRIPT).encode() in cmd and str(out).encode() in cmd:
                pids.append(int(d))
    return pids


def _left_after(out, seconds=2.0):
    """The job's processes still running ``seconds`` after it ended (polled: no need to sleep them all out)."""
    deadline = time.monotonic() + seconds
    while _job_pids(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _job_pids(out)


def run_job(out, launcher, mode, fail_rank, linger=0.0):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    args = [str(out), "--mode", mode, "--fail-rank", str(fail_rank), "--linger", str(linger)]
    if launcher == "lightning":
        env["MASTER_PORT"] = str(free_port())
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(SCRIPT), *args]
    log = out / "job.log"  # a file, not a pipe: a lingering rank would hold a pipe open after the job ended
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=BOUND_S + 60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the job did not end:\n{log.read_text()[-4000:]}")
    ended = time.time()
    failed_at = out / "failed_at"  # written by the failing rank as it fails
    assert failed_at.exists(), log.read_text()[-3000:]
    return proc.returncode, ended - float(failed_at.read_text()), log.read_text()


CASES = [
    # (launcher, mode, failing rank, the failing rank's message)
    ("lightning", "step", 1, "injected failure in training_step on rank 1 at step 3"),
    ("lightning", "callback", 0, "injected failure in a callback on rank 0 at step 3"),
    ("torchrun", "step", 1, "injected failure in training_step on rank 1 at step 3"),
    ("torchrun", "callback", 0, "injected failure in a callback on rank 0 at step 3"),
    ("lightning", "save", 1, "injected failure while writing checkpoint shards"),
]


@pytest.mark.parametrize("launcher,mode,fail_rank,message", CASES, ids=[f"{c[0]}-{c[1]}-rank{c[2]}" for c in CASES])
def test_one_rank_raising_ends_the_job(tmp_path, launcher, mode, fail_rank, message):
    code, elapsed, output = run_job(tmp_path, launcher, mode, fail_rank)
    assert code != 0, output[-3000:]
    assert elapsed < BOUND_S, f"took {elapsed:.0f} s\n{output[-3000:]}"
    assert "Traceback" in output and message in output, output[-3000:]
    assert not list(tmp_path.glob("finished*")), "a rank finished fit although its peer had failed"
    assert not _left_after(tmp_path), "a process of the job was left running"
    if mode == "save":  # the first checkpoint (step 2) was published before the second save failed
        first = lightning_mics.consolidate(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
        assert first["global_step"] == 2 and all(torch.isfinite(v).all() for v in first["state_dict"].values())


@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_a_lingering_failed_rank_still_ends_the_job(tmp_path, launcher):
    """The failing rank stays alive 120 s after fit raised (a logger uploading, a script that catches the error):
    before this issue its peers waited for it in a collective until the 30-minute timeout (measured: Lightning's
    launcher still running at 100 s). Now its process groups are destroyed on the failure, the peers' collectives
    fail at once, and the job ends. With Lightning's launcher the lingering rank is a child the launcher does not
    kill: it ends by itself when its 120 s are up, and is killed here."""
    try:
        code, elapsed, output = run_job(tmp_path, launcher, "step", 1, linger=120)
        assert code != 0 and elapsed < BOUND_S, f"exit {code} after {elapsed:.0f} s\n{output[-3000:]}"
        assert "Connection closed by peer" in output or "injected failure" in output, output[-3000:]
    finally:
        for pid in _job_pids(tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_a_rank_killed_during_a_save_ends_the_job_and_keeps_the_previous_checkpoint(tmp_path):
    code, elapsed, output = run_job(tmp_path, "lightning", "save_kill", 1)
    assert code != 0 and elapsed < BOUND_S, f"exit {code} after {elapsed:.0f} s\n{output[-3000:]}"
    assert (tmp_path / "failed_mid_write").exists()
    assert not _left_after(tmp_path)
    first = lightning_mics.consolidate(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    assert first["global_step"] == 2
    assert not (tmp_path / "ckpts" / "epoch=0-step=4.ckpt").exists()


# -- non-finite numbers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite")
    return run_ranks(REPO / "tests" / "trainer" / "nonfinite.py", 4, ["--bad-rank", "1"], out)


def test_a_nonfinite_loss_on_one_rank_stops_every_rank_at_that_step(nonfinite):
    for r in nonfinite:
        got = r["loss"]
        assert "optimizer step 3 " in got["error"] and "loss on rank(s) [1]" in got["error"], got
        assert got["global_step"] == 3 and got["params_finite"], got  # stopped before the step applied


def test_a_nonfinite_gradient_with_a_finite_loss_stops_every_rank(nonfinite):
    for r in nonfinite:
        got = r["grad"]
        assert "optimizer step 3 " in got["error"] and "gradient norm" in got["error"], got
        assert "loss on rank" not in got["error"] and got["global_step"] == 3 and got["params_finite"], got


@pytest.mark.parametrize("phase", ["added", "added_manual"])
def test_a_nonfinite_loss_with_finite_gradients_stops_every_rank(nonfinite, phase):
    """Every backward's loss since the last step is checked, not only the closure's: a NaN added to the first of
    two accumulated micro-batches' loss, or under manual optimization (before, neither was seen: the step's closure
    held the boundary micro-batch's loss, or none)."""
    for r in nonfinite:
        got = r[phase]
        assert "optimizer step 3 " in got["error"] and "loss on rank(s) [1]" in got["error"], got
        assert "gradient norm" not in got["error"] and got["global_step"] == 3 and got["params_finite"], got


def test_off_by_default_nothing_stops(nonfinite):
    for r in nonfinite:
        assert r["off"]["error"] is None and r["off"]["global_step"] == 5 and not r["off"]["params_finite"]


def test_the_check_costs_one_small_all_reduce_when_on_and_nothing_when_off(nonfinite):
    """Counted from the dispatcher (every c10d op and its group): per optimizer step, the option on adds exactly
    one all-reduce over the world to the collectives of the option off, and changes nothing else."""
    for r in nonfinite:
        off, on = r["count_off"], r["count_on"]
        assert len(off) == len(on) == 3
        for step_off, step_on in zip(off, on):
            extra = list(step_on)
            for event in step_off:
                extra.remove(event)
            assert extra == [["all_reduce", [0, 1, 2, 3]]], (step_off, step_on)
