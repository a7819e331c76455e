"""One rank of a tensor-parallel equivalence run: a small GPT whose attention (q, k, v column-parallel, the
output projection row-parallel) and MLP (fc column-parallel, proj row-parallel) are parallelized in
``configure_model`` on ``self.device_mesh["tp"]``, trained with MiCSStrategy(tensor_parallel_degree=t);
rank 0 then trains the plain model in one process on the same global batches and compares parameters.

Lightning's own DistributedSampler is used (``use_distributed_sampler=True`` over a sequential loader), so
the sampler kwargs the strategy gives it are what is tested: with ``prescaled_batch`` each tensor-parallel
group reads one batch; without it each rank reads its own and the group concatenates them.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

VOCAB, SEQ, D, HEADS = 61, 8, 32, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        hd = D // HEADS  # local heads: -1 (HEADS / t under tensor parallelism)
        q, k, v = (m(x).view(B, T, -1, hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, tgt):
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))


PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}


def build():
    torch.manual_seed(1234)
    return TinyGPT()


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build()
        self.losses = []

    def configure_model(self):
        if "tp" not in self.device_mesh.mesh_dim_names:  # t = 1: the control run
            return
        tp = self.device_mesh["tp"]
        for block in self.model.blocks:
            parallelize_module(block, tp, PLAN)

    def training_step(self, batch, idx):
        loss = self.model.loss(*batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


class Count(L.Callback):
    def __init__(self):
        self.per_batch, self.mode = [], None

    def on_train_batch_start(self, *_):
        self.mode = CommCounter()
        self.mode.__enter__()

    def on_train_batch_end(self, *_):
        self.mode.__exit__(None, None, None)
        self.per_batch.append([[op, list(g) if g else None, n] for op, g, n in self.mode.events])


def reference(x, y, global_batch, steps, clip):
    model = build()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        idx = slice(step * global_batch, (step + 1) * global_batch)
        loss = model.loss(x[idx], y[idx])
        losses.append(loss.item())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return init, model.state_dict(), losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--t", type=int, default=2)
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--prescaled", action="store_true")
    ap.add_argument("--resume", action="store_true", help="also: sharded checkpoint after the epoch, resume, "
                    "one more step; against the same run without the interruption")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--full", action="store_true", help="also: a full checkpoint file (state_dict_type='full') "
                    "resumed at t and at t=1, and the sharded checkpoint consolidated and resumed at t")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    readers = world // args.t if args.prescaled else world  # sampler shards
    per_step = readers * args.batch
    n = per_step * args.steps
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    # Lightning's DistributedSampler (training loaders are shuffled: torch.randperm with seed 0 in epoch 0) gives
    # reader k the positions perm[k], perm[k + R], ... (R readers); place the data so that reader k's m-th
    # sample of step i is sample i*per_step + k*batch + m: step i's global batch is then exactly samples
    # [i*per_step, (i+1)*per_step), as in the reference
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    order = torch.empty(n, dtype=torch.long)
    for i in range(args.steps):
        for k in range(readers):
            for m in range(args.batch):
                order[perm[k + readers * (i * args.batch + m)]] = i * per_step + k * args.batch + m
    train = DataLoader(TensorDataset(x[order], y[order]), batch_size=args.batch)

    def fit(steps, callbacks=(), ckpt_path=None, t=args.t, state_dict_type="sharded"):
        strategy = MiCSStrategy(sharded_data_parallel_degree=args.s, tensor_parallel_degree=t,
                                prescaled_batch=args.prescaled, param_persistence_threshold=0,
                                state_dict_type=state_dict_type)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                            gradient_clip_val=args.clip or None, enable_progress_bar=False, precision=args.precision,
                            enable_model_summary=False, logger=False, enable_checkpointing=False,
                            callbacks=list(callbacks))
        module = Module()
        trainer.fit(module, train, ckpt_path=ckpt_path)
        return trainer, module

    count = Count()
    trainer, module = fit(args.steps, [count])
    full = trainer.strategy.lightning_module_state_dict()
    resumed_err = None
    if args.resume:
        ckpt = Path(args.out) / "tp.ckpt"
        trainer.save_checkpoint(ckpt)
        straight, _ = fit(args.steps + 1)
        want = straight.strategy.lightning_module_state_dict()
        again, _ = fit(args.steps + 1, ckpt_path=ckpt)
        got = again.strategy.lightning_module_state_dict()
        if rank == 0:
            resumed_err = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    full_ckpt = {}
    if args.full:
        full_ckpt = full_checkpoints(args, rank, fit, trainer)
    result = {"rank": rank, "global_step": trainer.global_step, "comms": count.per_batch, "losses": module.losses,
              "resumed_max_abs": resumed_err, "full_ckpt": full_ckpt,
              "sampler": trainer.strategy.distributed_sampler_kwargs,
              "tp_placements": sorted({str(getattr(p, "placements", None)) for p in module.parameters()})}
    if rank == 0:
        init, ref, result["ref_losses"] = reference(x, y, per_step, args.steps, args.clip)
        errs = {}
        for k, r in ref.items():
            got = full[f"model.{k}"].float()
            errs[k] = {"rel_norm": (got - r).norm().item() / max(r.norm().item(), 1e-12),
                       "diff_norm": (got - r).norm().item(), "ref_norm": r.norm().item(),
                       "moved": (r - init[k]).norm().item(), "shape_ok": list(got.shape) == list(r.shape)}
        result["errors"] = errs
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


def full_checkpoints(args, rank, fit, trainer):
    """A full checkpoint of the tensor-parallel run: the file holds global tensors (parameters and optimizer
    state); resumed at the same t it equals the uninterrupted run exactly, and resumed at t = 1 (each rank cuts
    its own part) it equals it up to summation order. The sharded checkpoint, consolidated into one file,
    resumes at t the same way; the sharded directory itself resumes at t = 1 (DCP reshards)."""
    out = Path(args.out)
    trainer.strategy.options = replace(trainer.strategy.options, state_dict_type="full")  # the same trained state, saved as one file
    trainer.save_checkpoint(out / "tp_full.ckpt")
    trainer.strategy.options = replace(trainer.strategy.options, state_dict_type="sharded")
    trainer.save_checkpoint(out / "tp_sharded.ckpt")
    if rank == 0:
        from lightning_mics.checkpoint.state import consolidate

        torch.save(consolidate(out / "tp_sharded.ckpt"), out / "tp_consolidated.ckpt")
    trainer.strategy.barrier()
    straight, _ = fit(args.steps + 1, state_dict_type="full")
    want = straight.strategy.lightning_module_state_dict()
    runs = {"full_same_t": fit(args.steps + 1, ckpt_path=out / "tp_full.ckpt", state_dict_type="full")[0],
            "full_t1": fit(args.steps + 1, ckpt_path=out / "tp_full.ckpt", t=1)[0],
            "consolidated_same_t": fit(args.steps + 1, ckpt_path=out / "tp_consolidated.ckpt")[0],
            "sharded_t1": fit(args.steps + 1, ckpt_path=out / "tp_sharded.ckpt", t=1)[0]}
    got = {name: t.strategy.lightning_module_state_dict() for name, t in runs.items()}
    if rank != 0:
        return {}
    res = {}
    for name, sd in got.items():
        res[name] = {k: ((sd[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12)).item()
                     for k, v in want.items()}
    saved = torch.load(out / "tp_full.ckpt", weights_only=False)
    plain = {f"model.{k}": v for k, v in build().state_dict().items()}
    res["file_shapes_ok"] = all(tuple(saved["state_dict"][k].shape) == tuple(v.shape) for k, v in plain.items())
    params = list(build().parameters())  # configure_optimizers: self.parameters(), the same order
    states = saved["optimizer_states"][0]["state"]
    res["optimizer_shapes_ok"] = len(states) == len(params) and all(
        tuple(v.shape) == tuple(params[int(k)].shape) for k, st in states.items() for n, v in st.items()
        if torch.is_tensor(v) and v.dim() > 0)
    return res


if __name__ == "__main__":
    main()
