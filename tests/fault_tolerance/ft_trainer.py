"""One rank of a fault-tolerant replica group (a torchrun job of its own), or the same job without fault tolerance,
or one plain process: a small GPT trained with AdamW on fixed token batches, each rank reading its part through
the strategy's ``distributed_sampler_kwargs``.

    --mode ft        MiCSStrategy(fault_tolerance=True) under torchft's environment (Trainer)
    --mode fabric    the same under Fabric, a hand-written loop that resumes at ``fault_tolerance.step_count``
    --mode mics      MiCSStrategy without fault tolerance (the same global batches over all ranks)
    --mode fabric-mics  the Fabric loop's batches under Fabric's MiCSStrategy without fault tolerance
    --mode plain     one process, the global batch of every step
    --diloco H       replica_sync="diloco", sync_every=H (all but plain; the outer defaults); ``--int8``: int8
                     pseudo-gradients (quantize_gradients=True); ``--fragments/--delay/--mixing``: streaming

Writes ``<out>/<tag>.pt`` (rank 0: the full parameters after the run, the global step, the quorum's summary;
under DiLoCo without fault tolerance also ``<tag>_replica1.pt``, the second replica's) and,
with ``--record``, ``<out>/<tag>_steps.jsonl`` (rank 0: one line per optimizer step: wall time, step, quorum,
committed) and ``<out>/<tag>_r<rank>_samples.jsonl`` (every rank: the sample indices of each batch), where ``tag``
is ``--tag`` (default: the mode, with the group id under fault tolerance). ``--resumable``: the training sampler
starts an epoch at the loop's batch (the main job's, lightning_mics/app/data.py), so a group that joins reads its
part from the job's position. ``--ckpt DIR``: a sharded checkpoint at the end, in DIR; ``--resume DIR``: from it (under Fabric
``fabric.load`` after setup when ``step_count`` is 0, the loop then at the checkpoint's position).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402
from lightning_mics.fabric import MiCSStrategy as FabricMiCS  # noqa: E402

VOCAB, SEQ, BATCH = 61, 12, 2  # per-rank batch
WIDTH, LAYERS = 32, 2  # --width, --layers (the benchmark's larger model)


def build():
    torch.manual_seed(1234)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=WIDTH))


OPT = "adamw"  # --opt


def optimizer(model):
    if OPT == "sgd":  # rounding differences stay rounding-sized (Adam scales small gradients up)
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6)


def dataset(n):
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(idx[:, :-1].contiguous(), idx[:, 1:].contiguous(), torch.arange(n))


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class Module(L.LightningModule):
    def __init__(self, samples, resumable, record):
        super().__init__()
        self.model = build()
        self.samples, self.resumable, self.record = samples, resumable, record

    def training_step(self, batch, idx):
        x, y, ids = batch
        if self.record:
            with open(f"{self.record}_r{self.trainer.global_rank}_samples.jsonl", "a") as f:
                f.write(json.dumps(ids.tolist()) + "\n")
        return loss_of(self.model, x, y)

    def configure_optimizers(self):
        return optimizer(self.model)

    def train_dataloader(self):
        data = dataset(self.samples)
        if not self.resumable:  # Lightning puts in its DistributedSampler (shuffled, seed 0)
            return DataLoader(data, batch_size=BATCH, shuffle=False)
        from lightning_mics.app.stream import StreamSampler

        done = lambda: self.trainer.fit_loop.epoch_loop.batch_progress.current.ready  # noqa: E731
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = StreamSampler(data, BATCH, done, seed=0, num_replicas=kwargs["num_replicas"], rank=kwargs["rank"])
        return DataLoader(data, batch_size=BATCH, sampler=sampler)


class Record(L.Callback):
    """Rank 0: a line per optimizer step (after it), and a pause that gives a test time to act mid-run
    (``pause_alone`` while the quorum holds this group only: a survivor still runs when its peer is back)."""

    def __init__(self, path, pause, pause_alone=None, hold=None):
        self.path, self.pause, self.last, self.hold = path, pause, -1, hold
        self.pause_alone = pause if pause_alone is None else pause_alone

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last:
            return
        self.last = trainer.global_step
        if self.path and trainer.global_rank == 0:
            ft = trainer.strategy.fault_tolerance
            log = ft.group.log if ft is not None else None
            line = {"t": time.time(), "step": trainer.global_step,
                    "quorum": log.participants[-1] if log and log.participants else None,
                    "committed": log.committed[-1] if log and log.committed else True,
                    "committed_steps": ft.group.step if ft is not None else trainer.global_step}
            outer = trainer.strategy.engine.outer
            if outer is not None:  # DiLoCo: rank 0's masters and anchors (sums), the syncs not taken
                line.update(masters=sum(m.double().sum().item() for m in outer.masters), dropped=outer.dropped,
                            anchors=sum(a.double().sum().item() for a in outer.anchors or []))
                if len(outer.fragments) > 1:  # streaming: the same sums per fragment
                    line.update(fragment_masters=[sum(outer.masters[i].double().sum().item() for i in f)
                                                  for f in outer.fragments],
                                fragment_anchors=[sum(outer.anchors[i].double().sum().item() for i in f)
                                                  for f in outer.fragments] if outer.anchors else None)
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        ft = trainer.strategy.fault_tolerance
        alone = ft is not None and ft.group.log.participants and ft.group.log.participants[-1] == 1
        time.sleep(self.pause_alone if alone else self.pause)
        if trainer.global_step == self.hold:  # a group a test kills here
            time.sleep(120)


class SaveAtEnd(L.Callback):
    """A sharded checkpoint at the batch whose optimizer step ends training (callbacks' states included)."""

    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.path and trainer.global_step == trainer.max_steps:
            trainer.save_checkpoint(self.path)


class CrossTraffic(L.Callback):
    """Under fault tolerance, every call this group makes to torchft's Manager that crosses the groups (its quorum,
    its allreduce, or the int8 mean over its process group), with the loop's batch at the call (-1: before the
    first), counted on the Manager itself."""

    def __init__(self, error_at=None):
        self.events, self.error_at = [], error_at

    def on_fit_start(self, trainer, pl_module):
        ft = trainer.strategy.fault_tolerance
        if ft is None:
            return
        manager, progress = ft.group.manager, trainer.fit_loop.epoch_loop.batch_progress.total

        def counted(name, fn):
            def call(*a, **k):
                numel = a[0].numel() if a and isinstance(a[0], torch.Tensor) else 0
                self.events.append([progress.ready - 1, name, numel])
                calls = sum(1 for e in self.events if e[1] == name)
                out = fn(*a, **k)
                if name == "allreduce" and calls == self.error_at and trainer.global_rank == 0:
                    manager.report_error(RuntimeError("an error the test reports"))  # once the average is sent
                return out
            return call

        manager.start_quorum = counted("quorum", manager.start_quorum)
        manager.allreduce = counted("allreduce", manager.allreduce)
        ft.group.quantized_mean = counted("allreduce", ft.group.quantized_mean)  # int8: over the manager's group


def strategy_options(args):
    diloco = {"replica_sync": "diloco", "sync_every": args.diloco} if args.diloco else {}
    if args.int8:
        diloco["quantize_gradients"] = True
    if args.fragments > 1:  # streaming DiLoCo
        diloco.update(sync_fragments=args.fragments, sync_delay=args.delay, fragment_mixing=args.mixing)
    return {"sharded_data_parallel_degree": args.s, "param_persistence_threshold": 100,
            "fault_tolerance": args.mode in ("ft", "fabric"), "timeout": 120, **diloco}


def second_replica(args):
    """The first rank of the second replica of a DiLoCo job without fault tolerance (whose model, between syncs, is
    its own: what group 1 of a fault-tolerant job computes), or None."""
    return args.s if args.mode in ("mics", "fabric-mics") and args.diloco else None


def run_trainer(args, tag):
    record = str(Path(args.out) / f"{tag}_steps.jsonl") if args.record else None
    traffic = CrossTraffic(args.error_at)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        num_nodes=args.num_nodes, strategy=MiCSStrategy(**strategy_options(args)), max_steps=args.steps,
                        accumulate_grad_batches=args.accum, precision=args.precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record(record, args.pause, args.pause_alone, args.hold), SaveAtEnd(args.ckpt),
                                   traffic])
    model = Module(args.samples, args.resumable, str(Path(args.out) / tag) if args.record else None)
    trainer.fit(model, ckpt_path=args.resume)
    import lightning_mics

    print(f"[ft_trainer] lightning_mics from {lightning_mics.__file__}", flush=True)
    for rank, name in ((0, tag), (second_replica(args), f"{tag}_replica1")):
        if trainer.global_rank == rank:
            summary = trainer.strategy.fault_tolerance_summary
            torch.save({"params": {k: v.detach().clone() for k, v in model.model.state_dict().items()},
                        "global_step": trainer.global_step, "summary": summary, "traffic": traffic.events},
                       Path(args.out) / f"{name}.pt")


def run_fabric(args, tag):
    """The Fabric loop: step k reads slice k of this rank's part; under fault tolerance k is the job's position
    (``step_count``: a group that joins resumes there), and ``--record``/``--pause``/``--hold`` act as ``Record``."""
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                      strategy=FabricMiCS(**strategy_options(args)))
    fabric.launch()
    model = build()
    model, opt = fabric.setup(model, optimizer(model))
    ft = fabric.strategy.fault_tolerance
    if args.resume and (ft is None or ft.step_count == 0):  # a group healed at setup resumes from its peer instead
        fabric.load(args.resume, {"model": model, "optimizer": opt})
    first_step = ft.step_count if ft is not None else 0
    data = dataset(args.samples)
    kw = fabric.strategy.distributed_sampler_kwargs
    done, held, window = [0], None, max(args.diloco, 1)
    position = (lambda: ft.step_count) if ft is not None else (lambda: done[0])  # noqa: E731
    record = Path(args.out) / f"{tag}_steps.jsonl" if args.record and fabric.global_rank == 0 else None
    while position() < args.steps:  # the data of a step follows the committed step: a retried step rereads it
        step = position()
        for micro in range(args.accum):
            first = ((step * args.accum + micro) * kw["num_replicas"] + kw["rank"]) * BATCH
            x, y, _ = data[first:first + BATCH]
            with fabric.no_backward_sync(model, enabled=micro < args.accum - 1):
                fabric.backward(loss_of(model, x, y) / args.accum)
        opt.step()
        opt.zero_grad()
        done[0] += 1
        log = ft.group.log if ft is not None else None
        alone = bool(log and log.participants and log.participants[-1] == 1)
        if record is not None:
            with open(record, "a") as f:
                f.write(json.dumps({"t": time.time(), "step": position(),
                                    "quorum": log.participants[-1] if log and log.participants else None,
                                    "committed_steps": ft.group.step if ft is not None else position()}) + "\n")
        time.sleep(args.pause if args.pause_alone is None or not alone else args.pause_alone)
        if held is None and args.hold is not None and position() >= args.hold and position() % window == 1 % window:
            held = position()  # a group a test kills here: the first step from --hold on that opens a window (it
            time.sleep(120)  # may have joined after step --hold)
    if args.ckpt:
        fabric.save(args.ckpt, {"model": model, "optimizer": opt})
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    import lightning_mics

    print(f"[ft_trainer] lightning_mics from {lightning_mics.__file__}", flush=True)
    if fabric.global_rank == second_replica(args):
        torch.save({"params": {k: v.detach().clone() for k, v in state.items()}}, Path(args.out) / f"{tag}_replica1.pt")
    if fabric.global_rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in state.items()}, "global_step": position(),
                    "first_step": first_step, "summary": ft.summary() if ft is not None else None}, Path(args.out) / f"{tag}.pt")


def run_plain(args, tag, world):
    """The global batch of each step, through one process: what ``world`` ranks read through the DistributedSampler
    Lightning puts in (shuffled, seed 0), or with ``--fabric-data`` through the Fabric loop's slices."""
    from torch.utils.data import DistributedSampler

    model = build()
    opt = optimizer(model)
    data = dataset(args.samples)
    parts = [list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)) for r in range(world)]
    for step in range(args.steps):
        opt.zero_grad()
        for micro in range(args.accum):
            at = (step * args.accum + micro) * BATCH
            if args.fabric_data:
                x, y, _ = data[at * world:(at + BATCH) * world]
            else:
                x, y, _ = data[torch.tensor([i for part in parts for i in part[at:at + BATCH]])]
            (loss_of(model, x, y) / args.accum).backward()
        opt.step()
    torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "global_step": args.steps},
               Path(args.out) / f"{tag}.pt")


def main():
    global OPT, WIDTH, LAYERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ft", "fabric", "mics", "fabric-mics", "plain"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--world", type=int, default=4, help="--mode plain: the ranks whose batches it joins")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds rank 0 sleeps after each step")
    ap.add_argument("--pause-alone", type=float, default=None, help="the pause while the quorum is this group alone")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--error-at", type=int, default=None, help="rank 0 reports an error to torchft's Manager at "
                    "its n-th allreduce (the step is then not committed on this group)")
    ap.add_argument("--hold", type=int, default=None, help="rank 0 sleeps 120 s after this step (to be killed there; "
                    "under Fabric after the first step from it on that opens a DiLoCo window)")
    ap.add_argument("--resumable", action="store_true")
    ap.add_argument("--fabric-data", action="store_true", help="--mode plain: the Fabric loop's batches")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--opt", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--diloco", type=int, default=0, help="H: replica_sync='diloco' with sync_every=H (0: exact)")
    ap.add_argument("--fragments", type=int, default=1, help="with --diloco: sync_fragments (streaming DiLoCo)")
    ap.add_argument("--delay", type=int, default=0, help="with --fragments: sync_delay")
    ap.add_argument("--mixing", type=float, default=0.0, help="with --fragments: fragment_mixing")
    ap.add_argument("--precision", default="32-true", help="the Trainer's precision (modes ft and mics)")
    ap.add_argument("--int8", action="store_true", help="quantize_gradients=True (with --diloco: int8 pseudo-gradients)")
    args = ap.parse_args()
    OPT, WIDTH, LAYERS = args.opt, args.width, args.layers
    group = os.environ.get("REPLICA_GROUP_ID")
    tag = args.tag or (f"{args.mode}{group}" if args.mode in ("ft", "fabric") else args.mode)
    if args.mode == "plain":
        run_plain(args, tag, args.world)
    elif args.mode in ("fabric", "fabric-mics"):
        run_fabric(args, tag)
    else:
        run_trainer(args, tag)


if __name__ == "__main__":
    main()
