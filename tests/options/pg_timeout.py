"""One rank of tests/options/test_options.py's timeout test: ``timeout`` given as a ``datetime.timedelta`` (as
Lightning's own strategies take it) or in seconds reaches the process group the strategy creates, and every sub-group of its mesh
([Note: the timeout of every group] in frontends/shared.py).

    python pg_timeout.py --out DIR --front fabric|trainer --timeout timedelta|seconds
"""

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import lightning_mics  # noqa: E402
from lightning_mics import fabric as mics_fabric  # noqa: E402


def group_timeouts(topology):
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in topology.groups()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--front", choices=["fabric", "trainer"], required=True)
    ap.add_argument("--timeout", choices=["timedelta", "seconds"], required=True)
    args = ap.parse_args()
    timeout = timedelta(seconds=33) if args.timeout == "timedelta" else 33
    if args.front == "fabric":
        f = L.Fabric(accelerator="cpu", devices=2,
                     strategy=mics_fabric.MiCSStrategy(timeout=timeout, sharded_data_parallel_degree=1))
        f.launch()
        rank, groups = f.global_rank, group_timeouts(f.strategy.topology)
    else:
        seen = {}

        class Groups(L.Callback):  # the topology lives from setup to the end of fit
            def on_train_start(self, trainer, pl_module):
                seen["groups"] = group_timeouts(trainer.strategy.topology)

        t = L.Trainer(accelerator="cpu", devices=2, max_steps=1, callbacks=[Groups()],
                      strategy=lightning_mics.MiCSStrategy(timeout=timeout, sharded_data_parallel_degree=1),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(BoringModel())
        rank, groups = t.global_rank, seen["groups"]
    pg = dist.distributed_c10d._get_default_group()
    seconds = pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({"pg_timeout_s": seconds,
                                                                   "group_timeouts_s": groups}))


if __name__ == "__main__":
    main()
