"""A user's script with one bad strategy option (tests/options/test_bad_inputs.py): a real Trainer and fit on 2 CPU
ranks.

    python bad_input.py --out DIR --strategy '{"prefetch": -1}' [--precision 16-mixed] [--devices N] [--fused-sgd]
                        [--pruning] [--swa] [--ema] [--wrapped-blocks]

Started as ``python bad_input.py`` (Lightning's launcher would start rank 1) or under ``torchrun``. Most bad values
are refused in ``MiCSStrategy.__init__`` or when the Trainer is made, before any process is launched; those that
need the model are refused at setup on every rank. Each rank that refuses prints one line
``[rank R] refused: <ExceptionType>: <message>`` and re-raises, so the process exits non-zero with its traceback.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelPruning, StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.trainer_cases import BATCH, Base, classification_data  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", required=True, help="JSON of MiCSStrategy options")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--fused-sgd", action="store_true", help="the module's SGD built with fused=True")
    ap.add_argument("--pruning", action="store_true", help="Lightning's pruning callback")
    ap.add_argument("--swa", action="store_true", help="Lightning's StochasticWeightAveraging callback")
    ap.add_argument("--ema", action="store_true", help="Lightning's EMAWeightAveraging callback")
    ap.add_argument("--wrapped-blocks", action="store_true", help="each block in torch's checkpoint_wrapper")
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    try:
        plugins = [MixedPrecision(args.precision, "cpu")] if args.precision.endswith("-mixed") else []
        trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=2, logger=False, plugins=plugins,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            strategy=MiCSStrategy(**json.loads(args.strategy)),
                            callbacks=[ModelPruning("l1_unstructured", amount=0.3)] if args.pruning
                            else [StochasticWeightAveraging(swa_lrs=0.05)] if args.swa
                            else [EMAWeightAveraging()] if args.ema else None)
        module = Base()
        if args.wrapped_blocks:
            for i, block in enumerate(module.net.blocks):
                module.net.blocks[i] = checkpoint_wrapper(block)
        if args.fused_sgd:
            module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.2, fused=True)
        trainer.fit(module, DataLoader(classification_data(4 * BATCH), batch_size=BATCH))
    except Exception as e:
        print(f"[rank {rank}] refused: {type(e).__name__}: {e}", flush=True)
        raise
    print(f"[rank {rank}] fit finished: the options were accepted", flush=True)


if __name__ == "__main__":
    main()
