import os

# Triton kernels run on CPU in the interpreter; this must be set before triton compiles anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The suite runs on two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup``): a test file whose
# tests share a fixture wider than one test (a module's launch of ranks, the built wheel) goes to one worker whole,
# so nothing is launched twice; any other test goes to whichever worker is free. The files that take longest start
# first so that both workers end together (a worker's seconds per file from ``--durations=0`` on the 2-core machine,
# 2026-12-03; a file not listed keeps its place after these, and a stale figure only costs time).
SLOW_FIRST = [
    "tests/trainer/test_reliability.py",  # 177 s
    "tests/trainer/test_lightning_compat.py",  # 155 s
    "tests/benchmarks/test_gpu_ready.py",  # 137 s
    "tests/fault_tolerance/test_fault_tolerance.py",  # 122 s
    "tests/app/test_many_hosts.py",  # 115 s
    "tests/fault_tolerance/test_ft_diloco.py",  # 112 s
    "tests/engine/test_compile.py",  # 99 s with inductor's cache empty (about 30 warm)
    "tests/trainer/test_weight_averaging.py",  # 98 s
    "tests/kernels/test_kernel_tables.py",  # 94 s
    "tests/app/test_train_app.py",  # 82 s
    "tests/comm/test_chained_collectives.py",  # 79 s
    "tests/comm/test_late_collectives.py",  # 75 s
    "tests/options/test_bad_inputs.py",  # 70 s
    "tests/fabric/test_fabric_litgpt.py",  # 67 s
    "tests/app/test_app_progress.py",  # 66 s
    "tests/engine/test_layouts.py",  # 66 s
    "tests/user_code/test_writes_between_steps.py",  # 64 s
    "tests/engine/test_equivalence.py",  # 63 s
    "tests/project/test_wheel.py",  # 61 s
    "tests/benchmarks/test_cluster_benchmark.py",  # 59 s
    "tests/benchmarks/test_gpu_checks.py",  # 55 s
    "tests/user_code/test_masters_moved.py",  # 52 s
    "tests/engine/test_quantized_training.py",  # 48 s
    "tests/checkpoint/test_sharded_checkpoint.py",  # 48 s
    "tests/kernels/test_quant_kernels.py",  # 47 s
]
_WIDE = ("module", "package", "session", "class")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group marks into work units
def pytest_collection_modifyitems(config, items):
    first = {f: i for i, f in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: a file's own order
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d.scope in _WIDE for ds in defs.values() for d in ds if d.baseid.startswith("tests/")):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
