"""One rank of the checkpoint tests (tests/checkpoint/test_sharded_checkpoint.py). ``--phase`` (repeatable, run in order):

save    (4 ranks, s=2) uninterrupted 6 steps (2 epochs of 3); 3 steps saving sharded (ModelCheckpoint at the end
        of epoch 0) and full; both resumed to 6; the sharded one loaded at s=4; consolidate; bad checkpoints.
load    (any world) ``--ckpt`` loaded at ``--s`` with no step left to run; model and optimizer state reported.
bf16    (2 ranks) under bf16-mixed a model kept sharded after fit (max_live_parameters=1) saved after fit and
        resumed, against the uninterrupted run.
crash   (2 ranks) a save after fit (module plain again), then a second save to the same path during which
        rank 1 SIGKILLs itself halfway through writing its shard file.

Reference states are gathered through the full-state path (``lightning_module_state_dict`` and the
consolidated optimizer state), which shares no code with the sharded one.
"""

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import lightning_mics  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.checkpoint import state as ckpt  # noqa: E402
from lightning_mics.layout.placement import is_sharded  # noqa: E402
from tests.engine.equiv import data, make_optimizer  # noqa: E402
from tests.helpers.models import VOCAB, TiedFrozen  # noqa: E402

EXTRA = {}  # --extra: more strategy options for every run of this process
THRESHOLD = 100  # biases stay replicated; every matrix is sharded, tiny.weight (3 rows) leaves rank 3 of s=4 none


class Net(nn.Module):
    """TiedFrozen (tied embedding/head, a frozen and an unused parameter) and a 3-row head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TiedFrozen()
        self.tiny = nn.Linear(VOCAB, 3)

    def loss(self, idx, tgt):
        logits = self.body(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1)) + 0.01 * self.tiny(logits).pow(2).mean()


class Lit(L.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = Net()

    def training_step(self, batch, idx):
        return self.net.loss(*batch)

    def validation_step(self, batch, idx):
        return self.net.loss(*batch)

    def configure_optimizers(self):
        opt = make_optimizer(self.net, "adamw")  # two groups (decay / no decay), AdamW: exp_avg, exp_avg_sq, step
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)  # the lr changes every step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(world, rank):
    x, y = data(world, 2, 3, 1)  # 3 batches of 2 per rank and epoch
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, world, rank, shuffle=False))


def trainer(world, s, epochs, callbacks=(), precision="32-true", **strategy):
    strategy.setdefault("param_persistence_threshold", THRESHOLD)
    strategy = {**EXTRA, **strategy}
    return L.Trainer(accelerator="cpu", devices=world, max_epochs=epochs, use_distributed_sampler=False,
                     strategy=MiCSStrategy(sharded_data_parallel_degree=s, timeout=120, **strategy),
                     precision=precision, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks), num_sanity_val_steps=0,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))


def rel(a, b):
    flat = lambda d: torch.cat([d[k].double().reshape(-1) for k in sorted(d)])  # noqa: E731
    return float((flat(a) - flat(b)).norm() / flat(b).norm())


def full_state(trainer_):
    """(model, optimizer) full states on rank 0 through the full path ({} elsewhere)."""
    st = trainer_.strategy
    opt = trainer_.optimizers[0]
    if st._engine is not None and any(is_sharded(p) for p in st.lightning_module.parameters()):
        return st.lightning_module_state_dict(), ckpt.full_optimizer_state(st.engine, opt, dst=0)
    return ({k: v.detach().clone() for k, v in st.lightning_module.state_dict().items()},
            opt.state_dict())  # plain after fit


class Capture(L.Callback):
    """At the end of epoch 0 (before ModelCheckpoint saves, callbacks run in order): the full state and how
    many bytes of it are sharded, per rank (rows rounded up), or replicated."""

    def __init__(self, out):
        self.out = out

    def on_train_epoch_end(self, trainer_, pl_module):
        sd, osd = full_state(trainer_)
        s = trainer_.strategy.topology.layout.shard_size
        live = pl_module.state_dict(keep_vars=True)
        params = [p for g in trainer_.optimizers[0].param_groups for p in g["params"]]
        shard_bytes = repl_bytes = 0

        def add(t, sharded):
            nonlocal shard_bytes, repl_bytes
            if sharded:
                rows = -(-t.shape[0] // s)
                shard_bytes += rows * t[0].numel() * t.element_size()
            else:
                repl_bytes += t.numel() * t.element_size()

        if trainer_.is_global_zero:
            for k, t in sd.items():
                add(t, is_sharded(live[k]))
            for k, st in osd["state"].items():
                for name, t in st.items():
                    add(t, is_sharded(params[k]) and t.dim() > 0 and t.shape == params[k].shape)
            torch.save({"state_dict": sd, "optimizer": osd, "shard_bytes": shard_bytes, "repl_bytes": repl_bytes,
                        "s": s}, Path(self.out) / "ref_save.pt")


def plain_params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def try_fit(world, rank, path):
    """A resume from a bad checkpoint: every rank must raise, naming the path."""
    try:
        trainer(world, 2, 2).fit(Lit(5), loader(world, rank), ckpt_path=str(path))
    except Exception as err:  # noqa: BLE001 - the type is part of the result
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "no error"}


def phase_save(out, world, rank):
    res = {}
    m = Lit(0)
    trainer(world, 2, 2).fit(m, loader(world, rank))
    ref6 = plain_params(m)

    for kind in ("sharded", "full"):
        cbs = [ModelCheckpoint(dirpath=out, filename=kind, save_on_train_epoch_end=True)]
        if kind == "sharded":
            cbs.insert(0, Capture(out))
        trainer(world, 2, 1, cbs, state_dict_type=kind).fit(Lit(0), loader(world, rank))
        m = Lit(1)  # other initial values: everything must come from the checkpoint
        t = trainer(world, 2, 2, state_dict_type=kind)
        t.fit(m, loader(world, rank), ckpt_path=str(out / f"{kind}.ckpt"))
        res[f"resume_{kind}_rel"] = rel(plain_params(m), ref6)
        res[f"resume_{kind}_step"] = t.global_step

    res["at_s4"] = phase_load(out, world, rank, 4, out / "sharded.ckpt", out / "ref_save.pt")

    if rank == 0:  # consolidate in this process: no process group is used
        ref = torch.load(out / "ref_save.pt", weights_only=True)
        full = lightning_mics.consolidate(out / "sharded.ckpt")
        res["consolidated_keys"] = sorted(full["state_dict"]) == sorted(ref["state_dict"])
        res["consolidated_equal"] = all(torch.equal(full["state_dict"][k], v) for k, v in ref["state_dict"].items())
        res["consolidated_optimizer_equal"] = same_optimizer(full["optimizer_states"][0], ref["optimizer"])
        res["consolidated_meta"] = sorted(k for k in full if k not in ("state_dict", "optimizer_states"))
        res["consolidated_hparams"] = dict(full.get("hyper_parameters", {}))
        # bad checkpoints, made from the good ones
        shutil.copytree(out / "sharded.ckpt", out / "truncated.ckpt")
        shard = max((out / "truncated.ckpt").glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(shard, shard.stat().st_size // 2)
        shutil.copyfile(out / "full.ckpt", out / "truncated_full.ckpt")
        os.truncate(out / "truncated_full.ckpt", (out / "full.ckpt").stat().st_size // 2)
        shutil.copytree(out / "sharded.ckpt", out / "version.ckpt")
        meta = torch.load(out / "version.ckpt" / "meta.pt", weights_only=True)
        meta["lightning_mics"]["version"] = 99
        torch.save(meta, out / "version.ckpt" / "meta.pt")
        shutil.copytree(out / "sharded.ckpt", out / "foreign.ckpt")
        meta.pop("lightning_mics")
        torch.save(meta, out / "foreign.ckpt" / "meta.pt")
    dist.barrier()
    res["errors"] = {name: try_fit(world, rank, out / f"{name}.ckpt")
                     for name in ("truncated", "truncated_full", "version", "foreign", "missing")}
    return res


def same_optimizer(a, b):
    if sorted(a["state"]) != sorted(b["state"]) or len(a["param_groups"]) != len(b["param_groups"]):
        return False
    for k in b["state"]:
        for name, v in b["state"][k].items():
            w = a["state"][k].get(name)
            if w is None or not torch.equal(torch.as_tensor(w), torch.as_tensor(v)):
                return False
    return all(ga == gb for ga, gb in zip(a["param_groups"], b["param_groups"]))


def same_model(got, ref):
    return sorted(got) == sorted(ref) and all(torch.equal(got[k], v) for k, v in ref.items())


def phase_load(out, world, rank, s, path, ref_path, resave=False):
    """Loads ``path`` at (world, s) with ``fit`` (the epoch it saved is the last one, so no step runs, and after
    fit the small module and its optimizer are plain, with the full state on every rank) and with ``validate``
    (model only); ``resave``: then saves it again at this layout, to the same path."""
    ref = torch.load(ref_path, weights_only=True)
    m = Lit(9)
    t = trainer(world, s, 1)
    t.fit(m, loader(world, rank), ckpt_path=str(path))
    res = {"steps": t.global_step, "model_equal": same_model(plain_params(m), ref["state_dict"]),
           "optimizer_equal": same_optimizer(t.optimizers[0].state_dict(), ref["optimizer"]),
           "lr": t.optimizers[0].param_groups[0]["lr"], "ref_lr": ref["optimizer"]["param_groups"][0]["lr"]}
    v = Lit(11)
    trainer(world, s, 1).validate(v, loader(world, rank), ckpt_path=str(path), verbose=False)
    res["validate_model_equal"] = same_model(plain_params(v), ref["state_dict"])
    if resave:
        t.save_checkpoint(path)
    return res


def phase_bf16(out, world, rank):
    kw = dict(precision="bf16-mixed", max_live_parameters=1)  # stays sharded after fit: saved with its engine alive
    m = Lit(0)
    t = trainer(world, 2, 2, **kw)
    t.fit(m, loader(world, rank))
    ref = t.strategy.lightning_module_state_dict()
    t = trainer(world, 2, 1, **kw)
    m = Lit(0)
    t.fit(m, loader(world, rank))
    stays_sharded = all(is_sharded(p) for n, p in m.named_parameters() if "weight" in n)
    t.save_checkpoint(out / "bf16.ckpt")
    m = Lit(1)
    t = trainer(world, 2, 2, **kw)
    t.fit(m, loader(world, rank), ckpt_path=str(out / "bf16.ckpt"))
    got = t.strategy.lightning_module_state_dict()
    res = {"stays_sharded": stays_sharded}
    if rank == 0:
        from lightning_mics.checkpoint.files import read_index

        index = read_index(out / "bf16.ckpt")
        res["saved_dtypes"] = sorted({str(md.properties.dtype) for k, md in index.state_dict_metadata.items()
                                      if k.startswith("state_dict.") and hasattr(md, "properties")})
        res["rel"] = rel(got, ref)
    return res


def phase_crash(out, world, rank):
    t = trainer(world, 2, 1)
    m = Lit(0)
    t.fit(m, loader(world, rank))
    path = out / "crash.ckpt"
    t.save_checkpoint(path)  # after fit: the module and optimizer are plain again
    if rank == 0:
        torch.save({"state_dict": plain_params(m), "optimizer": t.optimizers[0].state_dict()}, out / "crash_ref.pt")
    dist.barrier()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # the second save would hold other values
    if rank == 1:
        import torch.distributed.checkpoint.filesystem as fs

        original, calls = fs._write_item, [0]

        def write_then_die(*args, **kwargs):  # fault injection: the real write runs, then the process is killed
            calls[0] += 1
            result = original(*args, **kwargs)
            if calls[0] == 3:
                args[1].flush()  # _write_item(transforms, stream, data, ...): the bytes so far reach the file
                (out / "killed_mid_write").write_text("1")
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        fs._write_item = write_then_die
    t.save_checkpoint(path)
    return {"second_save_finished": True}  # must not be reached


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", action="append", required=True, help="save | load | bf16 | crash, in order")
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--ckpt", action="append", default=[], help="for load: NAME=REFERENCE (files in --out)")
    ap.add_argument("--resave", action="append", default=[], help="for load: save this one again once loaded")
    ap.add_argument("--extra", default="{}", help="JSON: more strategy options for every run")
    args = ap.parse_args()
    EXTRA.update(json.loads(args.extra))
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = Path(args.out)
    res = {}
    for phase in args.phase:
        if phase == "load":
            res[phase] = {}
            for pair in args.ckpt:
                name, ref = pair.split("=")
                res[phase][name] = phase_load(out, world, rank, args.s, out / name, out / ref, name in args.resave)
        else:
            res[phase] = {"save": phase_save, "bf16": phase_bf16, "crash": phase_crash}[phase](out, world, rank)
    (out / f"result{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
