"""One rank of a planner check: fits a small model with a real Trainer + MiCSStrategy and records what the
planner predicts: ``model_state_bytes()`` at the end of fit, the strategy's telemetry per optimizer step, and
the bytes of every c10d op per optimizer step as a TorchDispatchMode sees them (with the ranks of its group).

``build(name)`` is imported by tests/plan/test_plan.py, which plans the same module and compares.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402
from tests.helpers.models import SEQ, VOCAB, DemoTransformer, gpt  # noqa: E402


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name == "gpt":
        return gpt(3)
    if name == "gpt_untied":
        return gpt(2, n_embd=24, tie_weights=False)
    if name == "demo":
        return DemoTransformer()
    raise ValueError(name)


class Module(L.LightningModule):
    def __init__(self, name: str, optimizer: str) -> None:
        super().__init__()
        self.model = build(name)
        self.optimizer = optimizer
        self.spec = None  # with tensor parallelism: the planner's view of the parallelized module

    def configure_model(self):
        """With tensor_parallel_degree > 1: every block's MLP column- then row-parallel on device_mesh["tp"]."""
        if "tp" not in self.device_mesh.mesh_dim_names:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from lightning_mics.plan.models import from_module

        for block in self.model.h:
            parallelize_module(block, self.device_mesh["tp"], {"mlp.c_fc": ColwiseParallel(),
                                                               "mlp.c_proj": RowwiseParallel()})
        spec = from_module(self.model)
        self.spec = [[u.name, [[list(p.shape), p.trainable, p.tp, p.tp_dim] for p in u.params]] for u in spec.units]

    def training_step(self, batch, idx):
        return self.model.loss(*batch)

    def configure_optimizers(self):
        if self.optimizer == "sgd_momentum":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Record(L.Callback):
    """Counts c10d ops per optimizer step (from the first micro-batch of a window to the end of the last)."""

    def __init__(self, accum: int) -> None:
        self.accum, self.mode, self.steps, self.stats, self.state = accum, None, [], [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.accum == 0:
            self.mode = CommCounter()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.accum == 0:
            self.mode.__exit__(None, None, None)
            self.steps.append([[op, list(g) if g else None, n] for op, g, n in self.mode.events])
            self.stats.append(dict(trainer.strategy.comm_stats))
            self.mode = None

    def on_train_end(self, trainer, pl_module):
        self.state = trainer.strategy.model_state_bytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--variants", required=True,
                    help="JSON list of {MiCSStrategy options..., model, optimizer, accum, precision}: one fit each")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = []
    for variant in json.loads(args.variants):
        variant = dict(variant)
        accum, precision = variant.pop("accum", 1), variant.pop("precision", "32-true")
        model, optimizer = variant.pop("model", "gpt"), variant.pop("optimizer", "adamw")
        n = world * args.batch * args.steps * accum
        x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(7))
        data = TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loader = DataLoader(data, batch_size=args.batch,
                            sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False))
        record = Record(accum)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MiCSStrategy(**variant),
                            max_steps=args.steps, accumulate_grad_batches=accum, precision=precision,
                            limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                            enable_model_summary=False, logger=False, enable_checkpointing=False,
                            callbacks=[record], use_distributed_sampler=False)
        torch.manual_seed(0)
        module = Module(model, optimizer)
        trainer.fit(module, loader)
        results.append({"state": record.state, "steps": record.steps, "stats": record.stats, "spec": module.spec})
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({"rank": rank, "variants": results}))


if __name__ == "__main__":
    main()
