"""A checkpoint loaded into a live model in the middle of a Fabric loop (one rank of 2): fabric_loop.py's model and
AdamW, 2 optimizer steps, a save, 1 more step (so every unit that stays gathered between steps is gathered again:
ZeRO-1's pinned one), the load, the last 2 steps; against one run straight through the 4 steps in the same
processes. Rank 0 writes ``result.json``: the largest relative difference per layout and format.

    python live_load.py --out DIR
"""

import argparse
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.fabric.fabric_loop as FL  # noqa: E402

LAYOUTS = {"zero1": dict(s=1, shard_optimizer_state=True), "mics": dict(s=2)}


def resumed_and_straight(out, layout, fmt):
    kw = dict(LAYOUTS[layout])
    fabric = FL.new_fabric(kw.pop("s"), state_dict_type=fmt, **kw)
    model, opt, _ = FL.setup(fabric, "split", "adamw")
    data, half = FL.batches(2), FL.STEPS // 2
    FL.fabric_steps(fabric, model, opt, data, "norm", 0, half)
    path = out / f"{layout}-{fmt}" if fmt == "sharded" else out / f"{layout}-{fmt}.pt"
    state = {"model": model, "optimizer": opt}
    fabric.save(path, state)
    FL.fabric_steps(fabric, model, opt, data, "norm", 0, 1)  # a step the load takes back
    fabric.load(path, state)
    FL.fabric_steps(fabric, model, opt, data, "norm", half, FL.STEPS)
    resumed = FL.full_state(fabric, model)
    model, opt, _ = FL.setup(fabric, "split", "adamw")  # seeded as the first
    FL.fabric_steps(fabric, model, opt, data, "norm", 0, FL.STEPS)
    return fabric.global_rank, resumed, FL.full_state(fabric, model)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    FL.OUT, FL.WORLD = out, 2
    result = {}
    for layout in LAYOUTS:
        for fmt in ("sharded", "full"):
            rank, resumed, straight = resumed_and_straight(out, layout, fmt)
            if rank == 0:
                result[f"{layout}:{fmt}"] = {"rel": FL.compare(resumed, straight), "n": len(straight)}
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
