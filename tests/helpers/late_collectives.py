"""Collectives that finish late, as NCCL's do: a test device that delays real collectives (not a mock).

[Note: late collectives]
gloo runs an async collective at once on its own threads, so a buffer read before ``wait()``, written while the
collective is in flight, or freed early nearly always holds the right numbers on CPU; on NCCL the collective
runs later on its stream and the same code is silently wrong. Under ``LateCollectives(delay)`` every c10d op
(as the dispatcher sees it: ``allreduce_``, ``_allgather_base_``, ...) is queued on one worker thread per
process group, in issue order, and runs there no earlier than ``delay`` seconds after it was issued; the caller
gets a Work at once whose ``wait()`` blocks until the op has run. An op the table does not know (a functional
collective of DTensor's) first waits for every queued op, then runs at once. Ordering per group is the issue
order on every rank, so the ranks' collectives still match. A run must equal its run without the delay bit
for bit: a buffer read too early then holds stale numbers, one written in flight sends other numbers.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_create_work = torch._C._distributed_c10d._create_work_from_future


def _group_of(args: tuple, kwargs: dict) -> Optional[Any]:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue
    return None


def _outputs_of(func, args: tuple):
    """What the op returns beside its Work: its first argument (the output tensors, written in place)."""
    return args[0] if len(func._schema.returns) == 2 else None


class _Lane:
    """One process group's worker: runs its queued ops in issue order, each no earlier than its due time."""

    def __init__(self, name: str) -> None:
        self.jobs: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self.pending = 0
        self.cond = threading.Condition()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name=f"late-collectives-{name}", daemon=True)
        self.thread.start()

    def submit(self, due: float, run, fut: torch.futures.Future) -> None:
        with self.cond:
            self.pending += 1
        self.jobs.put((due, run, fut))

    def drain(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending == 0)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            due, run, fut = job
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            try:
                fut.set_result(run())
            except BaseException as e:  # the caller's wait() raises it
                self.error = e
                fut.set_exception(e)
            with self.cond:
                self.pending -= 1
                self.cond.notify_all()


class LateCollectives(TorchDispatchMode):
    """``with LateCollectives(0.05): ...``: every async c10d collective issued inside runs 50 ms late
    ([Note: late collectives]); a blocking one (``async_op=False``) runs in its group's order without the pause.
    ``issued`` counts the ops delayed, per c10d name. ``extra``: more delay for the async ops of some groups, by
    their ranks (a slow link: an op in flight there outlasts the other groups' steps)."""

    def __init__(self, delay: float, extra: Optional[Dict[Tuple[int, ...], float]] = None) -> None:
        super().__init__()
        self.delay, self.extra = delay, dict(extra or {})
        self.lanes: Dict[str, _Lane] = {}
        self.issued: Dict[str, int] = {}
        self._lock = threading.Lock()

    def _lane(self, group: Any) -> _Lane:
        with self._lock:
            lane = self.lanes.get(group.group_name)  # (unbox may hand out a new wrapper per op)
            if lane is None:
                lane = self.lanes[group.group_name] = _Lane(group.group_name)
            return lane

    def drain(self) -> None:
        for lane in list(self.lanes.values()):
            lane.drain()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        group = _group_of(args, kwargs) if func.namespace == "c10d" else None
        if group is None:  # compute, or a functional collective: after everything queued
            if func.namespace in ("c10d", "_c10d_functional", "_dtensor"):
                self.drain()
            return func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        arg_names = [a.name for a in func._schema.arguments]
        is_async = kwargs.get("async_op", args[arg_names.index("async_op")] if "async_op" in arg_names
                              and len(args) > arg_names.index("async_op") else True)
        slower = self.extra.get(tuple(dist.get_process_group_ranks(group)), 0.0) if self.extra else 0.0
        due = time.perf_counter() + (self.delay + slower if is_async else 0.0)
        if is_async:
            self.issued[name] = self.issued.get(name, 0) + 1

        def run() -> List[torch.Tensor]:
            out = func(*args, **kwargs)  # on the lane's thread: no mode there, the real collective
            work = out[1] if isinstance(out, tuple) else out
            work.wait()
            return []

        fut = torch.futures.Future()
        self._lane(group).submit(due, run, fut)
        work = _create_work(fut).boxed()
        outputs = _outputs_of(func, args)
        return work if outputs is None else (outputs, work)

    def __exit__(self, *exc) -> Any:
        try:
            self.drain()
        finally:
            for lane in self.lanes.values():
                lane.close()
            self.lanes.clear()
        return super().__exit__(*exc)


@contextlib.contextmanager
def read_before_wait() -> Iterator[None]:
    """A defect planted on purpose, to show the device can fail a run: inside, a unit's flat all-gather output is
    copied before its ``wait()`` (then waited for) and the copy used. On gloo's prompt collectives that nearly always
    holds the right numbers; under ``LateCollectives`` it must not."""
    import lightning_mics.comm.collectives as collectives

    real = collectives.gathered

    def early(res, log=None):
        if res.finish is None and res.output is not None:
            snapshot = res.output.clone()
            collectives.wait(res.work, log)
            return snapshot
        return real(res, log)

    collectives.gathered = early
    try:
        yield
    finally:
        collectives.gathered = real
