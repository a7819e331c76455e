"""One rank of an equivalence run: trains with a real Trainer + MiCSStrategy, then (rank 0) trains the same
model with a plain single-process loop on the same global batches and compares every parameter.

Also reports: model-state bytes vs the ideal, and per-step collective counts from a TorchDispatchMode.
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

import lightning_mics  # noqa: E402
from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.bf16_policy import on_bf16_copies  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402
from tests.helpers.late_collectives import LateCollectives  # noqa: E402
from tests.helpers.live import LiveMeter  # noqa: E402
from tests.helpers.models import SEQ, VOCAB, DemoTransformer, TiedFrozen, gpt  # noqa: E402
from tests.helpers.trainer_cases import groups_kept_between_fits  # noqa: E402

LAYERS = 2  # GPT blocks (--layers)
MEASURE = False  # --measure: bytes kept for backward and forward ops replayed in backward


def build(name):
    torch.manual_seed(1234)
    if name == "gpt":
        return gpt(LAYERS)
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
        self.kept_bytes = 0

    def training_step(self, batch, idx):
        if not MEASURE:
            return self.model.loss(*batch)
        # the test's own saved-tensor hooks (inside the step, so they take precedence over the strategy's):
        # the bytes autograd keeps for backward
        def pack(t):
            self.kept_bytes += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return self.model.loss(*batch)

    def validation_step(self, batch, idx):
        self.log("val_loss", self.model.loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.model, self.opt)


class CountComms(L.Callback):
    """Records the collectives of every training batch (forward, backward, and optimizer step); with markers,
    also where each unit's forward starts; and the peak of live gathered parameters (tests/helpers/live.py)."""

    def __init__(self, markers=False):
        self.mode, self.per_batch, self.stats = None, [], []
        self.markers, self.meter, self.live_peak, self.live_param_peak = markers, None, 0, 0
        self.kept, self.replayed = [], []

    def on_train_start(self, trainer, pl_module):
        self.meter = LiveMeter(pl_module, trainer.optimizers)
        if self.markers:
            for unit in trainer.strategy.engine.units:
                unit.module.register_forward_pre_hook(lambda *_, path=unit.path: self._mark(path))

    def _mark(self, path):
        if self.mode is not None and not torch.is_inference_mode_enabled():
            self.mode.marker(f"forward:{path}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = CommCounter(live=self.meter)
        self.mode.__enter__()
        pl_module.kept_bytes = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.per_batch.append([[op, list(g) if g else None, n] for op, g, n in self.mode.events])
        self.kept.append(pl_module.kept_bytes)
        self.replayed.append(self.mode.replayed)
        self.stats.append(dict(trainer.strategy.comm_stats))
        self.live_peak = self.meter.peak_bytes
        self.live_param_peak = self.meter.peak_param_bytes
        self.mode = None


def data(world, batch, steps, accum):
    n = world * batch * steps * accum
    g = torch.Generator().manual_seed(99)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class LossOf(nn.Module):
    """``inner.loss`` as a forward, for ``torch.func.functional_call``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner.loss(x, y)


def reference(args, world, x, y, cast=None):
    """One plain process on the ranks' batches. With ``cast`` (parameter names), under MiCS's bf16-mixed policy:
    each rank's batch under autocast, the parameters named in ``cast`` (the gathered ones) as bf16 copies of the fp32
    ones, their bf16 gradients cast to fp32 and summed there, scaled by 1 / world as the engine scales its reduction
    (``tests/helpers/bf16_policy.py``: DDP's control under the Trainer)."""
    torch.manual_seed(0)
    model = build(args.model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model, args.optimizer)
    b, A = args.batch, args.accum
    per_rank = [torch.arange(k, x.size(0), world) for k in range(world)]
    norms = []

    policy, wrapped = cast is not None, LossOf(model)
    cast = {"inner." + n for n in cast or ()}

    def policy_loss(idx):
        return on_bf16_copies(wrapped, (x[idx], y[idx]), cast=cast) / world

    for step in range(args.steps):
        for m in range(step * A, (step + 1) * A):
            if policy:
                sum(policy_loss(r[m * b:(m + 1) * b]) / A for r in per_rank).backward()
                continue
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
    ap.add_argument("--variants", default="", help="JSON list of strategy options, one fit each")
    ap.add_argument("--markers", action="store_true", help="record unit forwards between the collectives")
    ap.add_argument("--layers", type=int, default=2, help="GPT blocks")
    ap.add_argument("--measure", action="store_true", help="bytes kept for backward, forward ops replayed")
    ap.add_argument("--save-states", action="store_true", help="rank 0 writes each variant's full state dict")
    ap.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...): real hosts (torchrun --nnodes)")
    ap.add_argument("--late", type=float, default=0.0,
                    help="each variant also runs with every collective finishing this many seconds late "
                         "([Note: late collectives]); rank 0 compares the two full states bit for bit")
    ap.add_argument("--keep-groups", action="store_true",
                    help="a layout's process groups kept from one variant's fit to the next "
                         "(tests/helpers/trainer_cases.py's groups_kept_between_fits)")
    args = ap.parse_args()
    global LAYERS, MEASURE
    LAYERS, MEASURE = args.layers, args.measure
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    x, y = data(world, args.batch, args.steps, args.accum)
    # Our own sampler: rank k sees samples k, k+W, ... in order (Lightning's own one would shuffle).
    train_set = TensorDataset(x, y)
    train = DataLoader(train_set, batch_size=args.batch,
                       sampler=DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=False))
    val_set = TensorDataset(x[: world * 2], y[: world * 2])
    val = DataLoader(val_set, batch_size=2, sampler=DistributedSampler(val_set, world, rank, shuffle=False))
    # --variants: several strategy configurations trained one after another in the same processes (process
    # start-up dominates a launch on a small machine); the single-process reference is computed once.
    variants = json.loads(args.variants) if args.variants else [{"s": args.s, **json.loads(args.extra)}]
    ref = None
    if rank == 0:
        ref = reference(args, world, x, y)
    results = []
    kept = groups_kept_between_fits() if args.keep_groups else contextlib.nullcontext()
    with kept:
        for k, variant in enumerate(variants):
            try:
                res = run_variant(args, dict(variant), world, rank, train, val, ref,
                                  Path(args.out) / f"state{k}.pt" if args.save_states else None)
                if args.late:
                    late = run_variant(args, dict(variant), world, rank, train, val, ref, late=args.late)
                    res["late"] = compare_late(res, late)
                res.pop("_full")
                results.append(res)
            except Exception:
                import traceback

                traceback.print_exc()
                results.append({"error": traceback.format_exc()})
    result = dict(results[0], rank=rank, variants=results)
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(result))


def compare_late(prompt, late):
    """The run whose collectives finished late against the prompt one: equal bit for bit (rank 0 holds the full
    state), the same collectives issued (counted with ``--count``: without it there are none, and no match)."""
    out = {"issued": late["late_issued"], "same_comms": bool(prompt["comms"]) and prompt["comms"] == late["comms"],
           "global_step": late["global_step"]}
    if prompt["_full"] is not None:
        a, b = prompt["_full"], late["_full"]
        out["keys_match"] = sorted(a) == sorted(b)
        out["max_abs"] = max(((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0)
                             for k in a)
        out["bit_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    return out


def run_variant(args, variant, world, rank, train, val, ref, save_to=None, late=0.0):
    s = variant.pop("s", args.s)
    strategy = MiCSStrategy(sharded_data_parallel_degree=s, param_persistence_threshold=args.threshold,
                            reduce_bucket_size=args.bucket, state_dict_type="full", **variant)
    counter = CountComms(markers=args.markers)
    trainer = L.Trainer(
        accelerator="cpu", devices=world // args.num_nodes, num_nodes=args.num_nodes, strategy=strategy,
        max_steps=args.steps,
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

    state_bytes, gathered = {}, set()

    class Grab(L.Callback):
        def on_train_end(self, trainer, pl_module):
            state_bytes.update(trainer.strategy.model_state_bytes())
            eng = trainer.strategy.engine
            state_bytes["replicated_plain"] = sum(
                rp.local.numel() * rp.local.element_size() * (1 + (per_trainable if rp.requires_grad else 0))
                for rp in eng.replicated)
            state_bytes["plain"] = plain_bytes
            state_bytes["n_buckets"] = sum(len(eng.grads.of(u).buckets(u.trainable())) for u in eng.units)
            state_bytes["n_units"] = sum(1 for u in eng.units if u.full_numel)
            state_bytes["unit_numels"] = [u.full_numel for u in eng.units]
            gathered.update(ref.fqn.removeprefix("model.") for u in eng.units for sp in u.params for ref in sp.refs)

    trainer.callbacks.append(Grab())
    mode = LateCollectives(late) if late else None
    if mode is not None:
        mode.__enter__()
    try:
        trainer.fit(module, train, val)
        full = trainer.strategy.lightning_module_state_dict()  # after fit: module restored, plain state dict
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    result = {"state_bytes": state_bytes, "n_params": n_params,
              "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
              "comms": counter.per_batch, "stats": counter.stats, "live_peak": counter.live_peak,
              "live_param_peak": counter.live_param_peak,
              "kept_bytes": counter.kept, "replayed_forward_ops": counter.replayed,
              "global_step": trainer.global_step, "_full": full if rank == 0 else None,
              "late_issued": dict(mode.issued) if mode is not None else None}
    if rank == 0 and save_to is not None:
        torch.save(full, save_to)
    if rank == 0:
        init, ref_sd, norms = ref
        result["ref_norms"] = norms
        # what the user gets back (fp32 masters, whether the module was made plain after fit or stays sharded)
        got = {k[len("model."):]: v for k, v in full.items()}
        result["full_sd_keys_match"] = sorted(full) == sorted(module.state_dict())
        result["plain_after_fit"] = all(type(p) is torch.nn.Parameter for p in module.parameters())
        errs = {}
        for k, r in ref_sd.items():
            g = got[k].float()
            moved = (r.float() - init[k].float()).norm().item()
            errs[k] = {"max_abs": (g - r.float()).abs().max().item(), "ref_max": r.float().abs().max().item(),
                       "moved": moved, "rel_update": (g - r.float()).norm().item() / max(moved, 1e-12),
                       "rel_norm": (g - r.float()).norm().item() / max(r.float().norm().item(), 1e-12),
                       "shape_ok": list(g.shape) == list(r.shape)}
        result["errors"] = errs
        if args.precision == "bf16-mixed":  # against one process under the policy, its gathered parameters' as cast
            _, policy_sd, _ = policy_ref(args, world, frozenset(gathered))
            result["policy_max_abs"] = {k: (got[k].float() - r.float()).abs().max().item()
                                        for k, r in policy_sd.items()}
    return result


_POLICY = {}


def policy_ref(args, world, cast):
    if cast not in _POLICY:
        x, y = data(world, args.batch, args.steps, args.accum)
        _POLICY[cast] = reference(args, world, x, y, cast)
    return _POLICY[cast]

if __name__ == "__main__":
    main()
