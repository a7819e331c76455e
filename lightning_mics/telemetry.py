"""Bytes per collective and group, counted where the collectives are issued.

Quantized collectives (``quantized.py``) record what they move in int8: a quantized replica all-reduce is one
``all_reduce/<group>`` call with its int8 wire buffer's bytes, scales included (an fp32 one records 4 bytes per
element), and a quantized all-gather hop its int8 output's bytes; the dispatcher sees that buffer once as an
all-to-all and once as an all-gather.

These counters are for users (callbacks, the logger, the benchmark report). Tests do not trust them: they
count c10d ops independently with a TorchDispatchMode (``tests/helpers/comm_mode.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Tuple


class CommLog:
    """Accumulates ``(op, group) -> [calls, bytes]``; ``step_summary`` returns and resets a window."""

    def __init__(self) -> None:
        self._window: Dict[Tuple[str, str], list] = defaultdict(lambda: [0, 0])
        self.gathered_elements = 0
        self.gathered_peak = 0
        self.wait_seconds = 0.0
        self.saved_bytes = 0  # saved for backward (tensors autograd keeps), this window
        self.offloaded_bytes = 0  # of which copied to host memory (activation_offload)

    def record(self, op: str, group: str, nbytes: int) -> None:
        entry = self._window[(op, group)]
        entry[0] += 1
        entry[1] += int(nbytes)

    def saved(self, nbytes: int) -> None:
        self.saved_bytes += nbytes

    def offloaded(self, nbytes: int) -> None:
        self.offloaded_bytes += nbytes

    def waited(self, seconds: float) -> None:
        self.wait_seconds += seconds

    def live(self, delta_elements: int) -> None:
        self.gathered_elements += delta_elements
        self.gathered_peak = max(self.gathered_peak, self.gathered_elements)

    def step_summary(self, reset: bool = True) -> Dict[str, float]:
        """Flat dict for ``self.log_dict``: ``comm/<op>/<group>/bytes`` and ``.../calls``, gathered peak."""
        out: Dict[str, float] = {}
        for (op, group), (calls, nbytes) in sorted(self._window.items()):
            out[f"comm/{op}/{group}/bytes"] = float(nbytes)
            out[f"comm/{op}/{group}/calls"] = float(calls)
        out["mem/gathered_elements_peak"] = float(self.gathered_peak)
        out["time/comm_wait_s"] = float(self.wait_seconds)
        out["mem/saved_for_backward_bytes"] = float(self.saved_bytes)
        out["mem/offloaded_bytes"] = float(self.offloaded_bytes)
        if reset:
            self._window.clear()
            self.gathered_peak = self.gathered_elements
            self.wait_seconds = 0.0
            self.saved_bytes = self.offloaded_bytes = 0
        return out
