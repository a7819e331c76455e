"""One rank fails while the others carry on: the whole job must end fast, with that rank's traceback.

Run as a plain script (Lightning's launcher starts the other ranks) or under torchrun:

    python tests/trainer/fail_fast.py OUT --mode step --fail-rank 1 --devices 2
    torchrun --nproc-per-node 2 tests/trainer/fail_fast.py OUT --mode callback --fail-rank 0 --devices 2

Modes (the failing rank only; every other rank runs on into the next collective):
    step       raises in ``training_step`` at step 3 (say an out-of-memory error, or a bad batch)
    callback   raises in a callback's ``on_train_batch_end`` at step 3
    save       raises while writing its shards of the second checkpoint (step 4)
    save_kill  SIGKILLs itself while writing its shards of the second checkpoint (step 4)
The first checkpoint (step 2) is complete before anything fails, so it must stay loadable.
"""

import argparse
import os
import signal
import time
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mics  # noqa: E402,F401  registers "mics"
from tests.helpers.models import gpt  # noqa: E402

FAIL_STEP = 3


class Injected(RuntimeError):
    def __init__(self, message):
        super().__init__(message)
        (OUT / "failed_at").write_text(repr(time.time()))  # the test measures the job's end from here


OUT = Path(".")


class Module(L.LightningModule):
    def __init__(self, mode, fail_rank):
        super().__init__()
        self.mode, self.fail_rank = mode, fail_rank
        self.model = gpt()

    def training_step(self, batch, idx):
        if self.mode == "step" and self.global_rank == self.fail_rank and self.global_step == FAIL_STEP:
            raise Injected(f"injected failure in training_step on rank {self.global_rank} at step {FAIL_STEP}")
        return self.model.loss(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class FailInCallback(Callback):
    def __init__(self, fail_rank):
        self.fail_rank = fail_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.fail_rank and trainer.global_step == FAIL_STEP:
            raise Injected(f"injected failure in a callback on rank {trainer.global_rank} at step {FAIL_STEP}")


def fail_in_second_save(out, fail_rank, kill):
    """The failing rank's shard writes of the second save: the real write runs, then it raises or dies."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    original = fs._write_item

    def write_then_fail(*args, **kwargs):
        result = original(*args, **kwargs)
        if dist.get_rank() == fail_rank and len(list(out.glob("ckpts/*.ckpt"))) >= 1:  # the first checkpoint is published: this is the second
            args[1].flush()
            (out / "failed_mid_write").write_text("1")
            (out / "failed_at").write_text(repr(time.time()))
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise Injected("injected failure while writing checkpoint shards")
        return result

    fs._write_item = write_then_fail


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mode", choices=("step", "callback", "save", "save_kill", "none"), required=True)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--linger", type=float, default=0.0,
                    help="the failing rank stays alive this long after fit raised (say, a logger uploading, or a "
                         "script that catches the error to write a report) before it re-raises")
    args = ap.parse_args()
    global OUT
    out = OUT = Path(args.out)
    torch.manual_seed(0)
    x = torch.randint(0, 61, (256, 13))
    dl = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    callbacks = [FailInCallback(args.fail_rank)] if args.mode == "callback" else []
    if args.mode.startswith("save"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy="mics",
                        max_steps=8, logger=False, enable_checkpointing=args.mode.startswith("save"),
                        callbacks=callbacks, enable_progress_bar=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    if args.mode.startswith("save"):
        fail_in_second_save(out, args.fail_rank, kill=args.mode == "save_kill")
    try:
        trainer.fit(Module(args.mode, args.fail_rank), dl)
    except Injected:
        time.sleep(args.linger)
        raise
    (out / f"finished{trainer.global_rank}").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
