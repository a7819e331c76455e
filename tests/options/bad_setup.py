"""One rank of a fit that must be refused at setup: writes the exception each rank raised (the test expects the
same ValueError naming the option on every rank, and no hang)."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.trainer.compat import BATCH, Base, classification_data  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", required=True, help="JSON of MiCSStrategy options")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    ds = classification_data(world * BATCH)
    error = None
    try:
        trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            strategy=MiCSStrategy(**json.loads(args.strategy)))
        trainer.fit(Base(), DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, world, rank)))
    except Exception as e:  # noqa: BLE001 - recorded for the test
        error = f"{type(e).__name__}: {e}"
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({"error": error}))


if __name__ == "__main__":
    main()
