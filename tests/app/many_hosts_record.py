"""A callback for the main job's tests: records, per rank, the samples each optimizer step trained on.

The corpus of these tests (``numbered_corpus``) is made of 32-byte cells that each start with their number, so a
sample's number is read from the bytes the model was given (the first 7 bytes of each input row), not from the
sampler under test. ``samples_rank<k>.json`` in ``path``: ``[[global_step, [numbers...]], ...]`` in training order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Tuple

import lightning as L

CELL = 32  # bytes of one numbered cell: the model's block_size in these tests
DIGITS = 7


def numbered_corpus(path: Path, cells: int) -> None:
    """``cells`` cells of CELL bytes: ``0000012:`` then text, the last byte a newline."""
    filler = "the quick brown fox jumps over the lazy dog "
    with open(path, "w") as f:
        for i in range(cells):
            head = f"{i:0{DIGITS}d}:"
            f.write(head + (filler * 2)[: CELL - len(head) - 1] + "\n")


class RecordSamples(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seen: List[Tuple[int, List[int]]] = []

    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        inputs = batch[0]
        numbers = [int(bytes(row[:DIGITS].tolist()).decode()) for row in inputs.cpu()]
        self.seen.append((trainer.global_step, numbers))

    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"samples_rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))
