"""One rank of the Fabric fp16 tests: ``16-mixed`` (fp16 autocast + loss scaling) under a real ``L.Fabric`` with
``lightning_mics.fabric.MiCSStrategy``. Fabric turns precision="16-mixed" into bf16 on CPU, so the fp16 plugin is
passed explicitly with a CPU GradScaler (as tests/engine/fp16_overflow.py does for the Trainer).

Cases: ``overflow`` (rank 0 alone multiplies its loss by 1e30 at step 1: every rank must skip that step and back
the scale off identically), ``overflow_fused`` (the same with fused AdamW, which takes the scale and the inf flag
into its kernel instead of an unscale first: the flag must still be every rank's), ``clip``
(fabric.clip_gradients by norm under 16-mixed; rank 0 compares with one plain process running the same autocast
fp16 + GradScaler + clip_grad_norm_ on the same global batches, and with the plain fp32 process, the size of fp16
rounding itself).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402

from lightning_mics.fabric import MiCSStrategy  # noqa: E402
from tests.fabric.fabric_loop import STEPS, batches, compare_global, lm_loss  # noqa: E402
from tests.helpers.models import Tiny  # noqa: E402

BLOW_UP_STEP = 1


def new_fabric(world, **scaler):
    fabric = L.Fabric(accelerator="cpu", devices=world,
                      strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=16),
                      plugins=MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", **scaler)))
    fabric.launch()
    return fabric


def local(x, fabric):
    b = x.shape[0] // fabric.world_size
    return x[fabric.global_rank * b:(fabric.global_rank + 1) * b]


def shard_values(model):
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).clone()
                      for p in model.parameters()])


def case_overflow(world, fused=False):
    fabric = new_fabric(world, init_scale=1024.0, growth_interval=2)  # the user's scaler settings must act
    torch.manual_seed(0)
    model = fabric.setup_module(Tiny())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused
                                  else torch.optim.SGD(model.parameters(), lr=0.2))
    scaler = fabric.strategy.precision.scaler
    data = batches(1)
    changed, scales, nonfinite = [], [], False
    for step in range(STEPS):
        before = shard_values(model)
        loss = lm_loss(model, local(data[step, 0], fabric))
        if step == BLOW_UP_STEP and fabric.global_rank == 0:
            loss = loss * 1e30  # fp32 loss stays finite; its fp16 gradients overflow, on rank 0 only
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        after = shard_values(model)
        changed.append(bool((after != before).any()))
        nonfinite |= not bool(torch.isfinite(after).all())
        scales.append(float(scaler.get_scale()))
    return {"changed": changed, "scales": scales, "nonfinite": nonfinite, "scaler": type(scaler).__name__}


def case_clip(world, max_norm=0.5):
    fabric = new_fabric(world)
    torch.manual_seed(0)
    model = fabric.setup_module(Tiny())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    init = fabric.strategy.get_module_state_dict(model.module)
    data = batches(1)
    norms, scales = [], []
    for step in range(STEPS):
        fabric.backward(lm_loss(model, local(data[step, 0], fabric)))
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=max_norm)))
        opt.step()
        opt.zero_grad()
        scales.append(float(fabric.strategy.precision.scaler.get_scale()))
    final = fabric.strategy.get_module_state_dict(model.module)
    res = {"norms": norms, "scales": scales}
    if fabric.global_rank != 0:
        return res
    ref_norms = {}
    for name, fp16 in (("fp16", True), ("fp32", False)):
        ref = Tiny()
        ref.load_state_dict(init)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", enabled=fp16)
        ref_norms[name] = []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = lm_loss(ref, data[step, 0])
            scaler.scale(loss).backward()
            scaler.unscale_(ref_opt)
            ref_norms[name].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
        res[f"rel_{name}"] = compare_global(final, ref.state_dict())
        res[f"ref_norms_{name}"] = ref_norms[name]
        if fp16:
            res["ref_scales"] = float(scaler.get_scale())
    res["moved"] = compare_global(final, init)
    return res


CASES = {"overflow": case_overflow, "overflow_fused": lambda world: case_overflow(world, fused=True),
         "clip": case_clip}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    args = ap.parse_args()
    results = {name: CASES[name](args.world) for name in args.cases}
    import torch.distributed as dist
    (Path(args.out) / f"result{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
