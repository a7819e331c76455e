"""Lightning's ``WeightAveraging`` callbacks under a strategy ([Note: weight averaging over the shards] in
lightning_mics/frontends/weight_averaging.py), one case after another in one process (one rank; ``tests/helpers/trainer_cases.py``'s ``main``):

    python averaging.py --out DIR --strategy mics|mics_os|mics_full|zero1|ddp --cases ema,swa,ema_bf16,ema_accum

- ``ema``: ``EMAWeightAveraging(decay=0.8)``; ``swa``: ``WeightAveraging()`` (torch's equal average); each over 3 epochs
  with AdamW (``ema_bf16``: under ``bf16-mixed``; ``ema_accum``: accumulation 2 and clipping by norm), validation after
  every epoch (on the average, swapped in and out by the callback), a checkpoint saved at the end of the first epoch,
  and a second fit resumed from it to the end. Rank 0 saves the validation losses, the parameters after fit (the
  average, copied in by the callback), the checkpoint's ``state_dict`` (the average at the save) and
  ``current_model_state`` (the module's own), consolidated in one process, and the resumed fit's losses and parameters,
  and a ``trainer.validate`` after it; and what the average holds on this rank (its types, its elements). ``mics_full``:
  MiCS at s = 2 with ``state_dict_type="full"``.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging  # noqa: E402

from lightning_mics import MiCSStrategy, consolidate  # noqa: E402
from tests.helpers.trainer_cases import BATCH, Base, classification_data, loader, main, params, strategy_for, strategy_of, trainer_for  # noqa: E402


class Tracked(Base):
    path = None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def on_validation_epoch_end(self):
        self.losses = getattr(self, "losses", [])

    def on_train_epoch_end(self):
        self.losses.append(float(self.trainer.callback_metrics["val_loss"]))
        if self.path is not None and self.current_epoch == 0:
            self.trainer.save_checkpoint(self.path)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    ds = classification_data(4 * world * BATCH)
    base = kind.replace("_full", "").replace("_kept", "")

    def fit(m, ckpt_path=None):
        strategy = strategy_for(base, state_dict_type="full") if kind.endswith("_full") else strategy_of(kind)
        if kind == "mics_kept":  # the default persistence threshold: small parameters kept whole, plain
            strategy = MiCSStrategy(sharded_data_parallel_degree=2)
        callback = EMAWeightAveraging(decay=0.8) if case.startswith("ema") else WeightAveraging()
        extra = dict(accumulate_grad_batches=2, gradient_clip_val=0.5) if case.endswith("_accum") else {}
        trainer = trainer_for(base, world, max_epochs=3, limit_val_batches=2, strategy=strategy, callbacks=[callback],
                              precision="bf16-mixed" if case.endswith("_bf16") else "32-true", **extra)
        trainer.fit(m, loader(ds, base, world, rank), loader(ds, base, world, rank), ckpt_path=ckpt_path)
        return trainer, callback

    first = Tracked()
    first.path = Path(out) / f"{case}_{kind}.ckpt"
    trainer, callback = fit(first)
    average = [p.detach() for p in callback._average_model.module.parameters()]
    result = {"losses": first.losses, "params": params(first),
              "average_types": sorted({type(p).__name__ for p in average}),
              "average_held": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in average),
              "numel": sum(p.numel() for p in average)}
    if rank == 0:
        saved = consolidate(first.path) if kind != "ddp" else torch.load(first.path, weights_only=False)
        result["saved"] = {k: saved["state_dict"][k].clone() for k in saved["state_dict"]}
        result["current"] = {k: saved["current_model_state"][k].clone() for k in saved["current_model_state"]}
    again = Tracked()
    trainer, _ = fit(again, first.path)
    after = trainer.validate(again, loader(ds, base, world, rank), verbose=False)[0]["val_loss"]  # the average again
    result.update(resumed_losses=again.losses, resumed=params(again), validated_after=after)
    return result


if __name__ == "__main__":
    main(run_case)
