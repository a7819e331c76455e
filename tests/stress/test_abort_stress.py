"""Stress checks of what fits leave behind (process groups, aborts at exit), marked ``stress``: CI's default run
deselects them (pyproject's addopts); run them with ``python -m pytest -m stress tests/stress``.

- the user's small fit (2 ranks, s=2, launched as `python script.py`) run N times in a row (default 50,
  LIGHTNING_MICS_STRESS_RUNS): every run, both ranks, must exit 0 ("terminate called without an active
  exception" at exit is a failure even when rank 0's status is 0);
- the same with a collective issued just before exit and a long GIL switch interval (the amplified race);
- two `Trainer.fit` calls with two layouts in one process: the live process groups do not grow.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.distributed, pytest.mark.stress]


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _stress(tmp_path, runs, *extra):
    cmd = [sys.executable, str(HERE / "run_abort_stress.py"), "--runs", str(runs), "--logdir", str(tmp_path), *extra]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=150 * runs)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert f"ok={runs}/{runs}" in proc.stdout


def test_small_fit_exits_cleanly_every_time(tmp_path):
    _stress(tmp_path, int(os.environ.get("LIGHTNING_MICS_STRESS_RUNS", "50")))


def test_small_fit_exits_cleanly_with_a_collective_just_before_exit(tmp_path):
    _stress(tmp_path, 5, "--env", "STRESS_SWITCH_INTERVAL=1.0", "--env", "STRESS_TAIL_COLLECTIVE=async")


def test_two_layouts_do_not_grow_the_live_groups(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "two_layouts.py")], env=_clean_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines() if line.startswith("GROUPS ")]
    assert len(records) == 2, proc.stdout[-4000:]
    for rec in records:
        assert rec["after_fit_s1"] <= rec["after_fit_s2"], rec  # a second layout adds no live group
