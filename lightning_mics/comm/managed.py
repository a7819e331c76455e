"""The replica group across fault-tolerant groups: torchft's Manager, its reconfigurable process group and its
checkpoint transport, as the strategy uses them ([Note: fault-tolerant replica groups] in options.py).

Each replica group is a torchrun job of its own; rank k of every group holds the same shard of the model state,
so rank k's Manager averages with rank k of the other groups (torchft's per-rank process group, rebuilt by every
new quorum) and heals from rank k of a live group (torchft's ``PGTransport`` over that same group). Nothing here
knows about units or parameters: the front ends hand it flat tensors and two functions for their state.

[Note: one quorum per step]
The manager runs with a synchronous quorum (``use_async_quorum=False``): ``quorum()`` returns when the lighthouse
has formed the quorum of this step and, if this group is behind the others (a fresh start, a restart, a commit it
missed), when it has loaded a live peer's state. So a group always enters its forward with the quorum's
parameters, takes full part in the step it joined at, and every group divides by the same participant count (the
quorum's groups). ``commit()`` (torchft's ``should_commit``) is agreed by every rank of the group: False when any
rank saw an error in the cross-group traffic or the peer transfer; the step is then not taken on this group, and
a group left behind by it heals at the next quorum. The lighthouse drops a group whose heartbeat stops
(``--heartbeat_timeout_ms``), so the survivors' next quorum forms without it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

import lightning_mics_kernels
from lightning_mics_kernels._quant_layout import quant_layout

_log = logging.getLogger("lightning.pytorch.strategies.mics")  # shown as Lightning's INFO lines are
_OPS_TIMEOUT_S = 60  # torchft's default for its collectives, should_commit and the peer transfer
ENV_LIGHTHOUSE, ENV_GROUP, ENV_GROUPS = "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"


def _env_int(name: str, minimum: int) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit() or int(value) < minimum:
        raise ValueError(f"MiCSStrategy option fault_tolerance=True needs the environment variable {name} (an "
                         f"integer >= {minimum}), got {value!r}: each replica group is a torchrun job started with "
                         f"{ENV_LIGHTHOUSE}, {ENV_GROUP} and {ENV_GROUPS} (docs/fault-tolerance.md).")
    return int(value)


@dataclass(frozen=True)
class GroupEnvironment:
    """Where this replica group stands, from torchft's environment variables."""

    lighthouse: str
    group: int  # REPLICA_GROUP_ID: 0 .. groups - 1, this group's part of the data
    groups: int  # NUM_REPLICA_GROUPS: the most groups the job runs with (the data is cut in that many parts)

    @classmethod
    def from_env(cls) -> "GroupEnvironment":
        """Raises ValueError naming the variable that is missing or wrong; also when torchft is not installed."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager and lighthouse clients log every step at info
        try:
            import torchft  # noqa: F401
        except ImportError:
            raise ValueError("MiCSStrategy option fault_tolerance=True needs torchft: pip install "
                             "'lightning-mics[ft]' (or pip install torchft).") from None
        lighthouse = os.environ.get(ENV_LIGHTHOUSE, "")
        if not lighthouse:
            raise ValueError(f"MiCSStrategy option fault_tolerance=True needs {ENV_LIGHTHOUSE}, the lighthouse's "
                             "address (e.g. http://10.0.0.1:29510), in every rank's environment; start one with "
                             "`torchft_lighthouse --min_replicas 1` (docs/fault-tolerance.md).")
        group, groups = _env_int(ENV_GROUP, 0), _env_int(ENV_GROUPS, 1)
        if group >= groups:
            raise ValueError(f"MiCSStrategy option fault_tolerance=True: {ENV_GROUP}={group} is not below "
                             f"{ENV_GROUPS}={groups}; allowed is 0 .. {groups - 1}.")
        return cls(lighthouse, group, groups)


@dataclass
class QuorumLog:
    """What the group saw: per optimizer step the quorum's groups and whether the step committed; when it healed
    from a peer, and how often a peer healed from it. ``summary`` is what the report and the progress bar show."""

    participants: List[int] = field(default_factory=list)  # per commit decision
    committed: List[bool] = field(default_factory=list)
    commit_times: List[float] = field(default_factory=list)  # time.time() of each decision
    heals: List[Dict[str, Any]] = field(default_factory=list)  # {"step", "seconds"}: loaded a live peer's state
    sent: int = 0  # how often a joining peer loaded this group's state
    seconds: Dict[str, List[float]] = field(default_factory=lambda: {"quorum": [], "average": [], "commit": []})

    def summary(self) -> Dict[str, Any]:
        parts = self.participants
        return {"steps": len(parts), "committed": sum(self.committed), "failed": len(parts) - sum(self.committed),
                "participants_min": min(parts) if parts else None, "participants_max": max(parts) if parts else None,
                "quorum_changes": sum(1 for a, b in zip(parts, parts[1:]) if a != b),
                "recoveries": len(self.heals), "peers_healed": self.sent,
                "heal_seconds": [round(h["seconds"], 3) for h in self.heals],
                "median_seconds": {k: round(statistics.median(v), 4) if v else None for k, v in self.seconds.items()}}


class ManagedGroup:
    """torchft's Manager for this rank: ``quorum`` before a step, ``all_reduce_mean`` of its gradients, ``commit``
    after ([Note: one quorum per step]). Build it on every rank after the default process group exists (the
    manager joins torchrun's store at ``MASTER_ADDR``/``MASTER_PORT``)."""

    def __init__(self, env: GroupEnvironment, device: torch.device, quorum_timeout_s: float) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        quiet = logging.getLogger("torchft")
        if quiet.level == logging.NOTSET:  # its lines per step and rank, unless the user set its level
            quiet.setLevel(logging.WARNING)

        self.env, self.device = env, device
        ops = timedelta(seconds=_OPS_TIMEOUT_S)
        self.pg = ProcessGroupNCCL(timeout=ops) if device.type == "cuda" else ProcessGroupGloo(timeout=ops)
        self._load: Optional[Callable[[Any], None]] = None
        self._save: Optional[Callable[[], Any]] = None
        self.log = QuorumLog()
        self._quorum_started: Optional[float] = None
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._on_load, state_dict=self._on_save, min_replica_size=1,
            use_async_quorum=False, timeout=ops, connect_timeout=ops,
            quorum_timeout=timedelta(seconds=max(_OPS_TIMEOUT_S, quorum_timeout_s)),
            rank=dist.get_rank(), world_size=dist.get_world_size(), lighthouse_addr=env.lighthouse,
            replica_id=f"mics_{env.group}", hostname=os.environ.get("MASTER_ADDR") or "localhost",
            checkpoint_transport=PGTransport(self.pg, timeout=ops, device=device))

    def register(self, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """This rank's state for a peer: ``save()`` (called on a quorum thread while this group's main thread waits
        for the quorum: no collective) and ``load(state)`` (on the main thread, before the step)."""
        self._load, self._save = load, save

    def _on_save(self) -> Any:
        assert self._save is not None, "ManagedGroup.register was not called"
        self.log.sent += 1
        return self._save()

    def _on_load(self, state: Any) -> None:
        assert self._load is not None, "ManagedGroup.register was not called"
        self._load(state)
        waited = time.monotonic() - self._quorum_started if self._quorum_started is not None else 0.0
        self.log.heals.append({"step": self.manager.current_step(), "seconds": waited})

    # -- the step ---------------------------------------------------------------------------------------------
    def quorum(self) -> None:
        """This step's quorum; heals this group first when it is behind ([Note: one quorum per step])."""
        self._quorum_started = time.monotonic()
        before = len(self.log.heals)
        self.manager.start_quorum()
        self.log.seconds["quorum"].append(time.monotonic() - self._quorum_started)
        if len(self.log.heals) > before and dist.get_rank() == 0:
            _log.info(f"[fault tolerance] group {self.env.group} healed from a live peer at step "
                      f"{self.manager.current_step()} ({self.log.heals[-1]['seconds']:.1f} s)")

    @property
    def participants(self) -> int:
        """Groups in this step's quorum (the divisor of the average)."""
        return self.manager.num_participants()

    @property
    def step(self) -> int:
        """Optimizer steps the job has committed (the peers' count after a heal)."""
        return self.manager.current_step()

    def all_reduce_mean(self, flat: Tensor) -> Any:
        """Starts the average of ``flat`` over the quorum's groups (in place; ``.wait()`` the returned work). An
        error is not raised: torchft records it and ``commit`` returns False."""
        return self.manager.allreduce(flat)

    def quantized_mean(self, flat: Tensor, block_size: int, kernels: str, async_op: bool = False) -> "QuantizedMean":
        """The mean of the fp32 ``flat`` over the quorum's groups through int8 blocks, in place: the two hops of
        [Note: quantized all-reduce] in quantized.py (an all-to-all of int8 chunks, each group's chunk summed and
        quantized again, an all-gather) over the manager's process group, so the mean is bit for bit the one
        ``quantized_all_reduce`` makes over a replica group of the same size. The first hop is issued here; the
        rest runs in the returned holder's ``wait()`` (here unless ``async_op``). An error is not raised: it is
        reported to the manager (``commit`` is then False) and ``flat`` is left as it is."""
        mean = QuantizedMean(self.manager, self.pg, flat, block_size, kernels)
        if not async_op:
            mean.wait()
        return mean

    def commit(self) -> bool:
        """Whether this step is taken: agreed by every rank of the group ([Note: one quorum per step])."""
        n = self.participants
        t0 = time.monotonic()
        ok = bool(self.manager.should_commit())
        self.log.seconds["commit"].append(time.monotonic() - t0)
        self.log.participants.append(n)
        self.log.committed.append(ok)
        self.log.commit_times.append(time.time())
        if dist.get_rank() == 0 and (not ok or (len(self.log.participants) > 1 and self.log.participants[-2] != n)):
            _log.info(f"[fault tolerance] group {self.env.group}: step {'committed' if ok else 'not taken'} with "
                      f"{n} group(s) in the quorum (committed steps: {self.step})")
        return ok

    def state_dict(self) -> Dict[str, int]:
        """The manager's counters, for checkpoints (a job resumed from disk continues the committed step count)."""
        return self.manager.state_dict()

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def shutdown(self, wait: bool = True) -> None:
        self.manager.shutdown(wait=wait)
        self.pg.shutdown()


class QuantizedMean:
    """``ManagedGroup.quantized_mean`` in flight: the all-to-all issued at construction, the sum, the all-gather
    and the division in ``wait()`` (once). ``received``: the bytes this rank takes in the first hop (telemetry)."""

    def __init__(self, manager: Any, pg: Any, flat: Tensor, block_size: int, kernels: str) -> None:
        self.manager, self.pg, self.flat, self.block_size, self.kernels = manager, pg, flat, block_size, kernels
        self.received, self.work, self.done = 0, None, True
        if manager.errored():
            return
        manager.wait_quorum()
        self.r = manager.num_participants()
        if self.r <= 1 or flat.numel() == 0:
            return
        try:
            self.layout = quant_layout(flat.numel(), block_size, self.r)
            self.sent = lightning_mics_kernels.quantize([flat], block_size, num_chunks=self.r, backend=kernels).wire
            self.recv = torch.empty_like(self.sent)
            self.work = pg.alltoall_base(self.recv.view(-1), self.sent.view(-1), [], [], AllToAllOptions())
            self.received, self.done = self.recv.numel(), False
        except Exception as e:  # torchft's allreduce does the same with its errors
            manager.report_error(e)

    def wait(self) -> Tensor:
        if self.done:
            return self.flat
        self.done = True
        r, block_size, kernels, flat = self.r, self.block_size, self.kernels, self.flat
        try:
            self.work.wait()
            part = torch.empty(self.layout.chunk, dtype=torch.float32, device=flat.device)
            lightning_mics_kernels.dequantize_sum(self.recv, r, block_size, out=part, backend=kernels)
            mine = torch.empty(self.sent.shape[1], dtype=torch.uint8, device=flat.device)
            lightning_mics_kernels.quantize([part], block_size, backend=kernels, out=mine)
            rows = torch.empty_like(self.sent)
            self.pg.allgather_into_tensor_coalesced([rows.view(-1)], [mine], AllgatherOptions()).wait()
            lightning_mics_kernels.dequantize(rows, [flat], block_size, num_chunks=r, backend=kernels)
            flat.mul_(1.0 / r)
        except Exception as e:
            self.manager.report_error(e)
        return flat
