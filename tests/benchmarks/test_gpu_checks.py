"""benchmarks/gpu_checks.py runs from a fresh clone (on CPU here: the same cases, the same comparisons, a tiny
GPT): the probe of gloo's collectives, and the plain process, MiCS and MiCS with grouped offloaded checkpointing,
each in its own process, compared with the plain process; and a speed case in two interleaved rounds."""

import json
import subprocess
import sys

from tests.helpers.launch import REPO


def test_gpu_checks_run_on_cpu_and_compare_with_the_plain_process(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_checks.py"), "--accelerator", "cpu",
                           "--cases", "probe", "plain", "mics", "zero1", "ac_offload", "speed_ac_offload", "--out",
                           str(out),
                           "--small", "2", "--steps", "1", "--warmup", "1", "--batch", "2", "--rounds", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads((out / "gpu_checks.json").read_text())["cases"]
    assert set(cases) == {"probe", "plain", "mics", "zero1", "ac_offload", "speed_ac_offload"}, cases
    assert all(cases["probe"][k] == "ok" for k in ("all_gather_single", "reduce_scatter_single", "all_reduce"))
    assert "error" not in cases["plain"], cases["plain"]  # the reference ran (its own difference is 0 by definition)
    for name in ("mics", "zero1", "ac_offload"):
        assert "error" not in cases[name], cases[name]
        assert cases[name]["max_abs_diff_vs_plain"] <= 1e-5, cases[name]  # clipping's norm sums in another order
    assert cases["ac_offload"]["max_abs_diff_vs_plain"] == cases["mics"]["max_abs_diff_vs_plain"]
    assert cases["zero1"]["max_abs_diff_vs_mics"] == 0.0  # one rank: its rows are the whole model
    speed = cases["speed_ac_offload"]  # two rounds, each its own process: the median of the two, and both
    assert [r["round"] for r in speed["rounds"]] == [1, 2] and speed["failed_rounds"] == 0, speed
    assert speed["step_ms_rounds"] == [r["step_ms"] for r in speed["rounds"]]
    assert speed["step_ms"] == sum(speed["step_ms_rounds"]) / 2 > 0
