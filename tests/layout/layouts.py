"""Several fits with different layouts in one process (one rank of a 4-rank launch): s = 2, then 4, then 2
again (an equal mesh built after the first one's groups were released). Records the live process groups after
each fit and the parameters each fit ends with."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.trainer_cases import BATCH, classification_data  # noqa: E402
from tests.trainer.compat import BF16  # noqa: E402


def live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    ds = classification_data(2 * world * BATCH)
    groups, params = [], []
    for s in (2, 4, 2):
        L.seed_everything(0, verbose=False)
        module = BF16()  # AdamW: DTensor ops in every step
        trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            strategy=MiCSStrategy(sharded_data_parallel_degree=s, param_persistence_threshold=0))
        trainer.fit(module, DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, world, rank, shuffle=False)))
        groups.append(live_groups())
        params.append({n: p.detach().clone() for n, p in module.named_parameters()})
    same = all(torch.equal(params[0][n], params[2][n]) for n in params[0])
    close = max((params[0][n] - params[1][n]).abs().max().item() for n in params[0])
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps(
        {"groups": groups, "first_equals_third": same, "s2_vs_s4_max_abs": close}))


if __name__ == "__main__":
    main()
