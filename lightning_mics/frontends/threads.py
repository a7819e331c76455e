"""Torch threads per rank, as Lightning's launcher sets them in its own process, for every rank: the ranks it starts
and those another launcher starts (torchrun, srun).

[Note: threads per rank]
Lightning's launcher sets ``max(1, cores // its ranks on the machine)`` torch threads (and ``OMP_NUM_THREADS``) in
its own process only, after starting the node's other ranks; those, and every rank torchrun or srun starts, take
every core, so ranks that share cores oversubscribe them. So on CPU, once the process group exists, the ranks
exchange (machine, usable cores), and a rank without ``OMP_NUM_THREADS`` takes ``max(1, its cores // the job's ranks
on its machine whose cores overlap its own)``: Lightning's figure for one launcher per machine, and right where
several share one (two torchrun agents on a node, hosts in network namespaces). The machine is its boot id. A set
``OMP_NUM_THREADS`` (the user's, Lightning's launcher's, torchrun's 1 for several ranks per host) is kept. On a GPU
nothing is exchanged: Lightning's figure over this node's ranks.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

Place = Tuple[str, FrozenSet[int]]  # (machine, the cores this rank may run on)


def machine_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def usable_cores() -> FrozenSet[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def threads_for(mine: Place, everyone: List[Place]) -> Tuple[int, int]:
    """(threads for this rank, ranks sharing its cores, itself included)."""
    machine, cores = mine
    sharing = max(1, sum(1 for m, c in everyone if m == machine and c & cores))
    return max(1, len(cores) // sharing), sharing


def set_threads_per_rank(device: torch.device, local_ranks: int, rank: int, log: logging.Logger) -> Optional[int]:
    """See [Note: threads per rank]. Collective on CPU (every rank calls it); returns the threads set, or None
    where ``OMP_NUM_THREADS`` was kept."""
    mine: Place = (machine_id(), usable_cores())
    if device.type == "cpu" and dist.is_available() and dist.is_initialized():
        everyone: List[Place] = [mine] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine] * max(1, local_ranks)
    if "OMP_NUM_THREADS" in os.environ:
        return None
    threads, sharing = threads_for(mine, everyone)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    log.info(f"[rank {rank}] torch threads: {threads} ({len(mine[1])} cores shared by {sharing} "
             f"rank{'s' * (sharing != 1)} of this job on this machine; OMP_NUM_THREADS was not set)")
    return threads
