"""equiv.py with one defect planted: a unit's all-gather output is read before its ``wait()`` (copied, then waited).
On gloo's prompt collectives that nearly always reads the right numbers; under the late-collectives device it must
not (tests/test_late_collectives.py: the device can fail a run)."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_mics.comm.collectives as collectives  # noqa: E402

_real = collectives.gathered


def read_before_wait(res, log=None):
    if res.finish is None and res.output is not None:
        snapshot = res.output.clone()
        collectives.wait(res.work, log)
        return snapshot
    return _real(res, log)


collectives.gathered = read_before_wait
runpy.run_path(str(Path(__file__).with_name("equiv.py")), run_name="__main__")
