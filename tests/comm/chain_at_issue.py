"""tests/engine/equiv.py with the second collective of every chain issued at once, as on NCCL
([Note: chained collectives] in lightning_mics/comm/collectives.py): on gloo the host waits for the first one at issue.
The same arguments as equiv.py; the results in the same files."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_mics.comm import collectives  # noqa: E402

collectives.CHAIN_AT_ISSUE = True
runpy.run_path(str(Path(__file__).resolve().parents[1] / "engine" / "equiv.py"), run_name="__main__")
