"""The main job keeps its progress: periodic ``last.ckpt``, resume with ``ckpt_path=``, Ctrl-C, a folder per job.

Real processes through the app's entry point with the tiny overrides (2 ranks on gloo; the resumed runs and their
references and the two jobs started together run forked from the test launcher's preloaded server, rank 1 started
fresh by Lightning's launcher; the Ctrl-C jobs start fresh, in a session of their own, as from a shell). The reference for a
resume is the same job run without interruption: its parameters and optimizer state after the same total number
of steps must be equal, bit for bit (same batches, same order of operations).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

from tests.helpers.app import (COMMAND, MICS_TINY, TINY, app_env, live_processes, run_app_forked, start_app,
                               wait_for)
from tests.helpers.launch import start_module

# 12 optimizer steps; a periodic save every 5 keeps epoch=0-step=5.ckpt and step=10 (save_top_k=-1), and last.ckpt
# holds step 12 (not a multiple of 5: the save at the step training ends on).
RESUMABLE = [*TINY, "trainer.max_steps=12", "trainer.val_check_interval=4",
             "callbacks.checkpoint.every_n_train_steps=5"]


def _state(ckpt: Path) -> Dict[str, torch.Tensor]:
    import lightning_mics

    full = lightning_mics.consolidate(ckpt)
    flat = {f"param/{k}": v for k, v in full["state_dict"].items()}
    for i, opt in enumerate(full["optimizer_states"]):
        for pid, state in opt["state"].items():
            flat.update({f"opt{i}/{pid}/{k}": torch.as_tensor(v) for k, v in state.items()})
    flat["global_step"] = torch.tensor(full["global_step"])
    return flat


def _assert_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, [(k, (a[k].double() - b[k].double()).abs().max().item()) for k in differ[:5]]


@pytest.mark.parametrize("variant", ["mics", "ddp", "mics-bf16"])
def test_resume_continues_as_the_uninterrupted_run(tmp_path: Path, variant: str) -> None:
    extra = {"mics": MICS_TINY, "ddp": ["strategy=ddp"],
             "mics-bf16": [*MICS_TINY, "trainer.precision=bf16-mixed"]}[variant]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    proc = run_app_forked([*RESUMABLE, *extra, "callbacks.checkpoint.save_top_k=-1", f"hydra.run.dir={whole}"],
                          cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    saved = sorted(p.name for p in (whole / "checkpoints").iterdir())
    assert saved == ["epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"], saved
    # Hydra's grammar needs the path quoted: it holds '='
    proc = run_app_forked([*RESUMABLE, *extra, f"ckpt_path='{whole}/checkpoints/epoch=0-step=5.ckpt'",
                           f"hydra.run.dir={resumed}"], cwd=tmp_path, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "dataloader is not resumable" not in out  # Lightning's warning is wrong for this loader and is silenced
    assert "[lr]" not in out  # the same schedule as the checkpoint's: nothing to say ([Note: the schedule on resume])
    report = json.loads((resumed / "report.json").read_text())
    assert report["start_step"] == 5 and report["steps"] == 12
    assert report["resumed_from"] == f"{whole}/checkpoints/epoch=0-step=5.ckpt"
    assert f"[report] resumed from {whole}/checkpoints/epoch=0-step=5.ckpt at optimizer step 5" in proc.stdout
    reference, continued = _state(whole / "checkpoints" / "last.ckpt"), _state(resumed / "checkpoints" / "last.ckpt")
    assert continued["global_step"].item() == 12
    assert reference["param/model.wte.weight"].dtype == torch.float32  # fp32 masters, also under bf16-mixed
    _assert_equal(reference, continued)


@pytest.mark.parametrize("target", ["process group", "rank 0 only"])
def test_ctrl_c_stops_saves_reports_and_exits_130(tmp_path: Path, target: str) -> None:
    """SIGINT to the whole process group (Ctrl-C in a terminal) or to rank 0 alone (``kill -INT``): every rank
    stops after the same optimizer step, ``last.ckpt`` holds that step, the report is written, the job exits with
    130 and leaves no process behind; ``ckpt_path=`` then continues from that step (run once)."""
    run_dir = tmp_path / "run"
    args = [*TINY, *MICS_TINY, "trainer.max_steps=100000", "callbacks.checkpoint.every_n_train_steps=3",
            f"hydra.run.dir={run_dir}"]
    proc = start_app(args, tmp_path, tmp_path / "job.log")
    try:
        wait_for(run_dir / "checkpoints" / "last.ckpt", 180, proc)  # training runs: the first periodic save exists
        time.sleep(0.5)
        if target == "process group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = (tmp_path / "job.log").read_text()
    assert rc == 130, out[-6000:]
    deadline = time.monotonic() + 15  # the launched rank exits on its own, right after rank 0
    while live_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_processes(proc.pid), (live_processes(proc.pid), out[-3000:])

    report = json.loads((run_dir / "report.json").read_text())
    step = report["steps"]
    assert report["stopped_by"] == "Ctrl-C (SIGINT)" and 3 <= step < 100000
    assert report["last_checkpoint"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert _state(run_dir / "checkpoints" / "last.ckpt")["global_step"].item() == step  # loadable, at the stop step
    assert "[Ctrl-C] stopping after this optimizer step" in out
    assert f"[report] stopped by Ctrl-C (SIGINT) after optimizer step {step}" in out
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"[checkpoint] optimizer step {step} saved in {last}; continue with ckpt_path={last}\n" in out, out[-3000:]
    if target != "process group":
        return
    resumed = tmp_path / "resumed"
    proc = run_app_forked([*TINY, *MICS_TINY, f"trainer.max_steps={step + 2}",
                           f"ckpt_path={report['last_checkpoint']}", f"hydra.run.dir={resumed}"], cwd=tmp_path,
                          timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    again = json.loads((resumed / "report.json").read_text())
    assert again["start_step"] == step and again["steps"] == step + 2 and again["stopped_by"] is None


def test_two_jobs_started_together_never_share_a_folder(tmp_path: Path) -> None:
    """Both with Hydra's default folder name (the second of the start), from the same folder. They are two
    optimizer steps long with the loss logged every 10: also a run that logged nothing draws no plot. Both jobs'
    rank 0 are forked from the test launcher's server at once (``run_app_forked``'s way: the folders they claim
    are checked, not how a job starts; each one's rank 1 is started fresh by Lightning's launcher)."""
    args = [*TINY, "trainer.max_steps=2", "trainer.log_every_n_steps=10", "trainer.val_check_interval=50"]
    procs = [start_module(COMMAND[2], args, app_env(), tmp_path, tmp_path / f"job{i}.stdout",
                          tmp_path / f"job{i}.stderr") for i in range(2)]
    for p in procs:
        p.wait(timeout=240)
    logs = [(tmp_path / f"job{i}.stdout").read_text() + (tmp_path / f"job{i}.stderr").read_text()
            for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]
    run_dirs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(run_dirs) == 2, run_dirs
    written = sorted(line.split("written to ")[1].split("/report.md")[0] for log in logs
                     for line in log.splitlines() if "written to" in line)
    assert written == [str(d) for d in run_dirs]
    for d in run_dirs:
        assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["last.ckpt"]
        assert not (d / "loss.png").exists() and "No loss was logged" in (d / "report.md").read_text()
    assert not any("No artists with labels" in log for log in logs)


def test_a_folder_is_claimed_once(tmp_path: Path) -> None:
    """The claim itself: of many jobs racing for one name, each gets its own folder; a folder the user named that
    exists is refused, before Hydra writes anything into it."""
    from lightning_mics.app.runs import claim_folder
    from lightning_mics.app.schema import UsageError

    base, got = str(tmp_path / "outputs" / "12-00-00"), []
    threads = [threading.Thread(target=lambda: got.append(claim_folder(base, False, "hydra.run.dir")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted([base] + [f"{base}-{i}" for i in range(1, 8)])
    with pytest.raises(UsageError, match="already exists"):
        claim_folder(base, True, "hydra.run.dir")

    taken = tmp_path / "taken"
    taken.mkdir()
    proc = run_app_forked([*TINY, f"hydra.run.dir={taken}"], cwd=tmp_path)  # (the answer is checked: forked)
    assert proc.returncode != 0 and f"hydra.run.dir='{taken}' already exists" in proc.stderr, proc.stderr[-3000:]
    assert list(taken.iterdir()) == []
