"""One process of tests/engine/test_activations.py::test_what_checkpointing_keeps_alive: which blocks' inputs are still
alive when forward has ended, read through weak references to their storage (so whatever holds one counts:
autograd's saved tensors, a checkpoint's saved inputs, any other reference), for each variant of checkpointing,
under Fabric or the Trainer; then backward and a step run as usual, and how many inputs (the replays' too) are
still alive after them. With offload it also records, in backward, when each group's host copy is asked back (the
output's hook) and when its replay takes it.

    python ac_alive.py --out DIR --variants JSON
"""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from lightning_mics.engine import activations  # noqa: E402
from tests.helpers.models import gpt  # noqa: E402
from lightning_mics.fabric import MiCSStrategy as FabricMiCS  # noqa: E402
from lightning_mics.frontends.trainer import MiCSStrategy  # noqa: E402

VOCAB = 64


def gpt_and_batch():
    torch.manual_seed(0)
    model = gpt(4, VOCAB, block_size=16)
    inputs = []
    for block in model.h:
        block.register_forward_pre_hook(lambda module, args: inputs.append(StorageWeakRef(args[0].untyped_storage())))
    return model, inputs, torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1))


def lm_loss(logits, x):
    return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def spy_on_copies(events: list, made: dict) -> None:
    """Records ("ask", group) when a hook asks a host copy back and ("take", group) when a replay restores it; a
    group is its copy's creation index in the run (one floating input per group here, one forward per run)."""
    cls = activations._HostCopy
    init, prefetch, restore = cls.__init__, cls.prefetch, cls.restore

    def spy_init(self, *args):
        made[id(self)] = len(made)
        init(self, *args)

    def spy_prefetch(self, *args):
        events.append(("ask", made[id(self)]))
        prefetch(self, *args)

    def spy_restore(self, *args):
        events.append(("take", made[id(self)]))
        cls.prefetch = prefetch  # restore's own call to prefetch is not a hook's
        try:
            return restore(self, *args)
        finally:
            cls.prefetch = spy_prefetch
    cls.__init__, cls.prefetch, cls.restore = spy_init, spy_prefetch, spy_restore


def with_fabric(options: dict, precision: str) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision, strategy=FabricMiCS(**options))
    fabric.launch()
    model, inputs, x = gpt_and_batch()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = lm_loss(model(x[:, :-1]), x)
    gc.collect()
    alive = [not ref.expired() for ref in inputs[:4]]
    fabric.backward(loss)
    opt.step()
    value = float(loss)
    del loss
    gc.collect()
    return {"alive": alive, "replays": len(inputs) - 4, "loss": value,
            "alive_after_step": sum(not ref.expired() for ref in inputs)}


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model, self.inputs, self.x = gpt_and_batch()
        self.seen = {}

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model(batch[:, :-1]), batch)
        gc.collect()
        self.seen = {"alive": [not ref.expired() for ref in self.inputs[:4]], "loss": float(loss)}
        return loss

    def on_train_end(self):
        gc.collect()
        self.seen["replays"] = len(self.inputs) - 4
        self.seen["alive_after_step"] = sum(not ref.expired() for ref in self.inputs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.x], batch_size=None)


def with_trainer(options: dict, precision: str) -> dict:
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, strategy=MiCSStrategy(**options),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    return module.seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True)
    args = parser.parse_args()
    events: list = []
    made: dict = {}
    spy_on_copies(events, made)
    res = []
    for v in json.loads(args.variants):
        options = dict(v)  # the variant's front end and precision, the rest MiCS options
        run = with_trainer if options.pop("front", "fabric") == "trainer" else with_fabric
        precision = options.pop("precision", "32-true")
        events.clear()
        made.clear()
        res.append({**run(options, precision), "copies": list(events)})
    Path(args.out, "result0.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
