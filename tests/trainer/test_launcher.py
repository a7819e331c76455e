"""The user's way: a plain `python script.py`; Lightning's own launcher starts the other rank."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO, free_port

pytestmark = pytest.mark.distributed


def test_trainer_launches_ranks_like_ddp(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "trainer" / "popen_fit.py"), str(tmp_path)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["steps"] == 3 for r in results)
    # after fit: the full state dict on rank 0, {} elsewhere (Lightning's sharded-strategy convention)
    assert results[0]["keys"] > 0 and results[1]["keys"] == 0
    assert results[0]["val"] == results[1]["val"]
