"""Bytes per collective and group, counted where the collectives are issued.

Quantized collectives (``quantized.py``) record what they move in int8: a quantized replica all-reduce is one
``all_reduce/<group>`` call with its int8 wire buffer's bytes, scales included (an fp32 one records 4 bytes per
element), and a quantized all-gather hop its int8 output's bytes; the dispatcher sees that buffer once as an
all-to-all and once as an all-gather.

These counters are for users (callbacks, the logger, the benchmark report). Tests do not trust them: they
count c10d ops independently with a TorchDispatchMode (``tests/helpers/comm_mode.py``).

[Note: time waiting on communication]
``time/comm_wait_s`` is how long the computation stalled in the engine's waits for collectives (``waiting``). On
CPU (gloo) ``wait()`` blocks the host: host seconds. On CUDA ``wait()`` only makes the current stream wait, so the
host time is about 0; there it is the stream's stall, timed by two CUDA events recorded on the current stream
around each wait and read when they are done (at ``step_summary``, never with a synchronize): a wait whose events
are not done yet counts in a later window. The two-hop gather's first hop and the quantized all-reduce's
all-to-all are waited on a side stream ([Note: chained collectives] in collectives.py): stalls of no computation.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

_MAX_PENDING = 256  # event pairs kept before the done ones are read (bounds the list without a step_summary)


class CommLog:
    """Accumulates ``(op, group) -> [calls, bytes]``; ``step_summary`` returns and resets a window."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self._window: Dict[Tuple[str, str], list] = defaultdict(lambda: [0, 0])
        self.gathered_elements = 0  # the full parameters of the units gathered or gathering
        self.gathered_peak = 0
        self.live_elements = 0  # what the live cap counts: those units' buffers ([Note: live cap] in schedule.py)
        self.live_peak = 0
        self.wait_seconds = 0.0
        self.device = device  # where the waits stall: CUDA events there, else host time
        self._events: List[Tuple[Any, Any]] = []  # (start, end) around waits on CUDA, not read yet
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

    def bind(self, device: torch.device) -> None:
        """The device whose computation the waits stall (set by the units, on theirs)."""
        if self.device is None:
            self.device = device

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Times the wait inside ([Note: time waiting on communication])."""
        if self.device is None or self.device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self.wait_seconds += time.perf_counter() - t0
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._events.append((start, end))
        if len(self._events) > _MAX_PENDING:
            self._read_events()

    def _read_events(self) -> None:
        """Adds the stalls whose events are done; keeps the others, in order, for later."""
        left: List[Tuple[Any, Any]] = []
        for start, end in self._events:
            if not left and end.query():
                self.wait_seconds += start.elapsed_time(end) / 1000.0
            else:
                left.append((start, end))
        self._events = left

    def live(self, delta_elements: int, delta_gathered: int) -> None:
        """A unit's count under the live cap changed by ``delta_elements`` (its gather's buffers, its full storage),
        and the full parameters it holds gathered (or gathering) by ``delta_gathered``."""
        self.live_elements += delta_elements
        self.live_peak = max(self.live_peak, self.live_elements)
        self.gathered_elements += delta_gathered
        self.gathered_peak = max(self.gathered_peak, self.gathered_elements)

    def step_summary(self, reset: bool = True) -> Dict[str, float]:
        """Flat dict for ``self.log_dict``: ``comm/<op>/<group>/bytes`` and ``.../calls``, gathered peak."""
        out: Dict[str, float] = {}
        for (op, group), (calls, nbytes) in sorted(self._window.items()):
            out[f"comm/{op}/{group}/bytes"] = float(nbytes)
            out[f"comm/{op}/{group}/calls"] = float(calls)
        out["mem/gathered_elements_peak"] = float(self.gathered_peak)  # full parameters, as the planner predicts
        out["mem/live_elements_peak"] = float(self.live_peak)  # with the gathers' buffers: what the cap holds
        self._read_events()
        out["time/comm_wait_s"] = float(self.wait_seconds)  # [Note: time waiting on communication]
        out["mem/saved_for_backward_bytes"] = float(self.saved_bytes)
        out["mem/offloaded_bytes"] = float(self.offloaded_bytes)
        if reset:
            self._window.clear()
            self.gathered_peak = self.gathered_elements
            self.live_peak = self.live_elements
            self.wait_seconds = 0.0
            self.saved_bytes = self.offloaded_bytes = 0
        return out
