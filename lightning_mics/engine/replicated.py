"""Gradients of replicated parameters: bucketed world all-reduce, overlapped with backward, as DDP does.

[Note: replicated gradients]
Parameters below ``param_persistence_threshold`` (and every parameter when s == 1) are whole on every rank;
autograd accumulates their local gradient into the plain twin's ``.grad`` over a window's micro-batches. Buckets
are fixed runs of the trainable replicated parameters in reverse registration order (roughly backward's order),
of at most ``min(reduce_bucket_size, DDP's 25 MiB)``. In the boundary backward bucket k is all-reduced (async,
world group, pre-scaled by 1/W) once its parameters are all *ready* (post-accumulate-grad hook fired) and buckets
0..k-1 have gone, so every rank issues the same collectives in the same order. The last bucket also carries one
flag per trainable parameter of the model (did this rank produce a gradient in the window?) and goes at the end
of backward, when every flag is known, before anything is waited for (``launch_rest``, then ``finish``). After
the wait each sum is added to the DTensor's ``.grad`` (set where None); a parameter no rank produced a gradient
for keeps ``grad=None``, as in one plain process.

[Note: flags without a wait]
Reading a device tensor on the host waits for everything queued before it, and the host then has nothing queued
for the device while it catches up: a read per bucket, or an upload of each bucket's flags from pageable memory,
halves a single GPU's tokens/s against the bare loop. So with one rank nothing is summed, the flags never leave the
host, and the gradients are not copied into a bucket either (each goes to its DTensor parameter as it is). With
more, each bucket's flags go up pinned and non-blocking. A summed flag is at least this rank's own, so a rank that
produced every gradient knows every answer (yes) and reads nothing; a rank that lacks one reads every bucket's
summed flags in one copy after the last wait (the ``None`` of a gradient no rank produced is decided on the host).
Ranks that answer from their own flags and ranks that read agree: where a flag is this rank's, the sum is positive
on every rank.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mics.comm import collectives
from lightning_mics.layout.placement import ReplicatedParam, local
from lightning_mics.comm.telemetry import CommLog

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default


class _Launched(NamedTuple):
    params: List[ReplicatedParam]
    grads: List[Tensor]  # one flat gradient per parameter: views into ``buf``, or (one rank) the gradients as they are
    buf: Optional[Tensor]  # world > 1: the bucket's gradients followed by its flags, summed in place
    flags: Tensor  # this rank's flags (host): one per parameter of the bucket, then the extra ones
    work: Optional[dist.Work]


def _upload(flags: Tensor, device: torch.device) -> Tensor:
    """Host flags onto ``device`` without waiting for its stream (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return flags.to(device)
    return flags.pin_memory().to(device, non_blocking=True)


class ReplicatedReducer:
    def __init__(self, params: List[ReplicatedParam], group: Optional[dist.ProcessGroup], world_size: int,
                 bucket_numel: int, device: torch.device, log: CommLog, group_name: str = "world") -> None:
        self.params = list(reversed(params))  # [Note: replicated gradients]
        self.group, self.world_size, self.device, self.log = group, world_size, device, log
        self.group_name = group_name
        self.bucket_numel = max(1, min(bucket_numel, DDP_BUCKET_BYTES // 4))
        self._layouts: Dict[Tuple[bool, ...], List[List[ReplicatedParam]]] = {}
        self._buckets: Optional[List[List[ReplicatedParam]]] = None  # this pass's layout
        self._ready: set = set()
        self._launched: List[_Launched] = []

    def _layout(self) -> List[List[ReplicatedParam]]:
        key = tuple(rp.requires_grad for rp in self.params)
        layout = self._layouts.get(key)
        if layout is None:
            trainable = [rp for rp in self.params if rp.requires_grad]
            runs = collectives.bucket_runs([rp.local.numel() for rp in trainable], self.bucket_numel)
            # the last bucket exists even when empty: it carries the flags
            layout = [[trainable[k] for k in run] for run in runs] or [[]]
            self._layouts[key] = layout
        return layout

    def on_ready(self, rp: ReplicatedParam) -> None:
        """Post-accumulate-grad hook of a replicated parameter, in the boundary backward."""
        if self._buckets is None:
            self._buckets = self._layout()
        self._ready.add(id(rp))
        while len(self._launched) < len(self._buckets) - 1:  # the last bucket waits for the end of backward
            bucket = self._buckets[len(self._launched)]
            if not all(id(p) in self._ready for p in bucket):
                break
            self._launch(bucket, None)

    def _launch(self, bucket: List[ReplicatedParam], extra_flags: Optional[Tensor]) -> None:
        parts = [(local(rp.full.grad) if rp.full.grad is not None else torch.zeros_like(rp.local)).reshape(-1).float()
                 for rp in bucket]
        flags = torch.tensor([rp.full.grad is not None for rp in bucket], dtype=torch.float32)
        if extra_flags is not None:
            flags = torch.cat([flags, extra_flags.float()])
        work, buf, grads = None, None, parts
        if self.world_size > 1:  # the flags travel with the gradients ([Note: flags without a wait])
            buf = torch.cat(parts + [_upload(flags, self.device)])
            buf[: buf.numel() - flags.numel()].mul_(1.0 / self.world_size)
            work = collectives.all_reduce_sum(buf, self.group, async_op=True, log=self.log, group_name=self.group_name)
            grads = list(buf.split([p.numel() for p in parts] + [flags.numel()]))[:-1]
        self._launched.append(_Launched(bucket, grads, buf, flags, work))

    def launch_rest(self, extra_flags: Tensor) -> None:
        """End of the boundary backward: launches what is left, the last bucket with ``extra_flags`` (async;
        ``finish`` waits). Issued before the caller waits on anything else, so that this small all-reduce's
        latency overlaps the replica all-reduce's transfer ([Note: replica sync overlap] in gradients.py)."""
        buckets = self._buckets if self._buckets is not None else self._layout()
        self._buckets = buckets
        for k in range(len(self._launched), len(buckets)):
            self._launch(buckets[k], extra_flags if k == len(buckets) - 1 else None)

    def finish(self) -> Tensor:
        """Waits for every launched bucket, publishes the replicated gradients; returns, for each of the
        ``extra_flags`` of ``launch_rest``, a value > 0 where any rank set it (their sum over the world, or this
        rank's own flags where it set every one)."""
        for launched in self._launched:
            collectives.wait(launched.work, self.log)
        summed = [launched.flags for launched in self._launched]  # [Note: flags without a wait]
        if self.world_size > 1 and not all(bool(f.all()) for f in summed):
            n = [f.numel() for f in summed]  # a flag this rank lacks: every bucket's summed flags in one read
            summed = torch.cat([lb.buf[lb.buf.numel() - k:] for lb, k in zip(self._launched, n)]).cpu().split(n)
        extra = torch.zeros(0)
        for launched, flags in zip(self._launched, summed):
            for k, rp in enumerate(launched.params):
                if flags[k] > 0:
                    new = launched.grads[k].view_as(rp.local).to(rp.local.dtype)
                    if rp.sharded.grad is None:
                        rp.sharded.grad = rp.wrap(new)
                    else:
                        local(rp.sharded.grad).add_(new)
                rp.full.grad = None
            extra = flags[len(launched.params):]
        self._buckets, self._ready, self._launched = None, set(), []
        return extra

    def reset(self) -> None:
        self._buckets, self._ready, self._launched = None, set(), []
