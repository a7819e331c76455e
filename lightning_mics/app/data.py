"""A byte-level text corpus as a LightningDataModule: no downloads, no tokenizer.

By default the corpus is the Python standard library's own ``.py`` sources (they exist on every machine that
runs this code), read in sorted path order and capped at ``max_bytes``; ``path=`` takes any text file or folder
instead. Every byte is a token (vocabulary 256).

Split (deterministic, no randomness): the corpus is cut into pieces of ``piece_bytes``; every
``round(1 / val_fraction)``-th piece goes to validation, the rest to training, so both splits sample the whole
corpus rather than its first and last files. Each split is then served as fixed-length windows of
``block_size + 1`` bytes (input = the first ``block_size``, target = the last ``block_size``), windows starting
every ``block_size`` bytes so that every byte is a target once.

The corpus is listed and checked when the module is built (in the main job: before any rank starts): a missing
path, an empty file or folder, a binary file or a folder of binary files only, or too little text for the split
each raise :class:`CorpusError` naming ``data.path``, what was found there and the fix. ``setup`` logs, on rank 0,
one ``[data]`` line: the bytes and files read, from where, whether ``data.max_bytes`` cut the corpus, and the
split. Training batches come from ``stream.py``, the same global batches on any number of ranks
([Note: the training stream] in stream.py); a resumed fit, on the same ranks or others, continues at the sample
it stopped on ([Note: resuming the data] in stream.py).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mics.app import stream

_log = logging.getLogger("lightning_mics.app")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


class CorpusError(ValueError):
    """The corpus named by ``data.path`` cannot give a training set; the message says what was found and the fix."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _all_files(root: Path) -> List[Path]:
    """Regular files under ``root``, sorted by relative path (so the same on every machine with the same files),
    skipping installed packages, caches and VCS folders."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: site-packages can be huge
        files.extend(Path(dirpath, f) for f in filenames)
    return sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def _files(n: int) -> str:
    return f"{n} file" + "s" * (n != 1)


@dataclass(frozen=True)
class Corpus:
    """The files to read, in order, and how many of their bytes (at most ``max_bytes``)."""

    files: Tuple[Path, ...]
    nbytes: int
    source: str  # for the report and the messages
    available: int = 0  # bytes of every file the path and glob select (binary ones included)
    matching: int = 0  # files the path and glob select
    binary: int = 0  # of those looked at, the binary ones left out
    cut: bool = False  # data.max_bytes left text out (a file read in part, or files not read)
    pattern: Optional[str] = None  # the glob, for a folder
    root: str = ""  # the folder

    def describe(self, max_bytes: int) -> str:
        """What was read: bytes, files, from where, and whether ``data.max_bytes`` cut it."""
        where = (f"{self.files[0].absolute()}" if self.pattern is None else
                 f"{_files(len(self.files))} under {Path(self.root).absolute()} matching {self.pattern!r}")
        skipped = f", {self.binary} binary file{'s' * (self.binary != 1)} left out" if self.binary else ""
        if self.cut:
            held = f"its {self.available:,} bytes" if self.pattern is None else \
                f"{self.matching:,} matching files, {self.available:,} bytes"
            how = f"cut by data.max_bytes={max_bytes} (of {held}{skipped})"
        else:
            how = f"all of it, under data.max_bytes={max_bytes}{skipped}"
        return f"read {self.nbytes:,} bytes from {where}: {how}"


def find_corpus(path: Optional[str], glob: Optional[str], max_bytes: int) -> Corpus:
    """Lists the corpus without reading it; raises :class:`CorpusError` for a missing path, an empty or binary
    file, an empty folder, a folder with no file matching ``glob``, or one whose matching files are all binary."""
    root = stdlib_dir() if path is None else Path(os.path.expanduser(path))
    key = f"data.path={path!r}" if path is not None else f"data.path=null (the standard library, {root})"
    if not root.exists():
        raise CorpusError(f"{key}: no such file or folder ({root.absolute()}). Give a text file or a folder of "
                          f"text files; a relative path is read from the folder the job starts in.")
    if root.is_file():
        size = root.stat().st_size
        if size == 0:
            raise CorpusError(f"{key} is an empty file (0 bytes). Give a file with text in it, or a folder of text "
                              f"files.")
        if not _is_text(root):
            raise CorpusError(f"{key} is a binary file (a NUL byte in its first 8 KiB, {size} bytes). The corpus "
                              f"is read as text: point data.path at a text file, or at a folder of text files.")
        return Corpus((root,), min(size, max_bytes), str(root), available=size, matching=1, cut=size > max_bytes)
    everything = _all_files(root)
    if not everything:
        raise CorpusError(f"{key} is an empty folder (no files under {root}). Put text files in it, or point "
                          f"data.path at a text file or another folder.")
    pattern = glob or ("*.py" if path is None else "*")
    matching = [p for p in everything if fnmatch.fnmatch(p.name, pattern)]
    if not matching:
        raise CorpusError(f"{key} holds {_files(len(everything))}, none matching data.glob={pattern!r} (e.g. "
                          f"{everything[0].name}). Set data.glob to a pattern that matches them, such as '*.txt'.")
    files, total, binary, examined = [], 0, 0, 0
    for p in matching:
        if total >= max_bytes:
            break
        examined += 1
        size = p.stat().st_size
        if _is_text(p):
            files.append(p)
            total += min(size, max_bytes - total)
        else:
            binary += 1
    if not files:
        names = ", ".join(p.name for p in matching[:3]) + (", ..." if len(matching) > 3 else "")
        raise CorpusError(f"{key} holds {_files(len(matching))} matching {pattern!r}, all binary (a NUL byte in their "
                          f"first 8 KiB: {names}). The corpus is read as text: point data.path at text files, or "
                          f"select them with data.glob.")
    available = sum(p.stat().st_size for p in matching)
    cut = examined < len(matching) or sum(p.stat().st_size for p in files) > total
    return Corpus(tuple(files), total, f"{root} ({len(files)} files)", available=available, matching=len(matching),
                  binary=binary, cut=cut, pattern=pattern, root=str(root))


def read_corpus(corpus: Corpus) -> bytes:
    chunks, total = [], 0
    for p in corpus.files:
        with open(p, "rb") as f:
            chunks.append(f.read(corpus.nbytes - total))
        total += len(chunks[-1])
    return b"".join(chunks)


def check_split(corpus: Corpus, path: Optional[str], block_size: int, val_fraction: float, piece_bytes: int,
                max_bytes: int) -> None:
    """Raises :class:`CorpusError` unless :func:`split_pieces` can give both splits one block: the first
    validation piece is piece ``every - 1``, so the corpus needs ``(every - 1) * piece_bytes + block_size + 1``
    bytes."""
    block = block_size + 1
    if piece_bytes < block:
        raise CorpusError(f"data.piece_bytes={piece_bytes} is shorter than one block (data.block_size + 1 = {block} "
                          f"bytes): give data.piece_bytes >= {block}.")
    every = max(2, round(1.0 / val_fraction))
    need = (every - 1) * piece_bytes + block
    if corpus.nbytes >= need:
        return
    fits = (corpus.nbytes - block) // (every - 1)
    fix = (f"give more text, or lower data.piece_bytes (data.piece_bytes={fits} fits this corpus)" if fits >= block
           else f"give more text (at least {every * block} bytes with data.piece_bytes={block})")
    capped = f" (capped by data.max_bytes={max_bytes})" if corpus.nbytes == max_bytes else ""
    raise CorpusError(f"data.path={path!r} holds {corpus.nbytes} bytes of text{capped}, in {corpus.source}: too "
                      f"small to split. Every {every}th piece of data.piece_bytes={piece_bytes} bytes goes to "
                      f"validation and each split needs one block of data.block_size + 1 = {block} bytes, so the "
                      f"corpus needs at least {need} bytes: {fix}.")


def split_pieces(data: torch.Tensor, val_fraction: float, piece_bytes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Deterministic interleaved split: piece i goes to validation when ``i % every == every - 1``."""
    every = max(2, round(1.0 / val_fraction))
    pieces = list(torch.split(data, piece_bytes))
    val = [p for i, p in enumerate(pieces) if i % every == every - 1]
    train = [p for i, p in enumerate(pieces) if i % every != every - 1]
    if not val or not train:
        raise ValueError(f"corpus of {data.numel()} bytes is too small to split with piece_bytes={piece_bytes} "
                         f"and val_fraction={val_fraction}")
    return torch.cat(train), torch.cat(val)


class ByteBlocks(Dataset):
    """Windows of ``block_size + 1`` bytes starting every ``block_size`` bytes: ``(input, target)``.

    ``max_blocks`` keeps that many windows evenly spaced over the whole split (a fixed, representative
    validation set that costs a bounded time)."""

    def __init__(self, data: torch.Tensor, block_size: int, max_blocks: Optional[int] = None) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"split of {data.numel()} bytes is shorter than one block ({block_size + 1} bytes)")
        self.data = data
        self.block_size = block_size
        n = (data.numel() - 1) // block_size
        self.starts = torch.arange(n) * block_size
        if max_blocks is not None and max_blocks < n:
            self.starts = self.starts[torch.linspace(0, n - 1, max_blocks).long()]

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        block = self.data[start : start + self.block_size + 1].long()
        return block[:-1], block[1:]


class ByteCorpusDataModule(L.LightningDataModule):
    def __init__(
        self,
        path: Optional[str] = None,
        glob: Optional[str] = None,
        max_bytes: int = 4_000_000,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        piece_bytes: int = 16_384,
        max_val_blocks: Optional[int] = 512,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.corpus = find_corpus(path, glob, max_bytes)
        check_split(self.corpus, path, block_size, val_fraction, piece_bytes, max_bytes)
        self.source = self.corpus.source
        self.summary: Optional[str] = None  # what was read and how it was split, after setup
        self.train_set: Optional[ByteBlocks] = None
        self.val_set: Optional[ByteBlocks] = None
        self._sampler: Optional[stream.StreamSampler] = None
        self._resumed: Optional[Dict[str, Any]] = None  # the checkpoint's data state, until the resumed epoch starts

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        data = torch.frombuffer(bytearray(read_corpus(self.corpus)), dtype=torch.uint8)
        train, val = split_pieces(data, hp.val_fraction, hp.piece_bytes)
        self.train_set = ByteBlocks(train, hp.block_size)
        self.val_set = ByteBlocks(val, hp.block_size, hp.max_val_blocks)
        every = max(2, round(1.0 / hp.val_fraction))
        whole_val = (val.numel() - 1) // hp.block_size
        kept = f"{len(self.val_set):,} of {whole_val:,} blocks, data.max_val_blocks={hp.max_val_blocks}" \
            if len(self.val_set) < whole_val else f"{whole_val:,} blocks"
        self.summary = (f"{self.corpus.describe(hp.max_bytes)}; split in pieces of data.piece_bytes={hp.piece_bytes}, "
                        f"every {every}th to validation (data.val_fraction={hp.val_fraction:g}): {train.numel():,} "
                        f"bytes for training ({len(self.train_set):,} blocks of {hp.block_size + 1} bytes), "
                        f"{val.numel():,} for validation ({kept})")
        if self.trainer is None or self.trainer.is_global_zero:
            _log.info(f"[data] {self.summary}")

    def _loader_kwargs(self) -> Dict[str, Any]:
        workers = self.hparams.num_workers
        return {"batch_size": self.hparams.batch_size, "drop_last": True, "num_workers": workers,
                "persistent_workers": workers > 0}

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        ranks, rank = self._ranks()
        sampler = stream.StreamSampler(self.train_set, self.hparams.batch_size, self._batches_done,
                                       seed=int(os.getenv("PL_GLOBAL_SEED", 0)), num_replicas=ranks, rank=rank,
                                       on_start=self._on_epoch_start)
        if sampler.batches == 0:
            raise CorpusError(f"data.path={self.hparams.path!r} gives {len(self.train_set)} training blocks, "
                              f"{len(self.train_set) // ranks} per rank on {ranks} ranks: fewer than one batch of "
                              f"data.batch_size={self.hparams.batch_size}. Lower data.batch_size or give more text.")
        # Lightning warns that a mid-epoch resume repeats batches unless the loader is "stateful"; this one resumes
        # where the loop does without a state of its own ([Note: resuming the data] in stream.py): wrong here.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        self._sampler = sampler
        return DataLoader(self.train_set, sampler=sampler, **self._loader_kwargs())

    def _ranks(self) -> Tuple[int, int]:
        """(data-parallel ranks, this rank's index among them): the strategy's sampler arguments."""
        trainer = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer else None
        kwargs = kwargs or {"num_replicas": 1, "rank": 0}
        return kwargs["num_replicas"], kwargs["rank"]

    def _batches_done(self) -> int:
        """Training batches the epoch loop has run in the current epoch (what a resumed loop continues after)."""
        trainer = self.trainer
        return trainer.fit_loop.epoch_loop.batch_progress.current.ready if trainer is not None else 0

    def _on_epoch_start(self, epoch: int, done: int) -> None:
        if self._resumed is not None and (self.trainer is None or self.trainer.is_global_zero):
            ranks, _ = self._ranks()
            sampler = self._sampler
            _log.info(stream.resumed_line(epoch, done, self._resumed, ranks, self.hparams.batch_size,
                                          sampler.batches if sampler is not None else 0))
        self._resumed = None  # said once, at the first epoch after the restore

    def state_dict(self) -> Dict[str, Any]:
        """Kept in checkpoints: the ranks and batch size of this run ([Note: resuming the data] in stream.py)."""
        return stream.position_state(self._ranks()[0], self.hparams.batch_size)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ranks, _ = self._ranks()
        why = stream.refusal(state, ranks, self.hparams.batch_size, "the checkpoint")
        if why:
            raise ValueError(why)
        self._resumed = dict(state)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, shuffle=False, **self._loader_kwargs())
