"""Two `Trainer.fit` calls with two different layouts in one process (2 ranks: s=2, then s=1), launched as a
user does (`python two_layouts.py`; the first Trainer's launcher starts rank 1, the second Trainer finds the
ranks already launched). Each rank prints the live process groups (``_world.pg_map``) and its communication
threads before the first fit, after each fit, and at exit, then one JSON line ``GROUPS {...}``.
"""

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.stress.abort_repro import SEQ, VOCAB, Module, comm_threads, live_groups  # noqa: E402


def fit(shard_size: int) -> "L.Trainer":
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (32, SEQ + 1))
    dl = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=MiCSStrategy(sharded_data_parallel_degree=shard_size, param_persistence_threshold=0))
    trainer.fit(Module(), dl)
    return trainer


def main() -> None:
    record = {"before": live_groups()[0]}
    t1 = fit(2)
    rank = t1.global_rank
    record["after_fit_s2"], names1 = live_groups()
    record["threads_after_fit_s2"] = comm_threads()
    fit(1)
    record["after_fit_s1"], names2 = live_groups()
    record["threads_after_fit_s1"] = comm_threads()
    record["names"] = [names1, names2]
    print(f"GROUPS rank={rank} " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
