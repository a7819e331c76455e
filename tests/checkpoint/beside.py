"""DTensors a checkpoint holds beside the model ([Note: DTensors beside the model] in
lightning_mics/checkpoint/beside.py): a hand-written EMA of the parameters, kept as clones of them, one case after
another in one process (one rank; ``tests/helpers/trainer_cases.py``'s ``main``):

    python beside.py --out DIR --strategy mics|mics_os|mics_full|zero1|ddp|fabric_mics_os|... --cases ema,...

- ``ema`` (Trainer): the EMA is updated after every step and saved by ``on_save_checkpoint`` as
  ``{"weights": {name: tensor}, "pair": [two of them], "updates": n}``; a checkpoint saved at the end of the first
  of 3 epochs, and a second fit resumed from it to the end. Rank 0 saves the parameters, the EMA after each fit
  (gathered in ``on_train_end``), the EMA as the resumed fit read it (gathered in ``on_train_start``), the types
  the load gave back, and for a sharded checkpoint the EMA that ``consolidate`` reads in one process;
- ``ema_bf16`` (Trainer): ``ema`` under ``bf16-mixed``;
- ``ema_from`` (Trainer): a fit resumed from the checkpoint at ``$BESIDE_FROM`` (another launch's, another layout);
- ``trainable`` (Trainer): a finetuning run's ``on_save_checkpoint`` keeps only the trainable weights in
  ``state_dict`` (the embedding, frozen, deleted) and adds an entry of its own; a second fit resumes from it with
  ``strict_loading = False``. Rank 0 saves the names the checkpoint holds and the parameters after each fit;
- ``partial`` (Trainer): an entry holding a ``Partial`` DTensor (a sum not yet reduced): the save raises the same
  ``ValueError`` on every rank, naming the entry, and the fit goes on to its end;
- ``fabric`` (``fabric_<kind>``): the same EMA in a Fabric loop, ``fabric.save(path, {"model", "optimizer",
  "ema"})`` after 3 steps and a fresh model, optimizer and EMA loaded from it (``fabric.load``).

``mics_full``: MiCS at s = 2 with ``state_dict_type="full"``.
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_mics import consolidate  # noqa: E402
from lightning_mics.fabric import MiCSStrategy as FabricMiCS  # noqa: E402
from tests.helpers.models import Net  # noqa: E402
from tests.helpers.trainer_cases import (BATCH, Base, classification_data, loader, main, params,  # noqa: E402
                                         strategy_for, strategy_of, trainer_for, whole)

RATE = 0.3


def gathered(ema):
    return {n: whole(v).detach().clone() for n, v in ema.items()}  # collective


class EMA(Base):
    path = None  # where the first fit saves, at the end of its first epoch

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            if not hasattr(self, "ema"):
                self.ema, self.updates = {n: p.detach().clone() for n, p in self.named_parameters()}, 0
            for n, p in self.named_parameters():
                self.ema[n].lerp_(p.detach(), RATE)
            self.updates += 1

    def on_train_epoch_end(self):
        if self.path is not None and self.current_epoch == 0:
            self.trainer.save_checkpoint(self.path)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["ema"] = {"weights": self.ema, "pair": [self.ema["net.head.weight"], self.ema["net.emb.weight"]],
                             "updates": self.updates}

    def on_load_checkpoint(self, checkpoint):
        self.ema, self.updates = dict(checkpoint["ema"]["weights"]), checkpoint["ema"]["updates"]
        self.loaded_types = sorted({type(v).__name__ for v in self.ema.values()})
        pair = checkpoint["ema"]["pair"]
        self.pair_alike = [type(t).__name__ for t in pair] == [type(self.ema[n]).__name__
                                                                for n in ("net.head.weight", "net.emb.weight")]

    def on_train_start(self):
        if hasattr(self, "ema"):
            self.ema_loaded = gathered(self.ema)

    def on_train_end(self):
        self.ema_end = gathered(self.ema)


class Finetune(Base):
    strict_loading = False
    path = None

    def __init__(self):
        super().__init__()
        self.net.emb.weight.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.2, momentum=0.9)

    def on_save_checkpoint(self, checkpoint):
        sd = checkpoint["state_dict"]
        for k in [k for k in sd if k.startswith("net.emb.")]:
            del sd[k]
        sd["extra.scale"] = torch.tensor([2.0])

    def on_train_epoch_end(self):
        if self.path is not None and self.current_epoch == 0:
            self.trainer.save_checkpoint(self.path)


class Unreduced(Base):
    def on_save_checkpoint(self, checkpoint):
        mesh = self.trainer.strategy.topology.mesh
        checkpoint["sums"] = {"loss": DTensor.from_local(torch.ones(1), mesh, [Partial(), Partial()])}

    def on_train_epoch_end(self):
        try:
            self.trainer.save_checkpoint(self.path)
        except ValueError as e:
            self.refused = str(e)


def trainer_case(case, kind, world, rank, out):
    ds = classification_data(4 * world * BATCH)
    base = kind.replace("_full", "")

    def strategy():
        return strategy_for(base, state_dict_type="full") if kind.endswith("_full") else strategy_of(kind)

    result = {}
    if case == "trainable":
        first, path = Finetune(), Path(out) / f"trainable_{kind}.ckpt"
        first.path = path
        trainer_for(base, world, max_epochs=2, strategy=strategy()).fit(first, loader(ds, base, world, rank))
        if rank == 0:
            result["names"] = sorted((torch.load(path, weights_only=False) if kind == "ddp" else consolidate(path))
                                     ["state_dict"])
        L.seed_everything(0, verbose=False)
        again = Finetune()
        trainer_for(base, world, max_epochs=2, strategy=strategy()).fit(again, loader(ds, base, world, rank),
                                                                        ckpt_path=path)
        return {**result, "params": params(first), "resumed": params(again)}
    if case == "partial":
        m = Unreduced()
        m.path = Path(out) / "partial.ckpt"
        trainer_for(base, world, max_epochs=1, strategy=strategy()).fit(m, loader(ds, base, world, rank))
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, m.refused)
        return {"refused": everyone, "written": m.path.exists()}
    path = Path(os.environ["BESIDE_FROM"]) if case == "ema_from" else Path(out) / f"{case}_{kind}.ckpt"
    precision = "bf16-mixed" if case == "ema_bf16" else "32-true"
    if case in ("ema", "ema_bf16"):
        first = EMA()
        first.path = path
        trainer_for(base, world, max_epochs=3, strategy=strategy(), precision=precision).fit(
            first, loader(ds, base, world, rank))
        result["first_end"] = first.ema_end
        if rank == 0 and kind != "ddp":
            saved = consolidate(path)  # one process: a directory's shards, or the full file as written
            result["consolidated"] = {n: t.clone() for n, t in saved["ema"]["weights"].items()}
        elif rank == 0:
            result["saved"] = {n: t.clone() for n, t in torch.load(path, weights_only=False)["ema"]["weights"].items()}
    m = EMA()
    trainer_for(base, world, max_epochs=3, strategy=strategy(), precision=precision).fit(
        m, loader(ds, base, world, rank), ckpt_path=path)
    result.update(params=params(m), ema_loaded=m.ema_loaded, ema_end=m.ema_end, types=m.loaded_types,
                  pair_alike=m.pair_alike, updates=m.updates)
    return result


def fabric_case(kind, world, rank, out):
    """3 steps, a save, 3 more steps; a fresh model, optimizer and EMA loaded from the save."""
    base = kind.removeprefix("fabric_").replace("_full", "")
    options = dict(sharded_data_parallel_degree=2, shard_optimizer_state=base == "mics_os",
                   param_persistence_threshold=0, state_dict_type="full" if kind.endswith("_full") else "sharded")
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=FabricMiCS(**options))
    fabric.launch()
    x, y = classification_data(6 * world * BATCH).tensors
    x, y = x.view(6, world, BATCH, -1)[:, rank], y.view(6, world, BATCH)[:, rank]

    def build():
        torch.manual_seed(0)
        model = fabric.setup_module(Net())
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
        return model, opt, {n: p.detach().clone() for n, p in model.named_parameters()}

    def steps(model, opt, ema, at):
        for step in at:
            fabric.backward(F.cross_entropy(model(x[step]), y[step]))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    ema[n].lerp_(p.detach(), RATE)

    model, opt, ema = build()
    steps(model, opt, ema, range(3))
    path = Path(out) / f"{kind}.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "ema": ema})
    at_save = gathered(ema)
    again, again_opt, fresh = build()
    state = {"model": again, "optimizer": again_opt, "ema": fresh}
    fabric.load(path, state)
    loaded = gathered(state["ema"])
    types = sorted({type(v).__name__ for v in state["ema"].values()})
    steps(again, again_opt, state["ema"], range(3, 6))
    steps(model, opt, ema, range(3, 6))
    return {"at_save": at_save, "loaded": loaded, "types": types, "end": gathered(state["ema"]),
            "straight_end": gathered(ema)}


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    if kind.startswith("fabric_"):
        return fabric_case(kind, world, rank, out)
    return trainer_case(case, kind, world, rank, out)


if __name__ == "__main__":
    main(run_case)
