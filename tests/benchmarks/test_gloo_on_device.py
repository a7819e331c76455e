"""benchmarks/gloo_on_device.py from a fresh clone, on CPU: every variant runs in its own pair of processes and is
reported; a variant that fails or hangs is reported failed, not as passing."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "benchmarks" / "gloo_on_device.py")


def rows(*args):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_variant_gathers_on_cpu():
    got = rows("--device", "cpu")
    assert [r["variant"] for r in got] == ["default_c10d", "mesh_c10d", "new_group_c10d", "default_funcol",
                                           "mesh_full_tensor"]
    assert all(r["ok"] and r["rc"] == [0, 0] for r in got), got


def test_a_variant_that_does_not_finish_is_reported_failed():
    (row,) = rows("--device", "cpu", "--variants", "default_c10d", "--timeout", "0.2")  # killed while importing
    assert not row["ok"] and -9 in row["rc"], row
