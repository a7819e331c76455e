"""tests/engine/equiv.py with one defect planted: a unit's all-gather output is read before its ``wait()`` (copied, then waited).
On gloo's prompt collectives that nearly always reads the right numbers; under the late-collectives device it must
not (tests/comm/test_late_collectives.py: the device can fail a run)."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.late_collectives import read_before_wait  # noqa: E402

with read_before_wait():
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "engine" / "equiv.py"), run_name="__main__")
