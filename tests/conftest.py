import os

# Triton kernels run on CPU in the interpreter; this must be set before triton compiles anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
