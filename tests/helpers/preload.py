"""Imported once by the test launcher's fork server (``tests/helpers/launch.py``) before it forks any rank.

A module that fails to import here is left out of ``sys.modules``, so the rank that imports it later fails
with its own traceback in its log, as a fresh interpreter would: preloading only saves time.
"""

import atexit
import gc
import importlib

MODULES = ["torch", "torch.distributed", "lightning", "lightning_mics", "lightning_mics.fabric",
           "lightning_mics.app.models", "lightning_mics.app.schema", "hydra", "omegaconf", "tests.helpers.comm_mode",
           "tests.helpers.models", "tests.helpers.trainer_cases",
           "litgpt"]

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # the rank's own import reports it
        pass

# What was imported here is never garbage: moved out of the collector's generations, it is not traversed again by
# any rank's collections (a full one took 0.3 s of each fit's teardown). Put back at the server's exit, so
# that extensions which count their objects at shutdown (triton's nanobind) see them freed.
gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)
