"""The front ends' side of a fault-tolerant job ([Note: fault-tolerant replica groups] in options.py): when the
quorum is formed, what a step that a group failed in means, which state a joining group takes, and which part
of the data each group reads. The managed group itself is ``comm/managed.py``; the state, ``checkpoint/peer.py``.

[Note: the cross-group average]
Inside a group the engine runs as without fault tolerance (its world is the group's ranks, so there is no
replica all-reduce in it); after every backward that ends an accumulation window, the published gradients of
every trainable parameter (this rank's rows, and the replicated ones) are averaged across the quorum's groups in
one flat buffer per dtype, with one flag per parameter: a parameter with a gradient in any group gets one in all
(zeros where it had none), as in one process over the global batch, and one with none anywhere keeps ``None``.
The engine scaled each gradient by 1 / (its group's ranks); the manager divides the sum by the participants, so
the result is the average over every rank of the quorum. Clipping and the optimizer see only the average.

[Note: a step not taken]
``commit`` is decided after the closure (forward, backward, average) and before the optimizer step, by every
rank of the group alike. When it is False (a group died during the step, a transfer failed) the update is not
applied on this group and its gradients are dropped; under the Trainer the loop goes on (the step counts as a
loop step, as a step the loss scaler skips does), so every group's loop counters stay equal. A group that missed
a commit the others made is behind by one committed step and heals from a live peer at the next quorum.

[Note: joining at the current step]
The Trainer's quorum is formed at the first batch of each accumulation window, after the batch was fetched; a
group that starts (fresh, restarted, or resumed from a checkpoint) forms its first one at ``on_train_start``,
before any batch: if it is behind it takes a live peer's state there, the model's and optimizers' with the
learning-rate schedulers' and the fit loop's counters as the peer saved them at its last ``on_train_batch_end``
(the point a Lightning checkpoint is taken), so its loop resumes at the peer's batch, epoch and global step and
its sampler reads its own part of the data from there. Under Fabric the first quorum is formed when the optimizer
is set up and each next one right after a step's commit (under DiLoCo: right after the step before a sync step);
the loop's position is the user's, read from ``strategy.fault_tolerance.step_count``: the committed steps, or under
DiLoCo the inner steps, which a joining group takes from its peer.

[Note: the job's position in Fabric checkpoints]
Under Fabric ``fabric.save`` writes ``position()`` (the manager's committed steps, the inner steps) under the key
``fault_tolerance`` beside the user's state, and ``fabric.load`` restores it and leaves it out of the remainder, so
``step_count`` after a load is the checkpoint's: a whole job restarted from disk resumes its loop there, every group
from its own checkpoint. A group that took a live peer's state past step 0 is refused the load (it would roll back
the job).

[Note: DiLoCo across fault-tolerant groups]
With ``replica_sync="diloco"`` each group's engine runs its inner steps alone (its world is the group: r = 1 inside)
and nothing crosses the groups inside a window: no quorum, no gradient average, no commit per step. The quorum is
formed at the first batch of every step that ends with a send (``sends_next``: every ``sync_every``-th, or with
streaming fragments each fragment's send step; a group's first at ``on_train_start``, wherever its peers are; under
Fabric right after the step before it, and at setup); a group behind takes a live peer's state there, as the peer
stood after its previous step (no fragment in flight: the last one applied before this send, ``sync_delay`` < H / F):
masters, inner optimizer state, anchors, outer momentum, steps since the sync, the inner step count and the loop's
counters ([Note: joining at the current step]), so it takes that step on its own data. At its end ``OuterSync``
averages the pseudo-gradients (one flat fp32 buffer: the shard's or the fragment's) over the quorum's groups
through the manager (a lost group's survivors alone; with ``sync_delay`` in flight over the inner steps until its
apply), and ``should_commit`` decides the outer step at the apply ([Note: an outer step not taken] in
outer_sync.py). Taken from torchft: the Manager, its quorum, allreduce,
``should_commit`` and healing; not its DiLoCo class, which walks module parameters (here: the engine's flat shards)
and forms its quorum after the H-th step, where a joiner would take a state from mid-batch.
"""

from __future__ import annotations

import atexit
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from lightning_mics.checkpoint import peer
from lightning_mics.comm import collectives
from lightning_mics.comm.managed import GroupEnvironment, ManagedGroup
from lightning_mics.engine.engine import MiCSEngine
from lightning_mics.engine.outer_sync import OuterSync
from lightning_mics.layout.placement import local



def check_environment() -> GroupEnvironment:
    """torchft's environment for this group, checked before any process or group (ValueError otherwise)."""
    return GroupEnvironment.from_env()


def refuse_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One optimizer, whose step evaluates its closure once ([Note: a step not taken]): refused otherwise, on every
    rank alike, before any step."""
    if len(optimizers) != 1:
        raise ValueError(f"MiCSStrategy(fault_tolerance=True) got {len(optimizers)} optimizers: allowed is one "
                         "(one commit decision per optimizer step of the job).")
    if isinstance(optimizers[0], torch.optim.LBFGS):
        raise ValueError("MiCSStrategy(fault_tolerance=True) got torch.optim.LBFGS: allowed is an optimizer whose "
                         "step evaluates the closure once (the cross-group average runs once per step).")


class FaultTolerance:
    """A fault-tolerant job as one front end sees it ([Note: fault-tolerant replica groups] in options.py)."""

    def __init__(self, device: torch.device, quorum_timeout_s: float, bucket_numel: int) -> None:
        self.env = check_environment()
        self.group = ManagedGroup(self.env, device, quorum_timeout_s)
        self.bucket_numel = max(1, bucket_numel)
        self.engine: Optional[MiCSEngine] = None
        self.optimizers: List[torch.optim.Optimizer] = []
        self._extra_state: Optional[Callable[[], Dict[str, Any]]] = None
        self._extra_load: Optional[Callable[[Dict[str, Any]], None]] = None
        self.quorum_due = True  # [Note: one quorum per step] in comm/managed.py
        self.outer: Optional[OuterSync] = None  # [Note: DiLoCo across fault-tolerant groups]
        self.inner_steps = 0  # DiLoCo: the job's optimizer steps, committed syncs or not (a peer's, once joined)
        self._closed = False
        atexit.register(self.shutdown)  # Fabric never tears its strategy down: the manager's threads end here

    # -- what each group reads ----------------------------------------------------------------------------------
    @staticmethod
    def sampler_part(world: int, rank: int) -> Dict[str, int]:
        """This rank's part of the data: one of ``NUM_REPLICA_GROUPS x world`` parts, fixed by the group's id, so
        the parts of live groups never overlap and a lost group's part is not read until it is back."""
        env = check_environment()
        return {"num_replicas": world * env.groups, "rank": env.group * world + rank}

    # -- the state a peer takes ([Note: a peer's state] in checkpoint/peer.py) ---------------------------------
    def attach(self, engine: MiCSEngine, optimizers: Sequence[torch.optim.Optimizer],
               extra_state: Optional[Callable[[], Dict[str, Any]]] = None,
               extra_load: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        """The engine and optimizers whose state a joining peer takes; ``extra_state``/``extra_load``: the front
        end's own (the Trainer's schedulers and loop counters)."""
        refuse_optimizers(optimizers)
        self.engine, self.optimizers = engine, list(optimizers)
        self._extra_state, self._extra_load = extra_state, extra_load
        self.group.register(self._load, self._save)
        if engine.outer is not None:  # [Note: DiLoCo across fault-tolerant groups]
            self.outer = engine.outer
            self.outer.across = _OuterAcross(self)

    def _save(self) -> Dict[str, Any]:
        assert self.engine is not None
        state = peer.local_state(self.engine, self.optimizers)
        state["extra"] = self._extra_state() if self._extra_state is not None else {}
        state["inner_steps"] = self.inner_steps
        return state

    def _load(self, state: Dict[str, Any]) -> None:
        assert self.engine is not None
        peer.load_local_state(self.engine, self.optimizers, state)
        self.inner_steps = int(state.get("inner_steps", self.inner_steps))
        if self._extra_load is not None:
            self._extra_load(state.get("extra", {}))

    # -- the step ---------------------------------------------------------------------------------------------
    def quorum(self, now: bool = False) -> None:
        """This step's quorum, once per optimizer step ([Note: one quorum per step] in comm/managed.py); under DiLoCo
        once per sync, before its step unless ``now`` ([Note: DiLoCo across fault-tolerant groups])."""
        outer = self.outer
        if self.quorum_due and (now or outer is None or outer.sends_next()):
            self.quorum_due = False
            self.group.quorum()

    @torch.no_grad()
    def average_gradients(self, engine: MiCSEngine) -> None:
        """[Note: the cross-group average]. Every rank of every group in the quorum calls it at the same point."""
        if self.outer is not None:  # DiLoCo: no average inside a window, the outer sync's at its end
            return
        self.quorum()  # a step whose quorum no batch start formed (Fabric's first, a second step in one batch)
        started = time.monotonic()
        placed = [p for u in engine.units for p in u.all_params() if p.requires_grad]
        grads = [local(p.sharded.grad) if p.sharded.grad is not None else None for p in placed]
        device = engine.device
        flags = torch.tensor([g is not None for g in grads], dtype=torch.float32, device=device)
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(placed):
            by_dtype.setdefault(grads[i].dtype if grads[i] is not None else p.local.dtype, []).append(i)
        by_dtype.setdefault(torch.float32, [])  # the flags travel in an fp32 bucket
        buckets: List[tuple] = []  # (indices, flat, carries the flags)
        for dtype, idx in by_dtype.items():
            runs = collectives.bucket_runs([placed[i].local.numel() for i in idx], self.bucket_numel) or [[]]
            for r, run in enumerate(runs):
                members = [idx[k] for k in run]
                parts = [grads[i].reshape(-1) if grads[i] is not None else
                         torch.zeros(placed[i].local.numel(), dtype=dtype, device=device) for i in members]
                last_fp32 = dtype == torch.float32 and r == len(runs) - 1
                flat = torch.cat(parts + ([flags] if last_fp32 else [])) if parts or last_fp32 else None
                buckets.append((members, flat, last_fp32))
        works = [self.group.all_reduce_mean(flat) for _, flat, _ in buckets]
        for _, flat, _ in buckets:
            engine.log.record("all_reduce", "groups", flat.numel() * flat.element_size())  # the cross-group hop
        for work in works:
            work.wait()  # an error is recorded, not raised: the step is then not taken ([Note: a step not taken])
        summed = next(flat[flat.numel() - flags.numel():] for _, flat, carries in buckets if carries).cpu()
        for members, flat, _ in buckets:
            at = 0
            for i in members:
                p, n = placed[i], placed[i].local.numel()
                region = flat[at:at + n].view(p.local.shape)
                at += n
                if grads[i] is not None:
                    grads[i].copy_(region)
                elif float(summed[i]) > 0:
                    p.sharded.grad = p.wrap(region.clone())
        self.group.log.seconds["average"].append(time.monotonic() - started)

    def commit(self) -> bool:
        """Whether this step is taken ([Note: a step not taken]); its gradients are dropped when it is not."""
        ok = self.group.commit()
        self.quorum_due = True
        if not ok and self.engine is not None:
            for p in (p for u in self.engine.units for p in u.all_params()):
                p.sharded.grad = None
        return ok

    def step(self, closure: Callable[[], Any], run_step: Callable[[Callable[[], Any]], Any]) -> Any:
        """An optimizer step: the closure (forward, backward and the average), the commit decision, and, when it
        commits, ``run_step`` with a closure that returns the closure's result. Under DiLoCo ``run_step`` at once:
        the decision is the outer sync's ([Note: DiLoCo across fault-tolerant groups])."""
        if self.outer is not None:
            out = run_step(closure)
            self.stepped()
            return out
        result = closure()
        calls = [0]

        def evaluated() -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise ValueError("MiCSStrategy(fault_tolerance=True): the optimizer evaluated its closure twice in "
                                 "one step; allowed is an optimizer that evaluates it once.")
            return result

        if self.commit():
            return run_step(evaluated)
        return result

    def stepped(self) -> None:
        """Under DiLoCo, after each optimizer step: counted whether or not a sync at its end was committed."""
        self.inner_steps += 1

    @property
    def step_count(self) -> int:
        """Where a Fabric loop resumes after joining: the job's committed optimizer steps; under DiLoCo its inner
        steps (a sync not committed drops its window's update, not the window's steps)."""
        return self.group.step if self.outer is None else self.inner_steps

    # -- the job's position in a Fabric checkpoint ([Note: the job's position in Fabric checkpoints]) ----------
    def position(self) -> Dict[str, Any]:
        """What ``fabric.save`` writes beside the state: the manager's counters and the inner steps."""
        return {"manager": self.group.state_dict(), "inner_steps": self.inner_steps}

    def restore_position(self, position: Dict[str, Any], path: Any) -> None:
        """``fabric.load``'s side of ``position``; refused (ValueError, on every rank alike) once this group took a
        live peer's state past step 0, which is the job's current one and which the checkpoint would roll back (at
        step 0 every group takes the first group's fresh state: torchft's initial sync)."""
        if self.group.log.heals and self.step_count > 0:
            raise ValueError(f"MiCSStrategy(fault_tolerance=True): fabric.load({str(path)!r}) after this group took "
                             f"a live peer's state at step {self.step_count}: allowed is a load while "
                             "fault_tolerance.step_count is 0 after fabric.setup; a group that joins running peers "
                             "resumes from them, not from its checkpoint.")
        self.group.load_state_dict(position["manager"])
        self.inner_steps = int(position.get("inner_steps", self.inner_steps))

    # -- reports and the end -----------------------------------------------------------------------------------
    def summary(self) -> Dict[str, Any]:
        """The quorum as this group saw it: steps, committed and failed, participants, recoveries."""
        return {"group": self.env.group, "groups": self.env.groups, "committed_steps": self.group.step,
                "decisions": "steps" if self.outer is None else "outer syncs", **self.group.log.summary()}

    def shutdown(self, wait: bool = True) -> None:
        if not self._closed:
            self._closed = True
            atexit.unregister(self.shutdown)
            if self.outer is not None:  # the engine may outlive the manager (kept sharded after fit)
                self.outer.across, self.outer = None, None
            self.group.shutdown(wait=wait)
            self.engine, self.optimizers = None, []


class _OuterAcross:
    """``OuterSync``'s average across the groups ([Note: DiLoCo across fault-tolerant groups]): the sync's quorum if
    no batch start formed it, the manager's mean of one flat buffer, its commit decision."""

    def __init__(self, ft: FaultTolerance) -> None:
        self.ft = ft

    def quorum(self) -> None:
        self.ft.quorum(now=True)

    def average(self, flat: torch.Tensor, async_op: bool) -> Optional[Any]:
        """The mean over the quorum's groups, in place; ``async_op`` (a fragment's ``sync_delay``): the manager's
        work in flight, returned (int8 blocks: their first hop in flight, the second made at the wait)."""
        started = time.monotonic()
        outer, work = self.ft.outer, None
        if outer is not None and outer.quantize:  # int8 blocks, as over a replica group
            mean = self.ft.group.quantized_mean(flat, outer.block_size, outer.kernels, async_op)
            nbytes, work = mean.received, mean if async_op else None
        else:
            work = self.ft.group.all_reduce_mean(flat)  # an error is recorded, not raised: commit() is then False
            nbytes = flat.numel() * flat.element_size()
            if not async_op:
                work.wait()
                work = None
        if self.ft.engine is not None:
            self.ft.engine.log.record("all_reduce", "groups", nbytes)
        self.ft.group.log.seconds["average"].append(time.monotonic() - started)
        return work

    def commit(self) -> bool:
        ok = self.ft.group.commit()
        self.ft.quorum_due = True
        return ok


def progress_metrics(ft: FaultTolerance) -> Dict[str, float]:
    """What the progress bar shows of the quorum: the groups in the last step and the steps not taken so far."""
    log = ft.group.log
    return {"quorum": float(log.participants[-1]) if log.participants else math.nan,
            "ft_failed": float(len(log.committed) - sum(log.committed))}

