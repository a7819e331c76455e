"""One rank of the host-read budget (tests/engine/test_host_reads.py): a Fabric loop (no logger, no progress bar) trains a
tiny model under each variant, and a ``HostReads`` mode (tests/helpers/host_reads.py) counts the host's reads of
tensor data during the steady-state steps, after ``--warmup`` steps. The loop itself reads nothing (no
``loss.item()``); the reads are attributed to the engine (a frame in ``lightning_mics/``) or to what lies outside.

Variants (``--variants``, JSON list): ``{"name": ..., "options": {MiCSStrategy options}, "precision": ...,
"clip": null | "norm" | "norm_nocheck" | "value", "accum": n, "trainer": false}`` (``"activation_checkpointing":
"Block"`` names its blocks, tests/helpers/models.py's ``MLPBlock``). With ``"trainer": true`` the
same model trains under ``L.Trainer`` (logger, progress bar, checkpointing and validation off; the training step
returns the loss, logs nothing); a callback counts from each steady-state batch's start to its end, and clipping
is the Trainer's ``gradient_clip_val`` (``"norm"``) or ``gradient_clip_algorithm="value"`` (``"value"``).
"""

import argparse
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as Fn

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

import lightning_mics  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402
from tests.helpers.host_reads import HostReads  # noqa: E402
from tests.helpers.models import MLPBlock, Tiny  # noqa: E402

D, VOCAB, SEQ, BATCH = 24, 37, 6, 2


def _options(variant):
    options = dict(param_persistence_threshold=16, **variant["options"])
    if options.get("activation_checkpointing") == "Block":  # the blocks of the model below
        options["activation_checkpointing"] = [MLPBlock]
    return options


def run(variant, world, steps, warmup):
    options = _options(variant)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=MiCSStrategy(**options),
                      precision=variant.get("precision", "32-true"))
    fabric.launch()
    torch.manual_seed(0)
    model = Tiny(VOCAB, D, 3, norm=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(fabric.global_rank)
    accum, clip = variant.get("accum", 1), variant.get("clip")
    per_step = []
    for step in range(steps):
        reads = HostReads() if step >= warmup else None
        with reads if reads is not None else nullcontext():
            for m in range(accum):
                x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
                with fabric.no_backward_sync(model, enabled=m < accum - 1):
                    logits = model(x[:, :-1])
                    loss = Fn.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
                    fabric.backward(loss / accum)
            if clip == "norm":
                fabric.clip_gradients(model, opt, max_norm=0.05)
            elif clip == "norm_nocheck":
                fabric.clip_gradients(model, opt, max_norm=0.05, error_if_nonfinite=False)
            elif clip == "value":
                fabric.clip_gradients(model, opt, clip_val=0.01)
            opt.step()
            opt.zero_grad()
        if reads is not None:
            per_step.append(_summary(reads))
    return {"name": variant["name"], "per_step": per_step}


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Tiny(VOCAB, D, 3, norm=False)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        logits = self.model(x[:, :-1])
        return Fn.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Count(L.Callback):
    """HostReads from the start of each steady-state optimizer step's first batch to the end of its last."""

    def __init__(self, accum: int, warmup: int) -> None:
        self.accum, self.warmup, self.per_step, self.reads = accum, warmup, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.accum == 0 and batch_idx // self.accum >= self.warmup:
            self.reads = HostReads().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.reads is not None and batch_idx % self.accum == self.accum - 1:
            self.reads.__exit__(None, None, None)
            self.per_step.append(_summary(self.reads))
            self.reads = None


def _summary(reads):
    return {"engine": reads.engine, "outside": reads.outside, "by_site": reads.by_site(),
            "sites": [list(s) for s in reads.listing()]}


def run_trainer(variant, world, steps, warmup):
    accum, clip = variant.get("accum", 1), variant.get("clip")
    options = _options(variant)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))  # each rank its own batches
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (steps * accum * BATCH, SEQ + 1), generator=g))
    count = Count(accum, warmup)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=lightning_mics.MiCSStrategy(**options),
                        precision=variant.get("precision", "32-true"), max_steps=steps, accumulate_grad_batches=accum,
                        gradient_clip_val=0.05 if clip else None,
                        gradient_clip_algorithm="value" if clip == "value" else "norm",
                        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, enable_checkpointing=False, callbacks=[count],
                        use_distributed_sampler=False)
    torch.manual_seed(0)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=BATCH))
    return {"name": variant["name"], "per_step": count.per_step}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", required=True)
    args = ap.parse_args()
    results = []
    for v in json.loads(args.variants):
        results.append((run_trainer if v.get("trainer") else run)(v, args.world, args.steps, args.warmup))
    rank = torch.distributed.get_rank()
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
