"""One rank of a capped fit that compares, at every dispatched op, the gathered elements the engine counts against
``max_live_parameters`` ([Note: live cap] in lightning_mics/engine/schedule.py) with what is alive, measured from storages
(tests/helpers/live.py: the plain parameters' storages and the all-gather outputs not yet copied out), and records
the sizes of the all-gather outputs against the units' full sizes."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.live import LiveMeter  # noqa: E402
from tests.engine import equiv  # noqa: E402

GATHERS = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"}


class Sample(TorchDispatchMode):
    """At every op: the measured live bytes and the engine's count (fp32: 4 bytes an element)."""

    def __init__(self, meter, log, out):
        super().__init__()
        self.meter, self.log, self.out = meter, log, out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        res = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d" and name in GATHERS:
            t = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
            self.meter.on_all_gather(t)
            self.out["gather_numels"].add(t.numel())
        before = self.meter.peak_bytes
        self.meter.peak_bytes = 0
        self.meter.sample()
        measured, self.meter.peak_bytes = self.meter.peak_bytes, max(before, self.meter.peak_bytes)
        counted = 4 * self.log.live_elements
        self.out["over"] = max(self.out["over"], measured - counted)
        self.out["measured_peak"] = max(self.out["measured_peak"], measured)
        self.out["counted_peak"] = max(self.out["counted_peak"], counted)
        if func.namespace != "c10d" and not func.is_view:
            self.meter.read_by_compute(t for a in (*args, *kwargs.values())
                                       for t in (a if isinstance(a, (list, tuple)) else (a,)))
        return res


class Record(L.Callback):
    def __init__(self, out):
        self.out, self.mode, self.meter = out, None, None

    def on_train_start(self, trainer, pl_module):
        self.meter = LiveMeter(pl_module, trainer.optimizers)
        units = trainer.strategy.engine.units
        self.out.update(full=[u.full_numel for u in units], gather=[u.gather_numel for u in units],
                        stored=[u.stored_numel for u in units])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = Sample(self.meter, trainer.strategy.engine.log, self.out)
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        stats = trainer.strategy.comm_stats  # set at each optimizer step
        self.out["stats_peak"] = max(self.out["stats_peak"], stats.get("mem/live_elements_peak", 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", required=True)
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    equiv.LAYERS = 4
    accum, steps, batch = 2, 2, 2
    x, y = equiv.data(world, batch, steps, accum)
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=batch, sampler=DistributedSampler(ds, world, rank, shuffle=False))
    results = []
    for variant in json.loads(args.variants):
        out = {"over": 0, "measured_peak": 0, "counted_peak": 0, "stats_peak": 0, "gather_numels": set()}
        trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, accumulate_grad_batches=accum,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, callbacks=[Record(out)],
                            strategy=MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0,
                                                  **variant))
        torch.manual_seed(0)
        trainer.fit(equiv.Module("gpt", "adamw"), loader)
        out["gather_numels"] = sorted(out["gather_numels"])
        results.append(out)
    Path(args.out, f"result{rank}.json").write_text(json.dumps({"rank": rank, "variants": results}))


if __name__ == "__main__":
    main()
