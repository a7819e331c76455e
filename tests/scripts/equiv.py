"""One rank of an equivalence run: trains with a real Trainer + MiCSStrategy, then (rank 0) trains the same
model with a plain single-process loop on the same global batches and compares every parameter.

Also reports: model-state bytes vs the ideal, and per-step collective counts from a TorchDispatchMode.
"""

import argparse
import json
import math
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

import lightning_mics  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

VOCAB, SEQ = 61, 12  # deliberately odd sizes: uneven shards and padding


class TiedFrozen(nn.Module):
    """Tied embedding/head, a frozen projection, a parameter unused in the loss, a module called twice,
    and a module whose forward uses another module's weight (the seed's register_parameter case)."""

    def __init__(self) -> None:
        super().__init__()
        d = 24
        self.emb = nn.Embedding(VOCAB, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 40), nn.GELU(), nn.Linear(40, d)) for _ in range(2))
        self.shared = nn.Linear(d, d)  # called twice per forward
        self.unused = nn.Linear(d, 17)  # never part of the loss
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        lightning_mics.register_parameter(self.mix, self.frozen.weight)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.frozen(x)
        for b in self.blocks:
            x = x + b(x)
        x = self.shared(torch.tanh(self.shared(x)))
        x = self.mix(x) + F.linear(x, self.frozen.weight) * 0.1
        return self.head(x)

    def loss(self, idx, tgt):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))


class DemoTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.net = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=48, nlayers=2, dropout=0.0)

    def loss(self, idx, tgt):
        out = self.net(idx, tgt)
        return F.nll_loss(out, tgt.reshape(-1))


def build(name):
    torch.manual_seed(1234)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))
    if name == "demo":
        return DemoTransformer()
    if name == "tied":
        return TiedFrozen()
    raise ValueError(name)


def make_optimizer(model, kind):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.5, momentum=0.9)
    # eps=1e-6: attention's key bias has an exactly-zero true gradient; with eps=1e-8 Adam turns fp32 round-off
    # there (~1e-9) into lr-sized updates, so no two summation orders could agree. 1e-6 is negligible for real ones.
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-6)


class Module(L.LightningModule):
    def __init__(self, name, opt):
        super().__init__()
        self.model = build(name)
        self.opt = opt

    def training_step(self, batch, idx):
        if os.environ.get("DEBUG_BATCH"):
            print("BATCH", self.global_rank, idx, batch[0][:, :3].tolist(), flush=True)
        return self.model.loss(*batch)

    def validation_step(self, batch, idx):
        self.log("val_loss", self.model.loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.model, self.opt)


class CountComms(L.Callback):
    """Records the collectives of every training batch (forward, backward, and optimizer step)."""

    def __init__(self):
        self.mode, self.per_batch, self.stats = None, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = CommCounter()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.per_batch.append([[op, list(g) if g else None, n] for op, g, n in self.mode.events])
        self.stats.append(dict(trainer.strategy.comm_stats))


def data(world, batch, steps, accum):
    n = world * batch * steps * accum
    g = torch.Generator().manual_seed(99)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def reference(args, world, x, y):
    torch.manual_seed(0)
    model = build(args.model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model, args.optimizer)
    b, A = args.batch, args.accum
    per_rank = [torch.arange(k, x.size(0), world) for k in range(world)]
    norms = []
    for step in range(args.steps):
        for m in range(step * A, (step + 1) * A):
            idx = torch.cat([r[m * b:(m + 1) * b] for r in per_rank])
            (model.loss(x[idx], y[idx]) / A).backward()
        if args.clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        opt.step()
        opt.zero_grad()
    return init, model.state_dict(), norms


def plain_state_bytes(module, optimizer_kind):
    """Bytes one plain process holds: params + grads + optimizer state (SGD momentum: 1, AdamW: 2 tensors)."""
    per_trainable = 1 + (1 if optimizer_kind == "sgd" else 2)
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size() * (1 + (per_trainable if p.requires_grad else 0))
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--threshold", type=int, default=100)
    ap.add_argument("--bucket", type=int, default=int(5e8))
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--extra", default="{}")
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    x, y = data(world, args.batch, args.steps, args.accum)
    # Our own sampler: rank k sees samples k, k+W, ... in order (Lightning's own one would shuffle).
    train_set = TensorDataset(x, y)
    train = DataLoader(train_set, batch_size=args.batch,
                       sampler=DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=False))
    val_set = TensorDataset(x[: world * 2], y[: world * 2])
    val = DataLoader(val_set, batch_size=2, sampler=DistributedSampler(val_set, world, rank, shuffle=False))
    strategy = MiCSStrategy(sharded_data_parallel_degree=args.s, param_persistence_threshold=args.threshold,
                            reduce_bucket_size=args.bucket, state_dict_type="full", **json.loads(args.extra))
    counter = CountComms()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
        accumulate_grad_batches=args.accum, gradient_clip_val=args.clip or None, precision=args.precision,
        limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=args.steps * args.accum,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
        callbacks=[counter] if args.count else [], use_distributed_sampler=False,
    )
    torch.manual_seed(0)
    module = Module(args.model, args.optimizer)
    n_params = sum(p.numel() for p in module.parameters())
    plain_bytes = plain_state_bytes(module, args.optimizer)
    per_trainable = 1 + (1 if args.optimizer == "sgd" else 2)

    state_bytes = {}

    class Grab(L.Callback):
        def on_train_end(self, trainer, pl_module):
            state_bytes.update(trainer.strategy.model_state_bytes())
            eng = trainer.strategy.engine
            state_bytes["replicated_plain"] = sum(
                rp.local.numel() * rp.local.element_size() * (1 + (per_trainable if rp.requires_grad else 0))
                for rp in eng.replicated)
            state_bytes["plain"] = plain_bytes
            state_bytes["n_buckets"] = sum(len(u.buckets(u.trainable())) for u in eng.units)
            state_bytes["n_units"] = sum(1 for u in eng.units if u.full_numel)

    trainer.callbacks.append(Grab())
    trainer.fit(module, train, val)
    full = trainer.strategy.lightning_module_state_dict()  # after fit: module restored, plain state dict
    result = {"rank": rank, "state_bytes": state_bytes, "n_params": n_params,
              "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
              "comms": counter.per_batch, "stats": counter.stats, "global_step": trainer.global_step}
    if rank == 0:
        init, ref, norms = reference(args, world, x, y)
        result["ref_norms"] = norms
        got = module.model.state_dict()
        result["full_sd_keys_match"] = sorted(full) == sorted(module.state_dict())
        errs = {}
        for k, r in ref.items():
            g = got[k].float()
            moved = (r.float() - init[k].float()).norm().item()
            errs[k] = {"max_abs": (g - r.float()).abs().max().item(), "ref_max": r.float().abs().max().item(),
                       "moved": moved, "rel_update": (g - r.float()).norm().item() / max(moved, 1e-12),
                       "rel_norm": (g - r.float()).norm().item() / max(r.float().norm().item(), 1e-12),
                       "shape_ok": list(g.shape) == list(r.shape)}
        result["errors"] = errs
        torch.save({"ref": ref, "got": got, "init": init}, Path(args.out) / "params.pt")
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
