"""One rank of the quantized-traffic equivalence runs: a linear model (nn.Linear(23, 11), MSE, plain SGD) trained
with a real Trainer + MiCSStrategy, once per variant of strategy options; rank 0 compares each variant's
parameters with the unquantized variant and with a float64 single-process reference on the same global batches,
against a bound derived from the per-block quantization error.

[Note: the equivalence bound]
Linear least squares makes every gradient affine in the parameters p: the window's gradient is G(p) = H p - beta,
and replica i's contribution to the replica all-reduce (its shard group's reduce-scattered, accumulated sum, the
1/(A dp) scale included) is c_i(p) = H_i p - beta_i with sum_i c_i = G. A quantized run applies G(p_t) + e_t, so
its distance to the exact run, delta_t = ||p_t - p*_t||_2, obeys
    delta_{t+1} <= ||I - lr H_t||_2 delta_t + lr ||e_t||_2,
and ||c_i(p_t)||_inf <= ||c_i(p*_t)||_inf + ||H_i||_2 delta_t =: C_i,t. Per element ([Note: quantized all-reduce]):
  quantize_gradients=True:  |e| <= (2/254 + (r + 6) U) sum_i C_i (each block's absmax is at most the inf-norm);
  "error_feedback":          the applied sum is sum_i (c_i + eps_i,t-1 - eps_i,t) + g_t-1 - g_t, with the
                             residuals bounded step by step: E_i,t = (C_i + E_i,t-1)(1/254 + 3U),
                             S_t = sum_i (C_i + E_i,t-1 + E_i,t), Gs_t = (S_t + Gs_t-1)(1/254 + 3U),
                             |e| <= sum_i (E_i,t-1 + E_i,t) + Gs_t-1 + Gs_t + (r + 8) U (S_t + Gs_t-1);
  quantize_allgather:        the forward and backward see p + q, |q| <= (1/254 + 3U) ||p_t||_inf per element, so
                             e = H q and ||e||_2 <= ||H||_2 sqrt(n) (1/254 + 3U) (||p*_t||_inf + delta_t).
||e||_2 <= sqrt(n) |e|_inf for the first two. Everything on the right is computed here in float64 from the
reference trajectory p*_t (H_i by autograd). The runs also round in fp32 outside the quantization, as the
unquantized run does: the test allows twice that run's own measured distance to p*_N on top of the bound.
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

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402

D_IN, D_OUT = 23, 11
LR = 0.05
U = 2.0 ** -24


def build(dtype=torch.float32):
    torch.manual_seed(1234)
    return nn.Linear(D_IN, D_OUT).to(dtype)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build()

    def training_step(self, batch, idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=LR)


class CountComms(L.Callback):
    def __init__(self):
        self.mode, self.per_batch = None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = CommCounter()
        self.mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        """This rank's chunks once the last rows have arrived (every replica of a shard rank holds the same bits)."""
        engine = trainer.strategy.engine
        engine.release_idle()
        self.chunks = torch.cat([sp.local.reshape(-1) for u in engine.units for sp in u.params]).tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.per_batch.append([[op, list(g) if g else None, n] for op, g, n in self.mode.events])
        self.mode = None


def data(world, batch, steps, accum):
    n = world * batch * steps * accum
    g = torch.Generator().manual_seed(99)
    x = torch.randn(n, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g)
    y = x @ w + 0.5 * torch.randn(n, D_OUT, generator=g)
    return x, y


def window_batches(args, world, step, A):
    """Per rank, the sample indices of each micro-batch of optimizer step ``step`` (rank k sees k, k+W, ...)."""
    b = args.batch
    per_rank = [torch.arange(k, world * b * args.steps * A, world) for k in range(world)]
    return [[per_rank[k][m * b:(m + 1) * b] for m in range(step * A, (step + 1) * A)] for k in range(world)]


def flat_params(model):
    return torch.cat([model.weight.reshape(-1), model.bias.reshape(-1)])


def window_loss(p, x, y, idx_lists, scale):
    """scale * sum over the listed micro-batches of the mse loss at the flat parameters p (weight, then bias)."""
    w, b = p[:D_IN * D_OUT].view(D_OUT, D_IN), p[D_IN * D_OUT:]
    return sum(F.mse_loss(x[i] @ w.T + b, y[i]) for i in idx_lists) * scale


def replicas_of(world, s):
    """Replica i = shard group i = ranks i*s .. i*s + s - 1 (topology.py's layout: shard groups contiguous)."""
    return [list(range(i * s, (i + 1) * s)) for i in range(world // s)]


def _replica_terms(p, x64, y64, batches, groups, scale):
    """Per replica i: c_i(p) and ||H_i||_2 (c_i is affine in p: its Hessian is its exact slope); and H's
    eigenvalues (H = sum_i H_i, the same for every grouping)."""
    cs, Hs = [], []
    for ranks in groups:
        idx = [i for k in ranks for i in batches[k]]
        loss = lambda q, idx=idx: window_loss(q, x64, y64, idx, scale)  # noqa: E731
        cs.append(torch.func.grad(loss)(p))
        Hs.append(torch.func.hessian(loss)(p))
    h_norms = [torch.linalg.eigvalsh((h + h.T) / 2).abs().max().item() for h in Hs]
    H = sum(Hs)
    return cs, h_norms, torch.linalg.eigvalsh((H + H.T) / 2)


def _error_norm(v, st, C, n, h_max, p_inf):
    """A bound on ||e_t||_2 for variant v ([Note: the equivalence bound]); updates the residual bounds in st."""
    qg, r = v.get("quantize_gradients", False), len(C)
    e2 = 0.0
    if qg == "error_feedback":
        E_new = [(Ci + Ei) * (1 / 254 + 3 * U) for Ci, Ei in zip(C, st["E"])]
        S = sum(Ci + Ei + En for Ci, Ei, En in zip(C, st["E"], E_new))
        G_new = (S + st["Gs"]) * (1 / 254 + 3 * U)
        e_inf = sum(st["E"]) + sum(E_new) + st["Gs"] + G_new + (r + 8) * U * (S + st["Gs"])
        st["E"], st["Gs"] = E_new, G_new
        e2 += math.sqrt(n) * e_inf
    elif qg:
        e2 += math.sqrt(n) * (2 / 254 + (r + 6) * U) * sum(C)
    if v.get("quantize_allgather", False):
        e2 += h_max * math.sqrt(n) * (1 / 254 + 3 * U) * (p_inf + st["delta"])
    return e2


def reference_and_bounds(args, world, x, y, variants, A):
    """The float64 trajectory p*_t with accumulation A and, per variant, the bound delta_N of
    [Note: the equivalence bound]."""
    x64, y64 = x.double(), y.double()
    p = flat_params(build(torch.float64)).detach().clone()
    n, scale = p.numel(), 1.0 / (A * world)
    degrees = [v.get("s", args.s) for v in variants]
    state = [dict(delta=0.0, E=[0.0] * (world // s), Gs=0.0) for s in degrees]
    for step in range(args.steps):
        batches = window_batches(args, world, step, A)
        terms = {s: _replica_terms(p, x64, y64, batches, replicas_of(world, s), scale) for s in set(degrees)}
        for v, s, st in zip(variants, degrees, state):
            cs, h_norms, eig = terms[s]
            contraction = max(abs(1 - LR * eig.min().item()), abs(1 - LR * eig.max().item()))
            C = [c.abs().max().item() + hn * st["delta"] for c, hn in zip(cs, h_norms)]
            e2 = _error_norm(v, st, C, n, eig.abs().max().item(), p.abs().max().item())
            st["delta"] = contraction * st["delta"] + LR * e2
        p = p - LR * sum(terms[degrees[0]][0])
    return p, [st["delta"] for st in state]


def run_variant(args, variant, world, rank, train):
    counter = CountComms()
    accum, s = variant.pop("accum"), variant.pop("s", args.s)
    strategy = MiCSStrategy(sharded_data_parallel_degree=s, param_persistence_threshold=0,
                            reduce_bucket_size=D_IN * D_OUT, state_dict_type="full", **variant)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=accum, precision=args.precision, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, enable_checkpointing=False, callbacks=[counter],
                        use_distributed_sampler=False)
    torch.manual_seed(0)
    module = Module()
    trainer.fit(module, train)
    full = trainer.strategy.lightning_module_state_dict()
    out = {"comms": counter.per_batch, "stats": dict(trainer.strategy.comm_stats),
           "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
           "chunks": counter.chunks}
    if rank == 0:
        out["dtypes"] = sorted({str(v.dtype) for v in full.values()})
        out["params"] = torch.cat([full["model.weight"].reshape(-1), full["model.bias"].reshape(-1)]).tolist()
    return out


def main():
    global D_IN
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--precision", default="32-true", help="the Trainer's precision for every variant")
    ap.add_argument("--in-features", type=int, default=D_IN, help="the linear model's input width")
    ap.add_argument("--variants", required=True,
                    help="JSON list of strategy options, each with its 'accum' (accumulate_grad_batches)")
    args = ap.parse_args()
    D_IN = args.in_features
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    variants = json.loads(args.variants)
    x, y = data(world, args.batch, args.steps, max(v["accum"] for v in variants))
    train_set = TensorDataset(x, y)
    train = DataLoader(train_set, batch_size=args.batch,
                       sampler=DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=False))
    runs = [run_variant(args, dict(v), world, rank, train) for v in variants]
    result = {"rank": rank, "runs": runs}
    if rank == 0:  # per accumulation: the float64 reference, and each variant's bound
        result["ref"], result["bounds"] = {}, [None] * len(variants)
        for A in sorted({v["accum"] for v in variants}):
            idx = [k for k, v in enumerate(variants) if v["accum"] == A]
            ref, deltas = reference_and_bounds(args, world, x, y, [variants[k] for k in idx], A)
            result["ref"][str(A)] = ref.tolist()
            for k, d in zip(idx, deltas):
                result["bounds"][k] = d
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
