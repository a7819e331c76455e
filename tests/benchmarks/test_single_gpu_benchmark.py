"""benchmarks/single_gpu.py runs from a fresh clone: each case in its own process, the same batches, and the
strategy's parameters at s = r = 1 equal the bare loop's, as the FSDP2 peer's do (on CPU the mixed precision is the
same autocast)."""

import json
import subprocess
import sys

from tests.helpers.launch import REPO


def test_single_device_benchmark_runs_and_matches_the_bare_loop(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "single_gpu.py"), "--configs", "tiny",
                           "--cases", "bare", "fsdp2", "mics", "--steps", "4", "--warmup", "1", "--accelerator", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads((out / "single_gpu.json").read_text())}
    assert set(rows) == {"bare", "fsdp2", "mics"}, rows
    for r in rows.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
    assert rows["mics"]["vs_bare"] <= 1e-6, rows["mics"]
    assert rows["fsdp2"]["vs_bare"] <= 1e-6, rows["fsdp2"]  # the peer's case trains the same model too
    assert (out / "single_gpu.md").exists() and (out / "single_gpu.png").exists()
