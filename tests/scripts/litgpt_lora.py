"""One rank of the litgpt LoRA test: litgpt's LoRA finetuning pattern (``litgpt/finetune/lora.py``) under
``lightning_mics.fabric.MiCSStrategy``: the LoRA ``GPT`` built under ``fabric.init_module(empty_init=True)``,
``mark_only_lora_as_trainable``, ``fabric.setup_module``, the pretrained weights loaded with
``fabric.load_raw(path, model, strict=False)`` (a plain, non-LoRA ``GPT``'s ``state_dict()`` file: the LoRA
matrices keep their own initialization), AdamW over the trainable parameters only, litgpt's Blocks
activation-checkpointed, ``no_backward_sync`` while accumulating, ``clip_gradients``, and the LoRA weights saved
with ``fabric.save(path, {"model": model}, filter={"model": lora_filter})``. Rank 0 trains a plain process from
the same starting state on the same global batches and compares.

    python litgpt_lora.py --out DIR --world W --s S --format sharded|full
"""

import argparse
import json
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--s", type=int, required=True)
    ap.add_argument("--format", default="sharded")
    args = ap.parse_args()
    out = Path(args.out)
    strategy = MiCSStrategy(sharded_data_parallel_degree=args.s, shard_units=[Block], activation_checkpointing=[Block],
                            param_persistence_threshold=0, state_dict_type=args.format)
    fabric = L.Fabric(accelerator="cpu", devices=args.world, strategy=strategy)
    fabric.launch()
    cfg = config()
    pretrained = out / "pretrained.pt"  # a plain GPT's state_dict(), as litgpt's lit_model.pth
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
    res = {}
    if rank == 0:
        ref = GPT(cfg)
        ref.load_state_dict(init)
        mark_only_lora_as_trainable(ref)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.02)
        for it, batch in enumerate(data, start=1):
            (chunked_cross_entropy(ref(batch[:, :-1]), batch[:, 1:]) / ACCUM).backward()
            if it % ACCUM == 0:
                torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
                ref_opt.step()
                ref_opt.zero_grad()
        lora = {n for n, p in ref.named_parameters() if p.requires_grad}
        expected = GPT(cfg)  # what load_state_dict(strict=False) makes of the file in one process (litgpt's
        expected.load_state_dict(torch.load(pretrained), strict=False)  # names remapped to LoRA's wrapped layers)
        plain = {k: v for k, v in expected.state_dict().items() if k not in lora}
        file = lightning_mics.consolidate(saved) if args.format == "sharded" else torch.load(saved)
        res = {"pretrained_loaded": max((init[k] - v).abs().max().item() for k, v in plain.items()),
               "frozen_moved": max((final[k] - init[k]).abs().max().item() for k in init if k not in lora),
               "lora_moved": min((final[k] - init[k]).abs().max().item() for k in lora if "lora_B" in k),
               "lora_rel": max(((final[k] - ref.state_dict()[k]).norm() / ref.state_dict()[k].norm()).item()
                               for k in lora),
               "n_lora": len(lora), "saved": sorted(file["model"]), "lora_names": sorted(lora)}
    (out / f"result{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
