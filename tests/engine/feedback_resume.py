"""One rank of the Trainer's error-feedback resume test: quant_equiv.py's linear model under
``quantize_gradients="error_feedback"`` (32-element blocks, s = 2), 2 epochs of 3 optimizer steps, saved at the
end of epoch 0 by ModelCheckpoint (sharded and full); a fresh Trainer resumes each with ``fit(ckpt_path=...)``.
Rank 0 writes, per format, the largest difference between the resumed and the uninterrupted parameters and the
error-feedback warnings the resumed fit raised; then which ranks' residuals a ``trainer.save_checkpoint`` after a
fit holds, for a model that stays sharded after it (in 32-true; ``--precision bf16-mixed`` runs the resumes only)."""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.checkpoint import files as files  # noqa: E402
from lightning_mics.checkpoint.feedback import KEY  # noqa: E402
from tests.engine.quant_equiv import D_IN, D_OUT, Module, data  # noqa: E402

BATCH, STEPS_PER_EPOCH = 4, 3


class Start(L.Callback):
    step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def fit(out, world, train, kind, ckpt=None, save=False, epochs=2, precision="32-true", **kw):
    """(the Trainer after fit, the error-feedback warnings it raised, the step it started from)."""
    strategy = MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0,
                            reduce_bucket_size=D_IN * D_OUT, state_dict_type=kind,
                            quantize_gradients="error_feedback", quantization_block_size=32, **kw)
    start = Start()
    saver = ModelCheckpoint(dirpath=out, filename=f"ef_{kind}-{{epoch}}", save_on_train_epoch_end=True, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, limit_val_batches=0,
                        precision=precision,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, use_distributed_sampler=False, callbacks=[saver, start] if save else [start],
                        enable_checkpointing=save)
    torch.manual_seed(0)
    module = Module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train, ckpt_path=ckpt)
    warned = [str(w.message) for w in caught if "error-feedback residuals" in str(w.message)]
    return trainer, warned, start.step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--precision", default="32-true",
                    help="the Trainer's precision; the after-fit save runs in 32-true only")
    ap.add_argument("--shard-optimizer-state", action="store_true",
                    help="the optimizer's rows over the replicas ([Note: quantized optimizer rows])")
    args = ap.parse_args()
    kw = {"shard_optimizer_state": True} if args.shard_optimizer_state else {}
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    x, y = data(world, BATCH, STEPS_PER_EPOCH, 1)
    ds = TensorDataset(x, y)
    train = DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    result = {}
    for kind in ("sharded", "full"):
        straight = fit(args.out, world, train, kind, save=True, precision=args.precision, **kw)[0]
        straight = straight.strategy.lightning_module_state_dict()
        trainer, warned, start = fit(args.out, world, train, kind, ckpt=str(Path(args.out) / f"ef_{kind}-epoch=0.ckpt"),
                                     precision=args.precision, **kw)
        resumed = trainer.strategy.lightning_module_state_dict()
        result[kind] = {"start": start, "step": trainer.global_step, "warned": warned}
        if rank == 0:
            result[kind]["max_abs"] = max((resumed[k] - straight[k]).abs().max().item() for k in straight)
            result[kind]["dtypes"] = sorted({str(v.dtype) for v in resumed.values()})
    if args.precision != "32-true":
        (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))
        return
    # a model larger than max_live_parameters stays sharded after fit: a save then still holds the residuals
    trainer, _, _ = fit(args.out, world, train, "sharded", epochs=1, max_live_parameters=100, **kw)
    after = Path(args.out) / "after_fit.ckpt"
    trainer.save_checkpoint(after)
    if rank == 0:
        index = files.read_index(after)
        result["after_fit_ranks"] = sorted({p[2] for p in index.planner_data.values() if p[0] == KEY})
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
