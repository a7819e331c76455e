"""A byte-level text corpus as a LightningDataModule: no downloads, no tokenizer.

By default the corpus is the Python standard library's own ``.py`` sources (they exist on every machine that
runs this code), read in sorted path order and capped at ``max_bytes``; ``path=`` takes any text file or folder
instead. Every byte is a token (vocabulary 256).

Split (deterministic, no randomness): the corpus is cut into pieces of ``piece_bytes``; every
``round(1 / val_fraction)``-th piece goes to validation, the rest to training, so both splits sample the whole
corpus rather than its first and last files. Each split is then served as fixed-length windows of
``block_size + 1`` bytes (input = the first ``block_size``, target = the last ``block_size``), windows starting
every ``block_size`` bytes so that every byte is a target once.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def list_files(root: Path, glob: str) -> List[Path]:
    """Regular text files under ``root`` whose name matches ``glob``, sorted by relative path (so the same on
    every machine with the same files), skipping installed packages, caches and VCS folders."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: site-packages can be huge
        files.extend(Path(dirpath, f) for f in filenames if fnmatch.fnmatch(f, glob))
    files = [p for p in files if p.is_file()]
    return sorted((p for p in files if _is_text(p)), key=lambda p: p.relative_to(root).as_posix())


def read_corpus(path: Optional[str], glob: Optional[str], max_bytes: int) -> Tuple[bytes, str]:
    """Returns (at most ``max_bytes`` bytes, a description of the source)."""
    root = stdlib_dir() if path is None else Path(os.path.expanduser(path))
    if not root.exists():
        raise FileNotFoundError(f"data.path={path!r} does not exist")
    if root.is_file():
        with open(root, "rb") as f:
            return f.read(max_bytes), str(root)
    files = list_files(root, glob or ("*.py" if path is None else "*"))
    if not files:
        raise FileNotFoundError(f"no text files matching {glob or '*'!r} under data.path={str(root)!r}")
    chunks, total = [], 0
    for p in files:
        if total >= max_bytes:
            break
        data = p.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    return b"".join(chunks), f"{root} ({len(chunks)} files)"


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
        self.train_set: Optional[ByteBlocks] = None
        self.val_set: Optional[ByteBlocks] = None
        self.source = ""

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        raw, self.source = read_corpus(hp.path, hp.glob, hp.max_bytes)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        train, val = split_pieces(data, hp.val_fraction, hp.piece_bytes)
        self.train_set = ByteBlocks(train, hp.block_size)
        self.val_set = ByteBlocks(val, hp.block_size, hp.max_val_blocks)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)
