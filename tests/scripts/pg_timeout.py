"""One rank of tests/test_topology_and_options.py's timeout test: ``timeout`` given as a ``datetime.timedelta`` (as
Lightning's own strategies take it) or in seconds reaches the process group the strategy creates.

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--front", choices=["fabric", "trainer"], required=True)
    ap.add_argument("--timeout", choices=["timedelta", "seconds"], required=True)
    args = ap.parse_args()
    timeout = timedelta(seconds=33) if args.timeout == "timedelta" else 33
    if args.front == "fabric":
        f = L.Fabric(accelerator="cpu", devices=2, strategy=mics_fabric.MiCSStrategy(timeout=timeout))
        f.launch()
        rank = f.global_rank
    else:
        t = L.Trainer(accelerator="cpu", devices=2, strategy=lightning_mics.MiCSStrategy(timeout=timeout), max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(BoringModel())
        rank = t.global_rank
    pg = dist.distributed_c10d._get_default_group()
    seconds = pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({"pg_timeout_s": seconds}))


if __name__ == "__main__":
    main()
