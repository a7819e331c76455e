"""One rank of the litgpt LoRA test: litgpt's LoRA finetuning pattern (``litgpt/finetune/lora.py``) under
``lightning_mics.fabric.MiCSStrategy``: the LoRA ``GPT`` built under ``fabric.init_module(empty_init=True)``,
``mark_only_lora_as_trainable``, ``fabric.setup_module``, the pretrained weights loaded with
``fabric.load_raw(path, model, strict=False)`` (a plain, non-LoRA ``GPT``'s ``state_dict()`` file: the LoRA
matrices keep their own initialization), AdamW over the trainable parameters only, litgpt's Blocks
activation-checkpointed, ``no_backward_sync`` while accumulating, ``clip_gradients``, and the LoRA weights saved
with ``fabric.save(path, {"model": model}, filter={"model": lora_filter})``. Rank 0 trains a plain process from
the same starting state on the same global batches and compares.

    python litgpt_lora.py --out DIR --world W --s S --format sharded|full [--precisions 32-true bf16-true ...]

One launch runs each precision in turn (a Fabric each); the result file holds one entry per precision.
"""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import litgpt.model  # noqa: E402
from litgpt.lora import GPT, Block, Config, lora_filter, mark_only_lora_as_trainable  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

import lightning_mics  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402

STEPS, ACCUM, MICRO = 3, 2, 2


def config() -> Config:
    return Config.from_name("pythia-14m", n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=96,
                            padded_vocab_size=96, intermediate_size=64, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                            lora_query=True, lora_value=True, lora_projection=True, lora_mlp=True)


def steps(fabric, model, optimizer, data):
    for it, batch in enumerate(data, start=1):
        accumulating = it % ACCUM != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = chunked_cross_entropy(model(batch[:, :-1]), batch[:, 1:])
            fabric.backward(loss / ACCUM)
        if not accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()


def run(args, precision: str, out: Path) -> dict:
    """One finetuning run in ``precision``; rank 0's comparison with the plain process (other ranks: {})."""
    out.mkdir(parents=True, exist_ok=True)
    strategy = MiCSStrategy(sharded_data_parallel_degree=args.s, shard_units=[Block], activation_checkpointing=[Block],
                            param_persistence_threshold=0, state_dict_type=args.format)
    fabric = L.Fabric(accelerator="cpu", devices=args.world, strategy=strategy, precision=precision)
    fabric.launch()
    cfg = config()
    pretrained = out / "pretrained.pt"  # a plain GPT's state_dict() in fp32, as litgpt's lit_model.pth
    if fabric.global_rank == 0:
        torch.manual_seed(0)
        torch.save(litgpt.model.GPT(cfg).state_dict(), pretrained)
    fabric.barrier()
    fabric.seed_everything(1)
    with fabric.init_module(empty_init=True):
        model = GPT(cfg)
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    fabric.load_raw(pretrained, model, strict=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.02))
    init = fabric.strategy.get_module_state_dict(model.module)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.vocab_size, (STEPS * ACCUM, args.world * MICRO, cfg.block_size + 1), generator=g)
    rank = fabric.global_rank
    steps(fabric, model, optimizer, data[:, rank * MICRO:(rank + 1) * MICRO])
    final = fabric.strategy.get_module_state_dict(model.module)
    saved = out / ("lora" if args.format == "sharded" else "lora.pt")
    fabric.save(saved, {"model": model}, filter={"model": lora_filter})
    fabric.barrier()
    if rank != 0:
        return {}
    ref = reference(cfg, init, data, precision, fabric.strategy.precision, None)
    emulated = reference(cfg, init, data, precision, fabric.strategy.precision, args.world)
    lora = {n for n, p in ref.named_parameters() if p.requires_grad}
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    expected = GPT(cfg).to(dtype)  # what load_state_dict(strict=False) makes of the fp32 file in one process
    expected.load_state_dict(torch.load(pretrained), strict=False)  # (names remapped to LoRA's wrapped layers)
    plain = {k: v for k, v in expected.state_dict().items() if k not in lora}
    file = lightning_mics.consolidate(saved) if args.format == "sharded" else torch.load(saved)
    want, emul = ref.state_dict(), emulated.state_dict()
    flat = lambda d: torch.cat([d[k].float().reshape(-1) for k in sorted(lora)])  # noqa: E731
    rel = lambda a, b: ((flat(a) - flat(b)).norm() / flat(b).norm()).item()  # noqa: E731
    return {"pretrained_loaded": max((init[k] - v).abs().max().item() for k, v in plain.items()),
            "frozen_moved": max((final[k] - init[k]).abs().max().item() for k in init if k not in lora),
            "lora_moved": min((final[k] - init[k]).abs().max().item() for k in lora if "lora_B" in k),
            "lora_rel": max(((final[k] - want[k]).float().norm() / want[k].float().norm()).item() for k in lora),
            "lora_rel_global": rel(final, want), "emulated_rel_global": rel(final, emul),
            "emulated_rel": max(((final[k] - emul[k]).float().norm() / emul[k].float().norm()).item() for k in lora),
            "emulated_vs_plain": rel(emul, want),
            "saved_equal": max((file["model"][k] - final[k]).abs().max().item() for k in lora),
            "dtypes": sorted({str(t.dtype) for t in final.values()}),
            "saved_dtypes": sorted({str(t.dtype) for t in file["model"].values()}),
            "n_lora": len(lora), "saved": sorted(file["model"]), "lora_names": sorted(lora)}


def reference(cfg, init, data, precision, plugin, world):
    """One plain process from ``init`` on the same global batches, forward inside Fabric's own precision context
    (``plugin``: autocast for bf16-mixed, bf16 default dtype for bf16-true) and its output converted as Fabric
    converts it. ``world`` None: the whole micro-batch at once, the gradients accumulating in the parameters' dtype
    (what a user's single-process run does). ``world`` W: what the precision says MiCS computes, each rank's share
    of the micro-batch forward and backward on bf16 copies of the parameters (param_dtype), their gradients summed
    in fp32 (reduce_dtype) over ranks and micro-batches, cast to the parameters' dtype for clipping and the step.
    The two differ only in the order of fp32 sums from the MiCS run, and in roundings from the plain one."""
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    ref = GPT(cfg)
    for p in ref.parameters():  # the buffers (litgpt's rope cache) stay fp32, as the meta-initialized module's
        p.data = p.data.to(dtype)  # reset_parameters rebuilds them (under FSDP alike)
    ref.load_state_dict(init)
    mark_only_lora_as_trainable(ref)
    trainable = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2, weight_decay=0.02)
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in trainable.items()}
    chunks = 1 if world is None else world
    compute = torch.float32 if precision == "32-true" else torch.bfloat16
    for it, batch in enumerate(data, start=1):
        for part in batch.chunk(chunks):
            work = ref if world is None else copy.deepcopy(ref)
            if world is not None:  # the parameters in param_dtype; buffers (litgpt's rope cache) as they are
                for p in work.parameters():
                    p.data = p.data.to(compute)
            with plugin.forward_context():
                logits = work(part[:, :-1])
            loss = chunked_cross_entropy(plugin.convert_output(logits), part[:, 1:]) * (part.size(0) / batch.size(0))
            (loss / ACCUM).backward()
            if world is not None:
                for n, p in work.named_parameters():
                    if p.requires_grad:
                        acc[n] += p.grad.float()
        if it % ACCUM == 0:
            if world is not None:
                for n, p in trainable.items():
                    p.grad = acc[n].to(p.dtype, copy=True)
                    acc[n].zero_()
            grads = [p.grad for p in trainable.values()]
            if world is None:
                torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
            else:  # the norm in fp32 over the (bf16) gradients, as the sharded clip computes it
                total = torch.stack([g.float().norm() for g in grads]).norm()
                torch._foreach_mul_(grads, torch.clamp(1.0 / (total + 1e-6), max=1.0))
            opt.step()
            opt.zero_grad()
    return ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--s", type=int, required=True)
    ap.add_argument("--format", default="sharded")
    ap.add_argument("--precisions", nargs="+", default=["32-true"])
    args = ap.parse_args()
    out = Path(args.out)
    res = {precision: run(args, precision, out / precision) for precision in args.precisions}
    rank = int(os.environ["RANK"])
    (out / f"result{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
