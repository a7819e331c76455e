"""One rank of tests/test_lifetime.py: a model set up under MiCS, trained a few steps and then dropped by its
user is freed, with its engine, its shards and its optimizer state, under Fabric and under the Trainer (made
plain after fit, or kept sharded because it is larger than ``max_live_parameters``). Read through weak
references after ``gc.collect()``, for each variant in turn in the same process, as a notebook or a sweep runs
them.

    python lifetime.py --out DIR --variants JSON
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

from lightning_mics import frontend  # noqa: E402
from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402
from lightning_mics.fabric import MiCSStrategy as FabricMiCS  # noqa: E402
from lightning_mics.strategy import MiCSStrategy  # noqa: E402

VOCAB, STEPS = 64, 2
WORLD = int(os.environ["WORLD_SIZE"])


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True)
    args = parser.parse_args()
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
