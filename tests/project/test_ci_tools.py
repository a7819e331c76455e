""".ci/cpu_seconds.py and .ci/process_census.py, the tools CONTRIBUTING.md measures the suite with, on a command whose
CPU is known: a parent and the child it forks each spin for a set CPU time, and the child outlives the parent."""

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO

# The parent spins 0.6 CPU-s, forks a child that spins 0.9 and is still spinning when the parent exits (an orphan).
BURN = """
import os, time
def spin(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
if os.fork() == 0:
    time.sleep(0.3); spin(0.9); os._exit(0)
spin(0.6)
"""


def _run(tool, *extra):
    proc = subprocess.run([sys.executable, str(REPO / ".ci" / tool), *extra, sys.executable, "-c", BURN],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_cpu_seconds_counts_the_orphan_too():
    cpu = float(re.search(r"cpu_s=([0-9.]+) wall_s=[0-9.]+ rc=0", _run("cpu_seconds.py")).group(1))
    assert 1.4 <= cpu <= 2.5, cpu  # 1.5 spun, plus the interpreter's start


@pytest.mark.skipif(os.geteuid() != 0, reason="process accounting (acct(2)) needs root")
@pytest.mark.xdist_group("process_accounting")  # one accounting file per machine: two censuses at once steal records
@pytest.mark.skipif("CENSUS_DIR" in os.environ, reason="a census of the suite is running: accounting is one per machine")
def test_process_census_records_each_process_by_kind(tmp_path):
    """Accounting's CPU times are samples at the kernel's ticks, which on a loaded machine may be far off for one
    short process (0.2 recorded for the 0.9 s spin, seen with five busy processes on two cores): the exact total
    comes from the kernel's clock; what the records must get right is which processes there were, and of what kind."""
    out = _run("process_census.py", "--keep", str(tmp_path))
    exact = float(re.search(r"exact CPU of all of it, from the kernel's clock: ([0-9.]+) s", out).group(1))
    assert 1.5 <= exact <= 2.5, out
    assert int(re.search(r"(\d+) processes, ([0-9.]+) CPU-s", out).group(1)) == 2, out
    assert re.search(r"fresh python\s+1\s", out), out  # the command
    assert re.search(r"other\s+1\s", out), out  # its child, which never exec'd and which no fork server made
    assert (tmp_path / "acct.bin").stat().st_size % 64 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="process accounting (acct(2)) needs root")
@pytest.mark.xdist_group("process_accounting")  # one accounting file per machine: two censuses at once steal records
@pytest.mark.skipif("CENSUS_DIR" in os.environ, reason="a census of the suite is running: accounting is one per machine")
def test_process_census_puts_each_process_on_its_test(tmp_path):
    """Run as a pytest command, the census's plugin logs each test's window: the interpreter a test starts is put on
    that test, and nothing on the test that starts none."""
    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys\n"
        "def test_starts_one():\n"
        f"    subprocess.run([sys.executable, '-c', {BURN!r}], check=True)\n"
        "def test_starts_none():\n"
        "    pass\n")
    proc = subprocess.run([sys.executable, str(REPO / ".ci" / "process_census.py"), sys.executable, "-m", "pytest",
                           "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_two.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_test = proc.stdout.split("CPU-s by test")[1]
    assert re.search(r"\n\s+[0-9.]+\s+0\.0\s+[0-9.]+\s+test_two\.py::test_starts_one\n", by_test), proc.stdout
    assert "test_starts_none" not in by_test, proc.stdout  # it started no process


@pytest.mark.parametrize("tool", ["cpu_seconds.py", "process_census.py"])
def test_ci_tools_given_no_command_print_their_use_and_run_nothing(tool, tmp_path):
    """``--help`` prints the module's docstring and exits 0; no command at all (or ``--keep`` alone) exits 2. Neither
    runs anything: before, the census ran ``--help`` as the command under process accounting."""
    calls = [(["--help"], 0), ([], 2)]
    if tool == "process_census.py":
        calls.append((["--keep", str(tmp_path / "kept")], 2))
    doc = ast.get_docstring(ast.parse((REPO / ".ci" / tool).read_text()), clean=False).strip()
    for extra, code in calls:
        proc = subprocess.run([sys.executable, str(REPO / ".ci" / tool), *extra], capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "CENSUS_DIR"})
        assert proc.returncode == code, (extra, proc.stdout + proc.stderr)
        assert proc.stdout.strip() == doc
    assert not (tmp_path / "kept").exists()
