"""The soak, marked ``stress`` (CI's default run deselects it): ``python -m pytest -m stress
tests/stress/test_soak.py``. One real fit of tests/stress/soak.py on 4 CPU ranks, started as a user does (Lightning's
launcher): 2,000 optimizer steps, accumulation 4, validation every 100 steps, a sharded checkpoint every 500.

Sampled every 100 optimizer steps on every rank, after the step. Warm-up is the first 500 steps (five validations,
up to the first checkpoint save); after it, each rank's resident set stays within 5% (largest / smallest sample),
and at every sample no gathered parameter is alive (the engine's count and the storages the modules hold) and the
live process groups and threads are those of the first sample. Figures: benchmarks/LOG.md ("Soak").
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import REPO, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.stress]

STEPS, WARMUP, EVERY, CKPT_EVERY, RANKS = 2000, 500, 100, 500, 4


def test_soak_memory_and_groups_stay_flat(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
    log = tmp_path / "soak.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "stress" / "soak.py"), "--out", str(tmp_path)],
                                cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert proc.wait(timeout=3600) == 0, log.read_text()[-6000:]
            deadline = time.monotonic() + 120  # Lightning's launcher does not wait for the ranks it started
            while len(list(tmp_path.glob("soak*.json"))) < RANKS and time.monotonic() < deadline:
                time.sleep(1)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    results = [json.loads((tmp_path / f"soak{r}.json").read_text()) for r in range(RANKS)]
    saved = sorted(int(name.rsplit("step=", 1)[1].split(".")[0]) for name in results[0]["checkpoints"])
    assert saved == list(range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)), results[0]["checkpoints"]
    for res in results:
        samples = res["samples"]
        assert res["global_step"] == STEPS
        assert [s["step"] for s in samples] == list(range(EVERY, STEPS + 1, EVERY))
        after = [s["rss_kib"] for s in samples if s["step"] > WARMUP]
        assert max(after) <= 1.05 * min(after), (res["rank"], [(s["step"], s["rss_kib"]) for s in samples])
        first = samples[0]
        for s in samples:
            assert s["gathered"] == 0 and s["plain_bytes"] == 0, (res["rank"], s)
            assert s["groups"] == first["groups"] and s["os_threads"] == first["os_threads"], (res["rank"], s)
