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
# first so that both workers end together (seconds measured by ``--durations=0`` on the 2-core machine; a file not
# listed keeps its place after these, and a stale figure only costs time).
SLOW_FIRST = [
    "tests/app/test_train_app.py",  # 338 s
    "tests/engine/test_compile.py",  # 291 s
    "tests/trainer/test_reliability.py",  # 125 s
    "tests/trainer/test_weight_averaging.py",  # 111 s
    "tests/benchmarks/test_gpu_ready.py",  # 107 s
    "tests/trainer/test_lightning_compat.py",  # 106 s
    "tests/comm/test_late_collectives.py",  # 106 s
    "tests/engine/test_equivalence.py",  # 98 s
    "tests/fabric/test_fabric_litgpt.py",  # 88 s
    "tests/options/test_bad_inputs.py",  # 78 s
    "tests/kernels/test_triton_kernels.py",  # 72 s
    "tests/kernels/test_kernel_tables.py",  # 69 s
    "tests/app/test_app_progress.py",  # 66 s
    "tests/checkpoint/test_sharded_checkpoint.py",  # 59 s
    "tests/benchmarks/test_gpu_checks.py",  # 56 s
    "tests/user_code/test_writes_between_steps.py",  # 54 s
    "tests/comm/test_chained_collectives.py",  # 52 s
    "tests/engine/test_layouts.py",  # 51 s
    "tests/user_code/test_custom_optimizers.py",  # 46 s
    "tests/engine/test_quantized_training.py",  # 46 s
    "tests/project/test_wheel.py",  # 46 s
    "tests/benchmarks/test_single_gpu_benchmark.py",  # 42 s
    "tests/user_code/test_step_closure.py",  # 41 s
    "tests/user_code/test_masters_moved.py",  # 40 s
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
