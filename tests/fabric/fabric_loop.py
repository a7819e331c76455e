"""One rank of the Fabric tests: trains with a real ``L.Fabric`` + ``lightning_mics.fabric.MiCSStrategy`` in the
usual Fabric loop (``no_backward_sync`` while accumulating, ``fabric.backward``, ``fabric.clip_gradients``), and
rank 0 trains the same model in one plain process on the same global batches and compares.

Several cases run one after another in the same processes, each with its own Fabric (``--cases``); the result
file holds one entry per case. Cases: ``equiv:<s>:<accum>:<opt>:<clip>:<setup>[:<precision>]`` (clip: none,
norm / value = ``fabric.clip_gradients``, torchnorm / torchvalue = ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_`` called by the user on the parameters, as under FSDP2; setup: joint =
``fabric.setup(model, opt)``, split = setup_module + setup_optimizers, meta = init_module(empty_init=True) +
split), ``count:<s>:<accum>`` (collectives per step with and without no_backward_sync), ``gan:<s>``,
``quant:<s>:<accum>:<block>`` (the linear least-squares model of quant_equiv.py with and without
``quantize_gradients=True``, against its float64 reference and derived bound), ``resume:<s>`` (saves halfway into --out, then resumes from each checkpoint), ``load:<s>:<dir>`` (resumes
another run's checkpoints in this layout), ``order`` (an optimizer built before setup_module is refused),
``feedback:<s>`` / ``feedback_load:<s>:<block>`` (``resume`` with error-feedback quantization; its
checkpoint loaded with another block size), ``torchsd:<s>`` (torch's distributed state-dict API and DCP),
``filter:<s>:<sharded|full>`` (``fabric.save(..., filter=...)``), ``late:<s>:<accum>:<opt>:<clip>:<precision>:<options
as JSON>`` (the loop twice, its collectives finishing 30 ms late the second time: [Note: late collectives]; the
two full states bit for bit). Under ``bf16-mixed`` an ``equiv`` case is also
compared with one process under MiCS's precision policy (``policy_loss``; ``policy_max_abs``).
"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as SD
import torch.nn.functional as Fn

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

import lightning_mics  # noqa: E402
import lightning_mics.frontends.reliability  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402
from lightning_mics.layout.sharding import stays_replicated  # noqa: E402
from tests.helpers.bf16_policy import on_bf16_copies  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402
from tests.helpers.late_collectives import LateCollectives  # noqa: E402
from tests.helpers.models import Tiny  # noqa: E402

VOCAB, SEQ, D = 61, 8, 24  # odd sizes: uneven shards and padding
GLOBAL_BATCH, STEPS = 8, 4


class Critic(nn.Module):  # the GAN's second model: scores the first one's output distribution
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(VOCAB, 32), nn.Tanh()),
                                     nn.Sequential(nn.Linear(32, 32), nn.Tanh())])
        self.out = nn.Linear(32, 1)

    def forward(self, p):
        return self.out(self.blocks[1](self.blocks[0](p)))


def lm_loss(model, x):
    logits = model(x[:, :-1])
    return Fn.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))


def batches(accum, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (STEPS, accum, GLOBAL_BATCH, SEQ + 1), generator=g)


def optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def strategy(s, **kw):
    return MiCSStrategy(sharded_data_parallel_degree=s, param_persistence_threshold=16, **kw)


def new_fabric(s, precision="32-true", **kw):
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy(s, **kw), precision=precision)
    fabric.launch()
    return fabric


def local(x, fabric):
    b = GLOBAL_BATCH // fabric.world_size
    return x[fabric.global_rank * b:(fabric.global_rank + 1) * b]


def fabric_steps(fabric, model, opt, data, clip, start, stop, nbs=True):
    accum = data.shape[1]
    for step in range(start, stop):
        for m in range(accum):
            with fabric.no_backward_sync(model, enabled=nbs and m < accum - 1):
                fabric.backward(lm_loss(model, local(data[step, m], fabric)) / accum)
        if clip == "norm":
            fabric.clip_gradients(model, opt, max_norm=0.5)
        elif clip == "value":
            fabric.clip_gradients(model, opt, clip_val=0.01)
        elif clip == "torchnorm":  # torch's own, on the DTensor gradients (as torchtitan clips under FSDP2)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif clip == "torchvalue":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()


def plain_steps(model, opt, data, clip, start=0, stop=STEPS, loss=lm_loss):
    accum = data.shape[1]
    for step in range(start, stop):
        for m in range(accum):
            (loss(model, data[step, m]) / accum).backward()
        if clip in ("norm", "torchnorm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif clip in ("value", "torchvalue"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()


def policy_loss(s):
    """The loss of WORLD ranks under MiCS's bf16-mixed policy, in one process: each rank's batch under autocast,
    the gathered parameters as bf16 copies of the fp32 ones (the small ones stay replicated in fp32), their bf16
    gradients cast to fp32 and summed there, scaled by 1 / WORLD as the engine scales its reduction."""
    def loss(model, x):
        cast = {n for n, p in model.named_parameters()
                if not stays_replicated(tuple(p.shape), 16, s)}  # strategy()'s threshold
        return sum(lm_loss(lambda idx: on_bf16_copies(model, (idx,), cast=cast), chunk)
                   for chunk in x.chunk(WORLD)) / WORLD
    return loss


def full_state(fabric, model):
    """The full state dict on rank 0 ({} elsewhere), gathered from the fp32 masters. Collective."""
    return fabric.strategy.get_module_state_dict(model.module if hasattr(model, "module") else model)


def compare(a, b):
    """Largest |a - b| relative to the largest |b| of every tensor, over all of them."""
    worst = 0.0
    for k, v in b.items():
        worst = max(worst, float((a[k].float() - v.float()).abs().max()) / max(float(v.float().abs().max()), 1e-12))
    return worst


def compare_global(a, b):
    """||a - b|| / ||b|| over all tensors at once (AdamW: a gradient that is zero up to rounding, such as an
    attention key bias's, turns rounding into lr-sized steps in that one tensor)."""
    diff = torch.cat([(a[k].float() - v.float()).flatten() for k, v in b.items()])
    return float(diff.norm() / torch.cat([v.float().flatten() for v in b.values()]).norm())


def setup(fabric, how, kind, layers=2):
    torch.manual_seed(0)
    if how == "meta":
        with fabric.init_module(empty_init=True):
            model = Tiny(layers=layers)
        on_meta = all(p.is_meta for p in model.parameters())
        model = fabric.setup_module(model)
        return model, fabric.setup_optimizers(optimizer(kind, model.parameters())), on_meta
    model = Tiny(layers=layers)
    if how == "joint":
        model, opt = fabric.setup(model, optimizer(kind, model.parameters()))
        return model, opt, False
    model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(optimizer(kind, model.parameters())), False


def case_equiv(s, accum, kind, clip, how, precision="32-true", layout=""):
    """``layout`` "os": shard_optimizer_state=True ([Note: optimizer rows over replicas] with s > 1)."""
    fabric = new_fabric(int(s), precision, **({"shard_optimizer_state": True} if layout == "os" else {}))
    accum = int(accum)
    model, opt, on_meta = setup(fabric, how, kind)
    init = full_state(fabric, model)
    data = batches(accum)
    fabric_steps(fabric, model, opt, data, clip, 0, STEPS)
    final = full_state(fabric, model)
    probe = data[0, 0, :2, :-1]
    with torch.no_grad():
        out = model(probe)  # called outside the loop: full parameters gathered unit by unit
        # a root-owned submodule called directly, outside Fabric's precision context:
        # [Note: calls outside the precision's context] in lightning_mics/engine/hooks.py (bf16-mixed: it met bf16
        # copies without autocast)
        ones = torch.ones(3, D, dtype=torch.bfloat16 if precision == "bf16-true" else torch.float32)
        head = model.module.head(ones)
    held = fabric.strategy.model_state_bytes(model.module, [opt])
    res = {"on_meta": on_meta, "held_params": held["params"]}
    if fabric.global_rank == 0:
        ref = Tiny().to(torch.bfloat16) if precision == "bf16-true" else Tiny()
        ref.load_state_dict(init)
        ref_opt = optimizer(kind, ref.parameters())
        if precision == "bf16-mixed":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                plain_steps(ref, ref_opt, data, clip)
        else:
            plain_steps(ref, ref_opt, data, clip)
        res["rel"] = compare(final, ref.state_dict())
        res["rel_global"] = compare_global(final, ref.state_dict())
        res["moved_global"] = compare_global(init, ref.state_dict())  # the reference's training, on the same scale
        if how == "meta":  # materialized shard by shard: the values of a real-device build with the same seed
            torch.manual_seed(0)
            seeded = Tiny().to(torch.bfloat16) if precision == "bf16-true" else Tiny()
            res["init_vs_seeded"] = max(float((init[k].float() - v.float()).abs().max())
                                        for k, v in seeded.state_dict().items())
        if precision == "bf16-mixed":
            policy = Tiny()
            policy.load_state_dict(init)
            plain_steps(policy, optimizer(kind, policy.parameters()), data, clip, loss=policy_loss(int(s)))
            res["policy_max_abs"] = max(float((final[k] - v).abs().max()) for k, v in policy.state_dict().items())
        res["dtypes"] = sorted({str(v.dtype) for v in final.values()})
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            expected = ref(probe).float()  # Fabric's forward runs under the precision's autocast too
        res["outside_loop_rel"] = float((out.float() - expected).abs().max() / expected.abs().max())
        with torch.no_grad():
            expected = ref.head(ones).float()
        res["head_outside"] = {"dtype": str(head.dtype),
                               "rel": float((head.float() - expected).abs().max() / expected.abs().max())}
        res["whole_bytes"] = sum(p.numel() * 4 for p in ref.parameters())
    return res


def case_count(s, accum):
    """Replica all-reduces per optimizer step with no_backward_sync (2-hop) and without it."""
    fabric = new_fabric(int(s))
    accum = int(accum)
    model, opt, _ = setup(fabric, "split", "sgd")
    data = batches(accum)
    layout = fabric.strategy.topology.layout
    replica = tuple(layout.replica_group_of(fabric.global_rank))
    shard = tuple(layout.shard_group_of(fabric.global_rank))
    out = {}
    for nbs in (True, False):
        for step in range(2):
            counter = CommCounter()
            with counter:
                fabric_steps(fabric, model, opt, data, "none", step, step + 1, nbs=nbs)
            ev = [(op, tuple(g) if g is not None else None) for op, g, _ in counter.events]
            out[f"nbs={nbs}"] = {
                "replica_all_reduce": sum(1 for op, g in ev if op == "all_reduce" and g == replica),
                "world_all_reduce": sum(1 for op, g in ev if op == "all_reduce" and g is not None
                                        and len(g) == fabric.world_size),
                "shard_reduce_scatter": sum(1 for op, g in ev if op == "reduce_scatter" and g == shard),
            }
    return out


def case_gan(s):
    fabric = new_fabric(int(s))
    torch.manual_seed(0)
    gen, critic = Tiny(), Critic()
    gen, opt_g = fabric.setup(gen, torch.optim.AdamW(gen.parameters(), lr=1e-2))
    critic = fabric.setup_module(critic)
    opt_c = fabric.setup_optimizers(torch.optim.SGD(critic.parameters(), lr=0.1))
    init = (full_state(fabric, gen), full_state(fabric, critic))
    data = batches(2)

    def step(g, c, og, oc, x, backward, sync):
        for m in range(2):  # the generator accumulates over 2 micro-batches
            with sync(g, m == 0):
                backward(lm_loss(g, x(data[0, m])) / 2 - c(g(x(data[0, m])[:, :-1]).softmax(-1)).mean() / 2)
        og.step()
        og.zero_grad()
        oc.zero_grad()  # the critic's gradients from the generator's loss are dropped, as in a GAN loop
        with torch.no_grad():
            fake = g(x(data[1, 0])[:, :-1]).softmax(-1)
        backward(c(fake).pow(2).mean())
        oc.step()
        oc.zero_grad()

    for _ in range(STEPS):
        step(gen, critic, opt_g, opt_c, lambda t: local(t, fabric), fabric.backward,
             lambda mod, on: fabric.no_backward_sync(mod, enabled=on))
    final = (full_state(fabric, gen), full_state(fabric, critic))
    if fabric.global_rank != 0:
        return {}
    g, c = Tiny(), Critic()
    g.load_state_dict(init[0])
    c.load_state_dict(init[1])
    og, oc = torch.optim.AdamW(g.parameters(), lr=1e-2), torch.optim.SGD(c.parameters(), lr=0.1)
    from contextlib import nullcontext
    for _ in range(STEPS):
        step(g, c, og, oc, lambda t: t, lambda loss: loss.backward(), lambda mod, on: nullcontext())
    return {"gen_rel": compare_global(final[0], g.state_dict()), "critic_rel": compare(final[1], c.state_dict())}


def _resume(fabric, path, data, kind, clip):
    """A fresh model (another initialization: everything must come from the checkpoint) and optimizer loaded from
    ``path`` and trained on to STEPS: (its full state, the state dict it was loaded into, what ``fabric.load``
    returned beyond it, the error-feedback warnings of the load)."""
    torch.manual_seed(99)
    model = fabric.setup_module(Tiny())
    opt = fabric.setup_optimizers(optimizer(kind, model.parameters()))
    state = {"model": model, "optimizer": opt, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = fabric.load(path, state)
    fabric_steps(fabric, model, opt, data, clip, state["step"], STEPS)
    warned = [str(w.message) for w in caught if "error-feedback residuals" in str(w.message)]
    return full_state(fabric, model), state, rest, warned


def _save_halfway_and_resume(fabric, path, kind, clip):
    """Trains STEPS/2, saves into ``path``, trains on to STEPS, then resumes from ``path`` (``_resume``):
    (the uninterrupted full state, *what ``_resume`` returns)."""
    model, opt, _ = setup(fabric, "split", kind)
    data, half = batches(2), STEPS // 2
    fabric_steps(fabric, model, opt, data, clip, 0, half)
    fabric.save(path, {"model": model, "optimizer": opt, "step": half})
    fabric_steps(fabric, model, opt, data, clip, half, STEPS)
    return (full_state(fabric, model), *_resume(fabric, path, data, kind, clip))


def case_resume(s, precision="32-true"):
    """Saves at step STEPS/2 (sharded directory and full file), trains on; then fresh models resume from each
    checkpoint. Writes the uninterrupted final state for another layout's ``load`` case."""
    out = {}
    for fmt in ("sharded", "full"):
        fabric = new_fabric(int(s), precision, state_dict_type=fmt)
        path = OUT / f"ckpt-{fmt}" if fmt == "sharded" else OUT / "ckpt-full.pt"
        straight, resumed, state, rest, _ = _save_halfway_and_resume(fabric, path, "adamw", "norm")
        if fabric.global_rank == 0:
            full = lightning_mics.consolidate(path)
            out[fmt] = {"rel": compare(resumed, straight), "step": state["step"], "rest": sorted(rest),
                        "dtypes": sorted({str(v.dtype) for v in full["model"].values()}),
                        "optimizer_keys": sorted(full["optimizer"]), "n_model": len(full["model"])}
            torch.save(straight, OUT / f"straight-{fmt}.pt")
    return out


def case_torchsd(s, precision="32-true"):
    """torch's distributed state-dict API on the strategy's model and optimizer, as torchtitan checkpoints FSDP2
    (``torch.distributed.checkpoint.state_dict`` + ``dcp.save`` / ``dcp.load``): the full model state dict
    against the strategy's own, and a save at step STEPS/2 loaded back after step STEPS, then trained on again
    to STEPS, against the uninterrupted run."""
    fabric = new_fabric(int(s), precision)
    model, opt, _ = setup(fabric, "split", "adamw")
    data, half, path = batches(2), STEPS // 2, str(OUT / f"torchsd-{precision}")
    fabric_steps(fabric, model, opt, data, "norm", 0, half)
    full = SD.get_model_state_dict(model.module, options=SD.StateDictOptions(full_state_dict=True, cpu_offload=True))
    mine = full_state(fabric, model)
    dcp.save({"model": SD.get_model_state_dict(model.module),
              "optim": SD.get_optimizer_state_dict(model.module, opt.optimizer)}, checkpoint_id=path)
    fabric_steps(fabric, model, opt, data, "norm", half, STEPS)
    straight = full_state(fabric, model)
    state = {"model": SD.get_model_state_dict(model.module),
             "optim": SD.get_optimizer_state_dict(model.module, opt.optimizer)}
    dcp.load(state, checkpoint_id=path)
    SD.set_model_state_dict(model.module, state["model"])
    SD.set_optimizer_state_dict(model.module, opt.optimizer, state["optim"])
    fabric_steps(fabric, model, opt, data, "norm", half, STEPS)
    resumed = full_state(fabric, model)
    # a full state dict on rank 0 only (a pretrained model's, as torchtitan loads one), broadcast into the shards
    SD.set_model_state_dict(model.module, dict(full) if fabric.global_rank == 0 else {},  # (it edits the dict)
                            options=SD.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    broadcast = full_state(fabric, model)
    if fabric.global_rank != 0:
        return {}
    return {"full_keys": sorted(full) == sorted(mine), "full_max": max((full[k] - mine[k]).abs().max().item()
                                                                         for k in mine),
            "resumed_max": max((resumed[k] - straight[k]).abs().max().item() for k in straight),
            "moved": max((resumed[k] - mine[k]).abs().max().item() for k in mine),
            "broadcast_max": max((broadcast[k] - mine[k]).abs().max().item() for k in mine)}


def case_filter(s, fmt, precision="32-true"):
    """``fabric.save(path, state, filter=...)`` as litgpt saves LoRA weights: only the first block's parameters
    (and a dict entry's kept items), then loaded with ``strict=False`` into a fresh model (another init): the kept
    tensors come from the checkpoint, the others keep the fresh model's values; ``strict=True`` names what is
    missing; consolidated (or torch.load'ed) the checkpoint holds only the kept names (under bf16-mixed, the fp32
    masters)."""
    fabric = new_fabric(int(s), precision, state_dict_type=fmt)
    model, opt, _ = setup(fabric, "split", "adamw")
    fabric_steps(fabric, model, opt, batches(2), "none", 0, 2)
    path = OUT / f"filtered-{fmt}-{precision}" if fmt == "sharded" else OUT / f"filtered-full-{precision}.pt"
    keep = lambda name, value: name.startswith("blocks.0.")  # noqa: E731
    fabric.save(path, {"model": model, "info": {"a": 1, "b": 2}}, filter={"model": keep, "info": lambda k, v: k == "a"})
    trained = full_state(fabric, model)
    torch.manual_seed(99)
    fresh = fabric.setup_module(Tiny())
    init = full_state(fabric, fresh)
    state = {"model": fresh, "info": None}
    fabric.load(path, state, strict=False)
    loaded = full_state(fabric, fresh)
    try:
        fabric.load(path, {"model": fresh}, strict=True)
        strict_error = None
    except Exception as e:  # noqa: BLE001
        strict_error = f"{type(e).__name__}: {e}"
    try:  # refused before any collective, on every rank
        fabric.save(OUT / f"never-{precision}", {"model": model, "optimizer": opt}, filter={"optimizer": keep})
        bad_error = None
    except ValueError as e:
        bad_error = str(e)
    out = {"strict_error": strict_error, "bad_error": bad_error, "info": state["info"]}
    if fabric.global_rank == 0:
        saved = lightning_mics.consolidate(path)["model"] if fmt == "sharded" else torch.load(path)["model"]
        out.update(saved=sorted(saved), kept=sorted(k for k in trained if keep(k, None)),
                   saved_dtypes=sorted({str(v.dtype) for v in saved.values()}),
                   saved_equal=max((saved[k] - trained[k]).abs().max().item() for k in saved),
                   from_ckpt=max((loaded[k] - trained[k]).abs().max().item() for k in trained if keep(k, None)),
                   untouched=max((loaded[k] - init[k]).abs().max().item() for k in init if not keep(k, None)),
                   differs=min((init[k] - trained[k]).abs().max().item() for k in init if keep(k, None)))
    return out


def case_load(s, src):
    """Resumes the checkpoints of a ``resume`` run (another layout) and compares with its uninterrupted run."""
    out = {}
    for fmt in ("sharded", "full"):
        fabric = new_fabric(int(s))
        path = Path(src) / ("ckpt-sharded" if fmt == "sharded" else "ckpt-full.pt")
        resumed, state, _, _ = _resume(fabric, path, batches(2), "adamw", "norm")
        if fabric.global_rank == 0:
            out[fmt] = {"rel": compare(resumed, torch.load(Path(src) / f"straight-{fmt}.pt")), "step": state["step"]}
    # load_raw: a plain state_dict file into a sharded module
    fabric = new_fabric(int(s))
    model = fabric.setup_module(Tiny())
    raw = torch.load(Path(src) / "straight-full.pt")
    if fabric.global_rank == 0:
        torch.save(raw, OUT / "raw.pt")
    fabric.barrier()
    fabric.load_raw(OUT / "raw.pt", model)
    got = full_state(fabric, model)
    if fabric.global_rank == 0:
        out["load_raw_rel"] = compare(got, raw)
    return out


EF = {"quantize_gradients": "error_feedback", "quantization_block_size": 32}


def case_feedback(s, precision="32-true"):
    """quantize_gradients='error_feedback' in 32-element blocks: saves halfway (sharded directory and full file),
    trains on; fresh models resume from each. Per format: the resumed run against the uninterrupted one, the
    warnings of the load, the dtypes of the saved model, and (sharded) which ranks' residuals it holds."""
    out = {}
    for fmt in ("sharded", "full"):
        fabric = new_fabric(int(s), precision, state_dict_type=fmt, **EF)
        path = OUT / f"ef-{fmt}" if fmt == "sharded" else OUT / "ef-full.pt"
        straight, resumed, state, _, warned = _save_halfway_and_resume(fabric, path, "sgd", "none")
        if fmt == "sharded":
            out["foreign"] = _refuses_foreign_residuals(state["model"])
        if fabric.global_rank == 0:
            saved = lightning_mics.consolidate(path)["model"].values()
            out[fmt] = {"rel": compare(resumed, straight), "warned": warned,
                        "dtypes": sorted({str(v.dtype) for v in saved})}
            if fmt == "sharded":
                from lightning_mics.checkpoint import files as files
                from lightning_mics.checkpoint.feedback import KEY
                index = files.read_index(path)
                out[fmt]["ranks"] = sorted({p[2] for p in index.planner_data.values() if p[0] == KEY})
    return out


def case_feedback_rows(s):
    """Error feedback with the optimizer's rows over the replicas ([Note: quantized optimizer rows]), AdamW:
    saves halfway (sharded), trains on; then loads that checkpoint into the same, live model and optimizer (rows
    in flight, each replica's agreed copy taken) and trains on again, and a fresh model resumes from it. Both
    against the uninterrupted run; and every replica of a shard rank holds the same chunk bits at the end."""
    from lightning_mics.frontends.shared import engine_of

    fabric = new_fabric(int(s), state_dict_type="sharded", shard_optimizer_state=True, **EF)
    path = OUT / "ef-rows"
    model, opt, _ = setup(fabric, "split", "adamw")
    data, half = batches(2), STEPS // 2
    fabric_steps(fabric, model, opt, data, "none", 0, half)
    fabric.save(path, {"model": model, "optimizer": opt, "step": half})
    fabric_steps(fabric, model, opt, data, "none", half, STEPS)
    straight = full_state(fabric, model)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state)
    fabric_steps(fabric, model, opt, data, "none", state["step"], STEPS)
    live = full_state(fabric, model)
    engine = engine_of(model.module)
    engine.release_idle()
    chunks = torch.cat([sp.local.reshape(-1) for u in engine.units for sp in u.params])
    every = [torch.empty_like(chunks) for _ in range(engine.topo.layout.replicas)]  # same shard rank: same size
    torch.distributed.all_gather(every, chunks, group=engine.topo.replica_group)
    same = all(torch.equal(t, chunks) for t in every)
    fresh = _resume(fabric, path, data, "adamw", "none")[0]
    return {"live": compare(live, straight), "fresh": compare(fresh, straight), "same": same}


def _refuses_foreign_residuals(model):
    """Residuals of the right names but another size (a checkpoint of another model) given to the engine that
    just resumed: refused with a ValueError, and none taken, not even one of the right size listed before it."""
    from lightning_mics.checkpoint import feedback as feedback_state
    from lightning_mics.frontends.shared import engine_of

    engine = engine_of(model.module)
    before = [g.residual_state() for g in engine.grads.all]
    have = [(i, slots, res) for i, st in enumerate(before) for slots, res in st.items()]
    (i0, s0, r0), (i1, s1, r1) = have[0], have[-1]
    name = lambda i, slots: f"u{i}_{'-'.join(map(str, slots))}"  # noqa: E731
    foreign = {name(i0, s0): {"contribution": r0.contribution.clone(), "reduced": r0.reduced.clone()},
               name(i1, s1): {"contribution": torch.zeros(r1.contribution.numel() + 1), "reduced": r1.reduced}}
    try:
        feedback_state._restore(engine, {"rank0": foreign})
        error = None
    except ValueError as err:
        error = str(err)
    kept = all(g.residual_state()[k] is v for g, st in zip(engine.grads.all, before) for k, v in st.items())
    return {"error": error, "kept": kept, "entries": len(have)}


def case_feedback_load(s, block):
    """The sharded checkpoint of ``feedback`` (32-element blocks) resumed with ``block``-element blocks: the
    residuals are laid out for other blocks, so they restart from zero, with a warning."""
    fabric = new_fabric(int(s), **{**EF, "quantization_block_size": int(block)})
    *_, warned = _resume(fabric, OUT / "ef-sharded", batches(2), "sgd", "none")
    return {"warned": warned}


def case_order():
    fabric = new_fabric(WORLD)
    model = Tiny()
    opt = optimizer("sgd", model.parameters())  # built before setup_module: the wrong order
    model = fabric.setup_module(model)
    res = {"error": None, "fused_error": None, "rprop_error": None}
    try:
        fabric.setup_optimizers(opt)
    except ValueError as err:
        res["error"] = str(err)
    try:  # the right order, but a fused kernel DTensor has no rule for (frontend.check_optimizer)
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
    except ValueError as err:
        res["fused_error"] = str(err)
    try:  # a step DTensor cannot run on sharded rows, found by the probe (optimizer_support.step_refusal)
        fabric.setup_optimizers(torch.optim.Rprop(model.parameters(), lr=0.01))
    except ValueError as err:
        res["rprop_error"] = str(err)
    return res


def case_nonfinite(kind="both"):
    """stop_on_nonfinite=True: a NaN loss and gradient on one rank stops every rank before the optimizer step;
    ``kind`` "loss": a NaN added to one rank's loss of the first of two accumulated micro-batches (its gradients
    finite) stops them too."""
    fabric = new_fabric(WORLD, stop_on_nonfinite=True)
    model, opt, _ = setup(fabric, "split", "sgd")
    before = full_state(fabric, model)
    x = local(batches(1)[0, 0], fabric)
    nan = float("nan") if fabric.global_rank == 1 else 1.0
    if kind == "loss":
        with fabric.no_backward_sync(model):
            fabric.backward(lm_loss(model, x) + (nan - 1.0))
        fabric.backward(lm_loss(model, x))
    else:
        fabric.backward(lm_loss(model, x) * nan)
    try:
        opt.step()
    except lightning_mics.frontends.reliability.NonFiniteError as err:
        error = str(err)
    else:
        error = None
    after = full_state(fabric, model)
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def case_quant(s, accum, block, layout=""):
    """quant_equiv.py's nn.Linear + SGD under the Fabric loop (no_backward_sync while accumulating), unquantized
    and with quantize_gradients=True (``layout`` "os": ``"error_feedback"`` with shard_optimizer_state=True,
    [Note: quantized optimizer rows], the weight and the bias stepped by two SGD optimizers one after the other); per
    run the collectives on this rank's replica group (op, dtype) and, on rank 0, the parameters, the float64 reference
    and the bound of [Note: the equivalence bound]."""
    from argparse import Namespace

    from tests.engine import quant_equiv
    args, A = Namespace(s=int(s), steps=6, batch=4), int(accum)
    x, y = quant_equiv.data(WORLD, args.batch, args.steps, A)
    quant = {"quantize_gradients": True} if layout != "os" else \
        {"quantize_gradients": "error_feedback", "shard_optimizer_state": True}
    variants = [{"accum": A}, {"accum": A, **quant, "quantization_block_size": int(block)}]
    out = {"runs": []}
    for v in variants:
        opts = {k: val for k, val in v.items() if k != "accum"}
        fabric = L.Fabric(accelerator="cpu", devices=WORLD, precision="32-true", strategy=MiCSStrategy(
            sharded_data_parallel_degree=int(s), param_persistence_threshold=0,
            reduce_bucket_size=quant_equiv.D_IN * quant_equiv.D_OUT, **opts))
        fabric.launch()
        rank = fabric.global_rank
        model = fabric.setup_module(quant_equiv.build())
        if layout == "os" and len(v) > 1:  # plain SGD either way: the same updates, two pre- and post-step hooks
            opts = fabric.setup_optimizers(*(torch.optim.SGD([p], lr=quant_equiv.LR) for p in (model.weight, model.bias)))
        else:
            opts = [fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=quant_equiv.LR))]
        replica = tuple(fabric.strategy.topology.layout.replica_group_of(rank))
        counter = CommCounter()
        with counter:
            for step in range(args.steps):
                idx = quant_equiv.window_batches(args, WORLD, step, A)[rank]
                for m in range(A):
                    with fabric.no_backward_sync(model, enabled=m < A - 1):
                        fabric.backward(Fn.mse_loss(model(x[idx[m]]), y[idx[m]]) / A)
                for opt in opts:
                    opt.step()
                for opt in opts:
                    opt.zero_grad()
        on_replica = [(op, str(dt)) for (op, g, _), dt in zip(counter.events, counter.dtypes)
                      if g is not None and tuple(g) == replica]
        run = {"replica": sorted(set(on_replica)), "replica_ops": len(on_replica)}
        final = full_state(fabric, model)
        if rank == 0:
            run["params"] = torch.cat([final["weight"].reshape(-1), final["bias"].reshape(-1)]).tolist()
            run["dtypes"] = sorted({str(t.dtype) for t in final.values()})
        out["runs"].append(run)
    if fabric.global_rank == 0:
        ref, bounds = quant_equiv.reference_and_bounds(args, WORLD, x, y, variants, A)
        out["ref"], out["bounds"] = ref.tolist(), bounds
    return out


def case_late(s, accum, kind, clip, precision="32-true", *options):
    """The same loop with prompt collectives and with collectives that finish late: equal bit for bit, the same
    collectives issued by the loop (counted from the dispatcher)."""
    finals, issued, comms = [], {}, []
    for delay in (0.0, 0.03):
        mode = LateCollectives(delay) if delay else None
        if mode is not None:
            mode.__enter__()
        try:
            fabric = new_fabric(int(s), precision, **json.loads(":".join(options) or "{}"))  # (JSON has colons)
            model, opt, _ = setup(fabric, "split", kind, layers=3)
            with CommCounter() as counter:
                fabric_steps(fabric, model, opt, batches(int(accum)), clip, 0, STEPS)
                with torch.no_grad():
                    model(batches(1)[0, 0, :2, :-1])  # a forward outside the loop, as a probe would
            comms.append(counter.events)
            finals.append(full_state(fabric, model))
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                issued = dict(mode.issued)
    a, b = finals
    res = {"issued": issued, "collectives": len(comms[0]), "same_comms": comms[0] == comms[1]}
    if a:
        res["bit_equal"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        res["max_abs"] = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return res


CASES = {"late": case_late, "quant": case_quant, "equiv": case_equiv, "count": case_count, "gan": case_gan, "resume": case_resume,
         "load": case_load, "order": case_order, "nonfinite": case_nonfinite, "feedback": case_feedback,
         "feedback_load": case_feedback_load, "feedback_rows": case_feedback_rows, "torchsd": case_torchsd,
         "filter": case_filter}


def main():
    global WORLD, OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    args = ap.parse_args()
    WORLD, OUT = args.world, Path(args.out)
    results = {}
    for spec in args.cases:
        name, *params = spec.split(":")
        results[spec] = CASES[name](*params)
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    (OUT / f"result{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
