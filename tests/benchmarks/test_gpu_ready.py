"""benchmarks/gpu_ready.py runs from a fresh clone on CPU (``--accelerator cpu --small``): one JSON line per check
with commit / check / ok, every check that can run on CPU run in its reduced form and passing (the offload-dropout
equality, no descriptor table built after warm-up with kernels="triton" under TRITON_INTERPRET=1), the GPU-only
verdicts null with their reason; a check that fails writes ok=false and the next one runs; and the sanitizer's
machinery (ranks, collectives over host copies that finish late, the planted read it must catch) on CPU."""

import json
import re
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO

SCRIPT = REPO / "benchmarks" / "gpu_ready.py"
CHECKS = {"offload_dropout", "sanitizer", "sync_debug", "table_builds", "single_gpu_overhead", "triton_small_bucket"}


def _run(tmp_path, *extra, timeout=400):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--accelerator", "cpu", "--small", "--out-dir", str(tmp_path),
                           *extra], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "gpu_ready_cpu.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    printed = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{") and '"check"' in ln]
    assert printed == lines  # each line printed as it is written
    return {ln["check"]: ln for ln in lines}


@pytest.mark.distributed
@pytest.mark.triton
def test_every_check_writes_its_line_on_cpu(tmp_path):
    got = _run(tmp_path, "--budget", "900")
    assert set(got) == CHECKS
    for line in got.values():
        assert {"commit", "check", "ok", "device", "at", "wall_s"} <= set(line), line
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?|unknown", line["commit"]), line["commit"]
        assert line["device"] == "cpu"
        assert "error" not in line, (line["check"], line.get("error"))
    assert len({line["at"] for line in got.values()}) == 1  # one run

    off = got["offload_dropout"]
    assert off["ok"] is True and off["grads_equal_offloaded"] and off["rng_equal_offloaded"], off
    assert off["grads_equal_plain"] and off["rng_equal_plain"] and off["offloaded_bytes"] > 0

    tables = got["table_builds"]
    assert tables["ok"] is True and tables["builds_after_warmup"] == 0, tables
    assert tables["kernels"]["builds_after_warmup"] == 0 and tables["kernels"]["lookups_after_warmup"] > 0
    ranks = tables["engine"]["fp32_s2"]
    assert len(ranks) == 2 and all(r["builds_after_warmup"] == 0 and r["lookups_after_warmup"] > 0 for r in ranks)

    for name in ("sanitizer", "sync_debug", "single_gpu_overhead", "triton_small_bucket"):  # no verdict on CPU
        assert got[name]["ok"] is None and got[name]["reason"], got[name]
    sync = got["sync_debug"]
    assert sync["variants"] and not sync["errors"], sync
    if sync["host_reads_available"]:  # the loops ran, their host reads counted
        assert all("host_reads_engine" in v for v in sync["variants"].values()), sync
    overhead = got["single_gpu_overhead"]
    assert set(overhead["vs_bare"]) == {"mics", "fabric_mics"} and all(v > 0 for v in overhead["vs_bare"].values())
    bucket = got["triton_small_bucket"]
    assert bucket["outputs_bit_equal"] and len(bucket["cases"]) == 4 and bucket["tables_built_while_timed"] == 0


def test_a_failing_check_writes_ok_false_and_the_next_runs(tmp_path):
    """offload_dropout given 0.1 s (its process cannot even import torch in that time): ok=false with the reason;
    the sanitizer's line (no verdict on CPU) is written after it."""
    got = _run(tmp_path, "--checks", "offload_dropout", "sanitizer", "--timeout", "offload_dropout=0.1", timeout=120)
    assert set(got) == {"offload_dropout", "sanitizer"}
    assert got["offload_dropout"]["ok"] is False and "out of time" in got["offload_dropout"]["error"]
    assert got["sanitizer"]["ok"] is None and "CUDA" in got["sanitizer"]["reason"]


@pytest.mark.distributed
def test_sanitizer_machinery_on_cpu(tmp_path):
    """--sanitizer-dry-run: the Trainer and Fabric launches (2 ranks) with every collective over host copies, prompt
    and 30 ms late, equal bit for bit; the one-process layouts; a read before wait() planted, and caught."""
    got = _run(tmp_path, "--checks", "sanitizer", "--sanitizer-dry-run", timeout=300)["sanitizer"]
    assert got["ok"] is True and got["dry_run"], got
    assert not got["failed"] and not got["not_run"] and len(got["covers"]) == 5, got
    assert got["self_test"]["caught"] is True, got["self_test"]
    for part in ("trainer", "fabric"):
        p = got["parts"][part]
        assert p["cases"] and all(c["bit_equal"] and c["late_issued"] > 0 for c in p["cases"]), p
        assert p["host_copied"].get("_allgather_base_", 0) > 0 and not p["unrouted"], p


def test_device_slug():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_ready import device_slug

    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_slug("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert device_slug("cpu") == "cpu"
