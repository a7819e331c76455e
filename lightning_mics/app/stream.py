"""The training stream: which samples each rank trains on, in which order, and where a resumed run continues it, on
the same number of ranks or another.

[Note: the training stream]
An epoch's stream is one permutation of the training set (``torch.randperm`` seeded with ``PL_GLOBAL_SEED`` plus
the epoch, as Lightning's ``DistributedSampler`` shuffles). With ``n`` = ranks x batch size, global batch ``g`` is
its positions ``[g n, (g + 1) n)``, and rank ``r`` takes positions ``g n + r + k W`` (``k`` < batch size), the
``DistributedSampler``'s stride: a run that never resumes trains on the batches it always did, and which samples
a global batch holds depends on ``n`` only, not on how many ranks share it. The epoch ends with its last whole
global batch; the remainder (fewer than ``n`` samples) is left out, so no sample is padded in or taken twice.

[Note: resuming the data]
Lightning resumes a fit mid-epoch from its loops' counters, but a plain DataLoader starts its epoch again from the
first batch. Lightning's hook for this (a train dataloader with state_dict/load_state_dict) is not restored when
configure_optimizers reads trainer.estimated_stepping_batches, and it counts the batches a loader produced, not
those trained on. So the sampler follows Lightning's own count: when an epoch's iteration
starts (lazily, at its first batch, after a checkpoint was read) it starts at position ``b n``, ``b`` being the
batches the epoch loop has already run in this epoch (0 in a fresh epoch). That is where the stopped run was when
its ``n`` was this run's: a checkpoint holds the ranks and batch size it trained with (the data module's state),
and a resume whose ``n`` differs is refused (``b`` batches of one ``n`` are not ``b`` of another, and the loop
counts batches); with the same ``n`` the ranks may be more or fewer (2 ranks x 16 continue on 4 x 8).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler


class StreamSampler(DistributedSampler):
    """Rank ``rank``'s part of the training stream ([Note: the training stream]), from the batch
    ``batches_done()`` says the epoch loop is at ([Note: resuming the data]); ``on_start(epoch, batches_done)``
    hears of each epoch's start."""

    def __init__(self, dataset: Dataset, batch_size: int, batches_done: Callable[[], int], seed: int,
                 num_replicas: int, rank: int, on_start: Optional[Callable[[int, int], None]] = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.per_batch = num_replicas * batch_size  # n: samples of one global batch
        self.batches = len(dataset) // self.per_batch  # whole global batches in an epoch
        self.batches_done = batches_done
        self.on_start = on_start

    def __len__(self) -> int:
        return self.batches * self.batch_size

    def __iter__(self) -> Iterator[int]:  # a generator: the body runs at the epoch's first batch, not at iter()
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g)
        done = self.batches_done()
        if self.on_start is not None:
            self.on_start(self.epoch, done)
        yield from order[done * self.per_batch + self.rank : self.batches * self.per_batch : self.num_replicas].tolist()


def position_state(ranks: int, batch_size: int) -> Dict[str, int]:
    """What a checkpoint keeps of the stream: the ranks and batch size its run trained with."""
    return {"ranks": ranks, "batch_size": batch_size}


def refusal(saved: Optional[Mapping[str, Any]], ranks: int, batch_size: int, where: str) -> Optional[str]:
    """Why a run of ``ranks`` x ``batch_size`` cannot continue the stream of a checkpoint whose data state is
    ``saved``, with the fix; None when it can (or the checkpoint does not say)."""
    if not saved or "ranks" not in saved or "batch_size" not in saved:
        return None
    n = saved["ranks"] * saved["batch_size"]
    if ranks * batch_size == n:
        return None
    fix = (f"give data.batch_size={n // ranks}" if n % ranks == 0 else
           f"no data.batch_size does on {ranks} ranks: run on a number of ranks that divides {n}")
    return (f"{where}: its run trained on global batches of {n} samples ({saved['ranks']} ranks x data.batch_size="
            f"{saved['batch_size']}), this one would take {ranks * batch_size} ({ranks} ranks x data.batch_size="
            f"{batch_size}). A resumed run continues the checkpoint's stream of samples only with global batches of "
            f"{n}: {fix}.")


def saved_data_state(path: str, key: str) -> Optional[Mapping[str, Any]]:
    """The data module's state (``key``: its class name) in the checkpoint at ``path``, a sharded directory (its
    ``meta.pt``) or one file (mapped, not read whole), read as untrusted input (``weights_only``); None if it holds
    none or cannot be read so (the data module checks it again when Lightning reads the checkpoint)."""
    p = Path(path)
    source = p / "meta.pt" if p.is_dir() else p
    if not source.is_file():
        return None
    try:
        meta = torch.load(source, map_location="cpu", weights_only=True, mmap=not p.is_dir())
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError):  # Lightning's own load reports it
        return None
    state = meta.get(key) if isinstance(meta, dict) else None
    return state if isinstance(state, Mapping) else None


def resumed_line(epoch: int, done: int, saved: Optional[Mapping[str, Any]], ranks: int, batch_size: int,
                 batches: int) -> str:
    """The one line that says where a resumed run continues the stream."""
    n = ranks * batch_size
    before = f"{saved['ranks']} ranks x {saved['batch_size']}" if saved and "ranks" in saved else "as now"
    return (f"[data] resumed in epoch {epoch} after {done} global batches of {n} samples ({before}): continuing at "
            f"sample {done * n:,} of the epoch's {batches * n:,}, on {ranks} ranks x data.batch_size={batch_size}")
