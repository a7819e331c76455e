"""One rank of tests/engine/test_lifetime.py: a model set up under MiCS, trained a few steps and then dropped by its
user is freed, with its engine, its shards and its optimizer state, under Fabric and under the Trainer (made
plain after fit, or kept sharded because it is larger than ``max_live_parameters``). Read through weak
references after ``gc.collect()``, for each variant in turn in the same process, as a notebook or a sweep runs
them.

    python lifetime.py --out DIR --variants JSON
    python lifetime.py --out DIR --uneven-collection

``--uneven-collection``: the garbage collector runs on rank 1 only, between fits. A model left sharded and dropped
is garbage held by a reference cycle; rank 1 frees it at once, the other ranks still hold it when the next fit ends
and decides whether the layout's groups are still used. The three fits must end alike on every rank.
"""

import argparse
import gc
import json
import os
import sys
import weakref
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_mics.frontends import shared as frontend  # noqa: E402
from tests.helpers import models  # noqa: E402
from lightning_mics.fabric import MiCSStrategy as FabricMiCS  # noqa: E402
from lightning_mics.frontends.trainer import MiCSStrategy  # noqa: E402

VOCAB, STEPS = 64, 2
WORLD = int(os.environ["WORLD_SIZE"])


def gpt():
    torch.manual_seed(0)
    return models.gpt(2, VOCAB, block_size=16)


def tokens(rank):
    return torch.randint(0, VOCAB, (STEPS, 2, 17), generator=torch.Generator().manual_seed(rank))


def lm_loss(logits, x):
    return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def with_fabric(options: dict, precision: str) -> tuple:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, precision=precision, strategy=FabricMiCS(**options))
    fabric.launch()
    model = gpt()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x in tokens(fabric.global_rank):
        fabric.backward(lm_loss(model(x[:, :-1]), x))
        opt.step()
        opt.zero_grad()
    module = model.module if hasattr(model, "module") else model
    return weakref.ref(module), weakref.ref(frontend.engine_of(module)), weakref.ref(opt.optimizer)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt()

    def training_step(self, batch, batch_idx):
        return lm_loss(self.model(batch[:, :-1]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(tokens(self.global_rank)), batch_size=None)


def with_trainer(options: dict, precision: str) -> tuple:
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, precision=precision, strategy=MiCSStrategy(**options),
                        max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    engine = frontend.engine_of(module)  # None when fit made it plain again
    return (weakref.ref(module), weakref.ref(engine) if engine is not None else (lambda: None),
            weakref.ref(trainer.optimizers[0]))


def uneven_collection() -> list:
    """Fit 1 leaves its model sharded (over max_live_parameters) and it is dropped; fit 2's model is made plain
    again, so at its end nothing the program holds uses the layout and its groups go; fit 3 creates them again
    (collectively). Collection on rank 1 only: on the other ranks fit 1's engine is garbage not yet collected when
    fit 2 ends."""
    gc.disable()
    rank = int(os.environ["RANK"])
    out = []
    for options in [{"max_live_parameters": 1000}, {}, {}]:
        refs = with_trainer({"sharded_data_parallel_degree": 2, **options}, "32-true")
        module = refs[0]()  # (a trainer's own cycles may still hold it: gc is off)
        out.append({"kept_sharded": refs[1]() is not None,
                    "checksum": None if module is None or refs[1]() is not None
                    else float(sum(p.double().sum() for p in module.parameters()))})
        del module
        if rank == 1:
            gc.collect()
    gc.enable()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants")
    parser.add_argument("--uneven-collection", action="store_true")
    args = parser.parse_args()
    if args.uneven_collection:
        res = uneven_collection()
        Path(args.out, f"result{torch.distributed.get_rank()}.json").write_text(json.dumps(res))
        return
    res = []
    for v in json.loads(args.variants):
        options = dict(v)
        run = with_trainer if options.pop("front", "fabric") == "trainer" else with_fabric
        precision = options.pop("precision", "32-true")
        refs = run(options, precision)
        kept_sharded = refs[1]() is not None
        gc.collect()
        res.append({"kept_sharded": kept_sharded, "alive": [r() is not None for r in refs],
                    "engines_registered": len(frontend.live_engines())})
    Path(args.out, f"result{torch.distributed.get_rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
