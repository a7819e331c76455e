"""One rank of the DiLoCo runs: a small residual MLP regression (two blocks as units, a head; weights sharded, biases
replicated) trained with a real Trainer + MiCSStrategy, once per variant of strategy options. Every rank writes its
replica's full parameters after fit, the collectives it saw per batch on its replica group, the engine's fragments
(the parameter names of each and this rank's elements of each), and rank 0 the single-process simulation of the same
algorithm for each variant (``simulate``): the replica groups' inner loops run in turn on their own ranks' batches,
then the same outer step (streaming: per fragment, on its steps). ``--late K ...`` runs variants K again with every
collective finishing late ([Note: late collectives] in tests/helpers/late_collectives.py).

[Note: the int8 outer bound]
A run whose only outer step is its last (steps = H) differs from the simulation by the quantization of that step
alone. The int8 all-reduce of [Note: quantized all-reduce] (lightning_mics/comm/quantized.py) is off by at most
(2/254 + (r + 6) U) sum_i A_i per element of the sum (A_i: the absmax of replica i's pseudo-gradient in the block,
at most its inf-norm; U = 2^-24); the mean divides that by r. The first outer SGD step with momentum mu applies
lr (1 + mu) g under Nesterov (lr g without), so each parameter is off by at most
lr (1 + mu [nesterov]) (2/254 + (r + 6) U) mean_i ||g_i||_inf, plus the fp32 rounding of the unquantized run.
"""

import argparse
import contextlib
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
from tests.helpers.late_collectives import LateCollectives  # noqa: E402

D, HID, OUT = 7, 13, 3
LR, MOMENTUM = 0.05, 0.5
U = 2.0 ** -24


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, HID), nn.Linear(HID, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build():
    torch.manual_seed(1234)
    return Net()


def inner_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build()

    def training_step(self, batch, idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return inner_optimizer(self.model.parameters())


class ReplicaTraffic(L.Callback):
    """Per batch: the collectives on this rank's replica group (op, bytes), from the dispatcher."""

    def __init__(self, replica):
        self.replica, self.mode, self.per_batch = tuple(replica), None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = CommCounter()
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.per_batch.append([[op, n] for op, g, n in self.mode.events if g and tuple(g) == self.replica])


def data(world, batch, steps, accum):
    n = world * batch * steps * accum
    g = torch.Generator().manual_seed(99)
    x = torch.randn(n, D, generator=g)
    y = torch.sin(x[:, :OUT] * 2) + 0.1 * torch.randn(n, OUT, generator=g)
    return x, y


def rank_batches(world, batch, k, m):
    """The sample indices of rank k's m-th micro-batch (DistributedSampler without shuffle: k, k + W, ...)."""
    return torch.arange(k + m * batch * world, k + (m + 1) * batch * world, world)


# the engine's units as the simulation cuts them into fragments ([Note: streaming fragments] in
# lightning_mics/engine/fragments.py): the root (the head), then the blocks; the test checks the engine made these
FRAGMENTS = {1: [["head", "blocks.0", "blocks.1"]], 2: [["head", "blocks.0"], ["blocks.1"]],
             3: [["head"], ["blocks.0"], ["blocks.1"]]}


def simulate(v, world, batch, x, y, groups):
    """The algorithm in one process, fp32: each replica group (its ranks' batches, the gradient averaged over them and
    the window's micro-batches, clipped, an inner SGD step) in turn, then every ``sync_every`` steps the outer SGD on
    the averaged pseudo-gradient. ``groups``: the ranks of each replica group ([range(world)]: exact sync).
    Streaming (``sync_fragments`` F, ``sync_delay`` tau, ``fragment_mixing`` alpha): fragment f's pseudo-gradients
    are taken tau steps before the steps n with n mod H = (f + 1) H / F, and there the outer SGD steps its anchors
    with their mean and its parameters become lerp(anchor, parameter, alpha)."""
    A, clip, steps = v.get("accum", 1), v.get("clip"), v["steps"]
    diloco = v.get("replica_sync") == "diloco"
    models = [build() for _ in groups]
    opts = [inner_optimizer(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=v.get("outer_lr", 0.7), momentum=v.get("outer_momentum", 0.9),
                            nesterov=v.get("outer_nesterov", True)) if diloco else None
    H, frags, tau, alpha = v.get("sync_every", 1), v.get("sync_fragments", 1), v.get("sync_delay", 0), \
        v.get("fragment_mixing", 0.0)
    names = [n for n, _ in models[0].named_parameters()]
    members = [[j for j, n in enumerate(names) if n.rsplit(".", 2)[0] in frag]
               for frag in FRAGMENTS[frags]]
    period, sent = H // frags, None  # sent: (fragment, its mean pseudo-gradient, the per-replica ones)
    pseudo, clipped = [], 0
    for step in range(steps):
        for model, opt, ranks in zip(models, opts, groups):
            for m in range(step * A, (step + 1) * A):
                loss = sum(F.mse_loss(model(x[i]), y[i]) for i in (rank_batches(world, batch, k, m) for k in ranks))
                (loss / (len(ranks) * A)).backward()
            if clip is not None:
                clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip)
            opt.step()
            opt.zero_grad()
        n = step % H + 1  # the inner step of the window
        if diloco and (n + tau) % period == 0:
            f = (n + tau) // period - 1
            with torch.no_grad():
                per = [[anchor[j] - list(m.parameters())[j] for j in members[f]] for m in models]
                sent = (f, [sum(pg[i] for pg in per) / len(models) for i in range(len(members[f]))], per)
        if diloco and sent is not None and n == (sent[0] + 1) * period:
            f, mean, pseudo = sent
            sent = None
            with torch.no_grad():
                for j, g in zip(members[f], mean):
                    anchor[j].grad = g
                outer.step()
                for j in members[f]:
                    anchor[j].grad = None
                    for m in models:
                        p = list(m.parameters())[j]
                        p.copy_(torch.lerp(anchor[j], p, alpha) if alpha else anchor[j])
    out = {"params": [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist() for m in models],
           "clipped": clipped}  # inner steps (over the replicas) whose gradient the clipping scaled down
    if pseudo:  # the last outer step's per-replica pseudo-gradients' inf-norms ([Note: the int8 outer bound])
        out["pseudo_inf"] = [max(g.abs().max().item() for g in pg) for pg in pseudo]
    return out


class Fragments(L.Callback):
    """The engine's fragments at the end of fit: each one's parameter names (module prefixes) and this rank's
    elements of it."""

    def __init__(self):
        self.names, self.numels = [], []

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        outer = engine.outer
        if outer is None:
            return
        for units, which in zip(outer.fragment_units, outer.fragments):
            params = [p for u in units for p in [*engine.units[u].params, *engine.units[u].replicated]]
            prefixes = {r.fqn.removeprefix("model.").rsplit(".", 2)[0] for p in params for r in p.refs}
            self.names.append(sorted(prefixes))
            self.numels.append(sum(outer.masters[i].numel() for i in which))


@contextlib.contextmanager
def average_read_unwaited():
    """A defect planted on purpose, to show the late device can fail a run: a fragment's average is used where it
    applies without waiting for its all-reduce (read as the flat holds it then). On gloo's prompt collectives the
    all-reduce has long finished by then; with the replica group's collectives late it has not. The all-reduce is
    still waited for after the read (its result unused), so that none is left in the late device's queue when the
    fit tears its groups down (with one left there, one rank of four did not end the fit in two launches of four)."""
    from lightning_mics.engine.fragments import Average

    real = Average.wait

    def unwaited(self):
        if not self.done:
            early = self.flat.clone()  # what the flat holds before the wait: the sum not yet made where it is late
            real(self)
            self.flat = early.mul_(1.0 / self.replicas)
        return self.flat

    Average.wait = unwaited
    try:
        yield
    finally:
        Average.wait = real


def run_variant(v, world, rank, train, late=0.0, slow=0.0, planted=False):
    v = dict(v)
    steps, accum, clip, s = v.pop("steps"), v.pop("accum", 1), v.pop("clip", None), v.pop("s", 2)
    precision = v.pop("precision", "32-true")
    replica = [j for j in range(world) if j % s == rank % s]
    traffic, fragments = ReplicaTraffic(replica), Fragments()
    strategy = MiCSStrategy(sharded_data_parallel_degree=s, param_persistence_threshold=20, **v)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, precision=precision,
                        accumulate_grad_batches=accum, gradient_clip_val=clip, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, enable_checkpointing=False, callbacks=[traffic, fragments],
                        use_distributed_sampler=False)
    module = Module()
    mode = LateCollectives(late, {tuple(replica): slow}) if late else None
    if mode is not None:
        mode.__enter__()
    try:
        with average_read_unwaited() if planted else contextlib.nullcontext():
            trainer.fit(module, train)
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    # after fit the module is plain again: this replica's full parameters
    params = torch.cat([p.detach().reshape(-1) for p in module.model.parameters()]).tolist()
    return {"params": params, "replica_traffic": traffic.per_batch, "fragments": fragments.names,
            "fragment_numels": fragments.numels, "late_issued": dict(mode.issued) if mode is not None else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--variants", required=True, help="JSON list of strategy options with steps/accum/clip/s")
    ap.add_argument("--late", type=int, nargs="*", default=[], help="variants run again with late collectives")
    ap.add_argument("--delay", type=float, default=0.03, help="seconds each collective finishes late (--late)")
    ap.add_argument("--planted", type=int, help="a variant run twice more with the replica group's collectives 1 s "
                    "late: as it is, and with its averages read unwaited (average_read_unwaited)")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    variants = json.loads(args.variants)
    x, y = data(world, args.batch, max(v["steps"] for v in variants), max(v.get("accum", 1) for v in variants))
    train_set = TensorDataset(x, y)
    train = DataLoader(train_set, batch_size=args.batch,
                       sampler=DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=False))
    result = {"rank": rank, "runs": [run_variant(v, world, rank, train) for v in variants]}
    result["late"] = {str(k): run_variant(variants[k], world, rank, train, late=args.delay) for k in args.late}
    if args.planted is not None:
        v = variants[args.planted]
        result["slow"] = {kind: run_variant(v, world, rank, train, late=args.delay, slow=1.0, planted=kind == "planted")
                          for kind in ("honest", "planted")}
    if rank == 0:
        sims = []
        for v in variants:
            s = v.get("s", 2)
            groups = [list(range(g * s, (g + 1) * s)) for g in range(world // s)]
            sims.append(simulate(v, world, args.batch, x, y, groups if v.get("replica_sync") == "diloco"
                                 else [list(range(world))]))
        result["sims"] = sims
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
