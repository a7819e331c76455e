"""One rank of the litgpt test: litgpt's ``GPT`` in litgpt's pretraining loop pattern under
``lightning_mics.fabric.MiCSStrategy`` (``examples/fabric_litgpt/pretrain.py``), against one plain process on
the same global batches (rank 0). ``--cases s:accum[:fused][:compile][:ac] ...`` (``fused``: AdamW's fused
implementation, as litgpt runs it on CUDA, in both runs; ``compile``: the model ``torch.compile``d before
``fabric.setup`` as litgpt does, the reference eager; ``ac``: litgpt's Blocks activation-checkpointed); one
Fabric per case in the same processes."""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
from litgpt.model import GPT, Block  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

from lightning_mics.fabric import MiCSStrategy  # noqa: E402

spec = importlib.util.spec_from_file_location("pretrain", REPO / "examples" / "fabric_litgpt" / "pretrain.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

STEPS, MICRO = 3, 2


def run(world, s, accum, fused, compile, ac):
    strategy = MiCSStrategy(sharded_data_parallel_degree=s, shard_units=[Block], param_persistence_threshold=0,
                            activation_checkpointing=[Block] if ac else None)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    cfg = example.config()
    state = example.setup(fabric, cfg, fused=fused, compile=compile)
    model = state["model"]
    init = fabric.strategy.get_module_state_dict(model.module)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.vocab_size, (STEPS * accum, world * MICRO, cfg.block_size + 1), generator=g)
    rank = fabric.global_rank
    example.fit(fabric, state, data[:, rank * MICRO:(rank + 1) * MICRO], accum)
    final = fabric.strategy.get_module_state_dict(model.module)
    units = len(fabric.strategy._engines[0].units)
    if rank != 0:
        return {"units": units}
    ref = GPT(cfg)
    ref.load_state_dict(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    for it, batch in enumerate(data, start=1):
        loss = chunked_cross_entropy(ref(batch[:, :-1]), batch[:, 1:])
        (loss / accum).backward()
        if it % accum == 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    ref_sd = ref.state_dict()
    per = {k: float((final[k] - v).abs().max() / max(float(v.abs().max()), 1e-12)) for k, v in ref_sd.items()}
    rel = max(per.values())
    diff = torch.cat([(final[k] - v).flatten() for k, v in ref_sd.items()])
    whole = torch.cat([v.flatten() for v in ref_sd.values()])
    rel_global = float(diff.norm() / whole.norm())
    moved = sum(int(not torch.equal(init[k], final[k])) for k in ref_sd)
    return {"rel": rel, "rel_global": rel_global, "worst": sorted(per.items(), key=lambda kv: -kv[1])[:4], "moved": moved, "n": len(ref_sd), "steps": state["step_count"], "units": units}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    args = ap.parse_args()
    results = {}
    for case in args.cases:
        s, accum, *flags = case.split(":")
        results[case] = run(args.world, int(s), int(accum), fused="fused" in flags, compile="compile" in flags,
                            ac="ac" in flags)
    import torch.distributed as dist
    (Path(args.out) / f"result{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
