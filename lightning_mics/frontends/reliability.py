"""What one rank's failure does to the others, and the check that stops a job at non-finite numbers.

[Note: a lone failure]
A rank that raises alone (an out-of-memory error in its ``training_step``, a bad batch, a callback on rank 0
only) leaves its peers blocked in the next collective, which it never joins. Under gloo they are freed only when
its sockets close: ``ProcessGroup.abort()`` does not close them; destructing its process groups does, at process
exit, or never while the process lingers (a logger uploading, a script that catches the error and carries on),
and then the peers wait out ``timeout`` (30 minutes by default). So on a lone failure (told apart by
[Note: a failure on every rank]) the rank destroys every process group and drops the last references: each peer's
pending collective fails within milliseconds ("Connection closed by peer"), ends its own ``fit`` with an error and
its process exits; the job ends with the failing rank's traceback. Out of reach: an asynchronous collective of the
failing rank that no peer will match makes destructing its group wait for it; the engine's schedule issues the
same collectives in the same order on every rank, so a prefetch in flight is matched by the peers' own.

[Note: a failure on every rank]
A failure on *every* rank alike (the same error at the same step) must leave the groups alone: the user may catch
it and ``fit`` again in the same process, as under DDP. So on an exception each rank adds one to a counter in the
default group's store (a TCP key-value store, not a collective: it answers while the groups are blocked) and waits
up to ``GRACE_S`` for it to reach the world size (rank 0, the store's host, then waits for every rank to have seen
it). Every rank failed: the groups stay. Not all within the grace, or the store is gone (its host died): a lone
failure. Ranks that fail alike reach their exception within a step of each other (every unit's gather keeps them in
lockstep), far below the grace. The engine is put back after that answer: after a failure alike it may still wait,
bounded, for what every rank issued ([Note: rows when a run ends] in optimizer_rows.py); after a lone one it waits
for nothing.

[Note: a dead rank on NCCL]
[Note: a lone failure] holds on gloo, where a peer blocks in a host call. On NCCL a peer blocks on the GPU: its
kernel waits for a rank that never joins while its host runs ahead until it next reads device data. Three things
end such a job. (1) The launcher: the failing rank destroys its groups (NCCL: its communicators are aborted) and
exits; torchrun's agent then kills every other worker, and Lightning's launcher kills its child ranks when one
exits non-zero (every 5 s; a failed rank 0 is the launcher itself: its children are left to (3)). (2) NCCL: a
transport that sees the peer's connection close reports an asynchronous error, and torch's watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, by default abort and end the process) ends that rank. (3) ``timeout``: the
watchdog aborts a collective that runs longer, on every group ([Note: the timeout of every group] in
frontends/shared.py). The engine sets no NCCL variable: blocking waits would stall the host at every step. Not
run on several GPUs: there, use torchrun and a ``timeout`` near the longest healthy collective (checkpoints too).

[Note: host reads per step]
A host read of device data waits for the device's queued work. A steady-state optimizer step reads only: with
``stop_on_nonfinite`` the world's summed flags, once (``check_finite``: who and what come from that read); with rows
over replicas the units' summed changed-flags, once per forward that no step precedes ([Note: rows between steps]
in optimizer_rows.py); with Fabric's ``clip_gradients(error_if_nonfinite=True)`` the norm, once. Host memory,
no wait: the flags of [Note: flags without a wait] (replicated.py, ``publish``) and torch's step counts. Clipping,
ZeRO-1's shown gradients, int8 blocks and offload read nothing.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics.layout.topology import release_all_groups
from lightning_mics.layout.placement import local

GRACE_S = 5.0  # [Note: a failure on every rank]
_POLL_S = 0.05
_failures = 0  # exceptions seen by this process: the store key of each, the same on ranks that fail alike


def every_rank_failed(grace: float = GRACE_S) -> bool:
    """Counts this rank's failure in the store and waits up to ``grace`` seconds for every rank's."""
    global _failures
    key = f"lightning_mics/failures/{_failures}"
    _failures += 1
    world = dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        count = store.add(key, 1)
        deadline = time.monotonic() + grace
        while count < world and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            count = store.add(key, 0)
        if count >= world:  # the store's host stays until every rank has seen the count, or its peers would
            seen, host = f"{key}/seen", dist.get_rank() == 0  # read a closed store and take it for a lone failure
            store.add(seen, 1)
            while host and store.add(seen, 0) < world and time.monotonic() < deadline:
                time.sleep(_POLL_S)
    except Exception:  # the store's host (rank 0) is gone: a peer failed too, but not this way
        return False
    return count >= world


def on_failure(reset: Callable[[bool], None], grace: float = GRACE_S) -> bool:
    """On an exception in ``fit``/``validate``/...: ``reset(on_every_rank)`` puts the engine back (``on_every_rank``:
    every rank failed the same way, so the groups stay and every rank issued the same collectives); then, unless so, every
    process group is destroyed so that the peers' collectives fail now rather than at ``timeout``. True if the
    groups were destroyed."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    on_every_rank = not distributed or every_rank_failed(grace)
    reset(on_every_rank)
    if on_every_rank:
        return False
    release_all_groups()
    return True


# -- non-finite numbers -----------------------------------------------------------------------------------------
class NonFiniteError(RuntimeError):
    """Raised on every rank at once by ``MiCSStrategy(stop_on_nonfinite=True)``."""


def _local_flags(loss: Optional[Tensor], params: Sequence[torch.nn.Parameter], device: torch.device) -> Tensor:
    """(loss is non-finite, this rank's gradient shards hold a non-finite value), as a float tensor on ``device``
    computed there: nothing read back ([Note: host reads per step])."""
    flags = torch.zeros(2, dtype=torch.float32, device=device)
    if isinstance(loss, Tensor):
        flags[0] = (~torch.isfinite(loss.detach()).all()).to(device)
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads], 2.0)
        flags[1] = (~torch.isfinite(torch.stack(norms)).all()).to(device)
    return flags


class Losses:
    """``stop_on_nonfinite``: the loss of every backward since the last optimizer step (a Trainer's closures and
    ``manual_backward``, ``fabric.backward``), so a non-finite loss whose gradients are finite is seen too."""

    def __init__(self) -> None:
        self.seen: List[Tensor] = []

    def add(self, loss: Tensor) -> None:
        self.seen.append(loss.detach().float().reshape(-1))

    def take(self) -> Optional[Tensor]:
        seen, self.seen = self.seen, []
        return torch.cat(seen) if seen else None


def checked(closure: Callable[[], Any], optimizer: torch.optim.Optimizer, step: Callable[[], int],
            device: torch.device, losses: Losses) -> Callable[[], Any]:
    """``stop_on_nonfinite``: ``closure`` followed by :func:`check_finite` of ``losses`` (the closure's own among
    them) and the gradients (after the boundary micro-batch's forward and backward, gradients reduced; before
    clipping and the optimizer step)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def run() -> Any:
        loss = closure()
        check_finite(losses.take(), params, step(), device)
        return loss

    return run


@torch.no_grad()
def check_finite(loss: Optional[Tensor], params: Sequence[torch.nn.Parameter], step: int,
                 device: torch.device) -> None:
    """One all-reduce of 2 x world flags over the world; raises :class:`NonFiniteError` on every rank if any rank
    saw a non-finite loss or gradient. The gradient norm is non-finite exactly when some rank's shard holds a
    non-finite value (after the replica all-reduce every replica holds the same shards), so the union of local
    checks is the global one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = torch.zeros(2, world, dtype=torch.float32, device=device)
    flags[:, rank] = _local_flags(loss, params, device)
    if world > 1:
        dist.all_reduce(flags)
    seen = flags.tolist()  # the one read of the step ([Note: host reads per step])
    bad_loss = [r for r in range(world) if seen[0][r] > 0]
    bad_grad = [r for r in range(world) if seen[1][r] > 0]
    if not bad_loss and not bad_grad:
        return
    what = []
    if bad_loss:
        what.append(f"loss on rank(s) {bad_loss}")
    if bad_grad:
        what.append(f"gradient norm (non-finite shards on rank(s) {bad_grad})")
    raise NonFiniteError(
        f"MiCSStrategy(stop_on_nonfinite=True): non-finite {' and '.join(what)} at optimizer step {step} "
        f"(trainer.global_step); stopped before that step updated the parameters ({step} steps taken).")
