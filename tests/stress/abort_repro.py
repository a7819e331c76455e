"""The issue-24 user case, run as a plain `python abort_repro.py [mics|ddp]`.

A small LightningModule (an embedding, two blocks in an nn.ModuleList, a head) trained for 2 epochs on 2 CPU
ranks; Lightning's own launcher (_SubprocessScriptLauncher) starts the second rank, as for a user.

Diagnostics, all off by default:
  STRESS_REPORT_GROUPS=1   each rank prints the live process groups (count and names) and its communication
                           threads (gloo workers, device loops, TCPStore) after fit, and again at exit (from an
                           atexit handler registered first, so it runs after any handler a strategy registers)
  STRESS_WAIT_CHILDREN=1   rank 0 waits for the ranks Lightning launched and exits non-zero if one failed
                           (Lightning itself does not wait: a child's abort is only visible in the output)
  STRESS_TRACE_COLLECTIVES=1  each rank prints, at exit, the last collectives it issued (name, group size)
  STRESS_SWITCH_INTERVAL=S sys.setswitchinterval(S) in each rank: a long interval (e.g. 1.0) keeps the GIL
                           with the main thread, so a gloo worker that needs the GIL to release a finished Work
                           is still waiting for it when the interpreter finalizes (amplifies the abort)
  STRESS_TAIL_COLLECTIVE=1|world|async  after fit, one all_reduce of a fresh tensor on every live group (1),
                           on the default group only (world), or on every live group without waiting for it
                           (async), then straight to exit: a Work that finishes just before the interpreter
                           finalizes. With a long switch interval this amplifies the abort.
  STRESS_RANKS_PER_NODE=P  MiCSStrategy(ranks_per_node=P) (P=1: hierarchical layout with a second DeviceMesh)
  STRESS_DESTROY_AT_EXIT=1 the script itself calls torch.distributed.destroy_process_group() after fit (a
                           user-side workaround, to compare against)
"""

import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402

VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def live_groups():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0, []
    return len(c10d._world.pg_map), sorted(c10d._world.pg_names.values())


_TRACE = []
_LAST_DONE = [0.0]


def _trace_collectives() -> None:
    import atexit
    import functools

    import torch.distributed as dist

    names = ["all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_reduce", "all_gather", "broadcast", "barrier", "broadcast_object_list", "all_gather_object",
             "gather_object", "reduce", "gather", "scatter", "monitored_barrier"]
    for name in names:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrap(fn=fn, name=name):
            @functools.wraps(fn)
            def inner(*args, **kwargs):
                group = kwargs.get("group")
                try:
                    size = dist.get_world_size(group) if dist.is_initialized() else None
                except Exception:
                    size = "?"
                _TRACE.append(f"{name}(size={size}, async={kwargs.get('async_op', False)})")
                del _TRACE[:-8]
                out = fn(*args, **kwargs)
                _LAST_DONE[0] = time.monotonic()
                return out
            return inner

        setattr(dist, name, wrap())
    atexit.register(lambda: print(f"[pid {os.getpid()}] last collectives: {_TRACE[-3:]}; the last one returned "
                                  f"{1e3 * (time.monotonic() - _LAST_DONE[0]):.1f} ms before atexit", flush=True))


def comm_threads():
    """Live communication threads of this process, by name (gloo workers and device loops, the TCPStore)."""
    counts = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        if name.startswith(("pt_", "gloo")):
            counts[name] = counts.get(name, 0) + 1
    return counts


def main() -> None:
    if os.environ.get("STRESS_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["STRESS_SWITCH_INTERVAL"]))
    if os.environ.get("STRESS_TRACE_COLLECTIVES"):
        _trace_collectives()
    if os.environ.get("STRESS_REPORT_GROUPS"):
        import atexit
        import gc

        def at_exit():  # registered first, so it runs after any handler a strategy registers during fit
            gc.collect()
            print(f"[pid {os.getpid()}] at exit: live process groups {live_groups()[0]}, threads {comm_threads()}",
                  flush=True)

        atexit.register(at_exit)
    which = sys.argv[1] if len(sys.argv) > 1 else "mics"
    kwargs = {}
    if os.environ.get("STRESS_RANKS_PER_NODE"):  # e.g. 1: a shard group "spans nodes", a second (node) mesh
        kwargs["ranks_per_node"] = int(os.environ["STRESS_RANKS_PER_NODE"])
    strategy = (MiCSStrategy(sharded_data_parallel_degree=2, param_persistence_threshold=0, **kwargs)
                if which == "mics" else which)
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (64, SEQ + 1))
    dl = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), dl)
    rank = trainer.global_rank
    if os.environ.get("STRESS_REPORT_GROUPS"):
        n, names = live_groups()
        print(f"[rank {rank}] live process groups after fit: {n} {names}; threads {comm_threads()}", flush=True)
    print(f"[rank {rank}] fit done, global_step={trainer.global_step}", flush=True)
    if os.environ.get("STRESS_TAIL_COLLECTIVE"):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        mode = os.environ["STRESS_TAIL_COLLECTIVE"]  # 1 | world (default group only) | async (not waited)
        groups = sorted(c10d._world.pg_map, key=lambda g: int(c10d._world.pg_names[g]))
        if mode == "world":
            groups = [c10d._get_default_group()]
        for group in groups:
            dist.all_reduce(torch.ones(4), group=group, async_op=mode == "async")
    if os.environ.get("STRESS_DESTROY_AT_EXIT"):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if os.environ.get("STRESS_REPORT_GROUPS"):
            import gc

            gc.collect()
            print(f"[rank {rank}] after destroy_process_group(): threads {comm_threads()}", flush=True)
    if rank == 0 and os.environ.get("STRESS_WAIT_CHILDREN"):
        procs = getattr(trainer.strategy._launcher, "procs", [])
        codes = [p.wait(timeout=120) for p in procs]
        print(f"[rank 0] launched ranks exited with {codes}", flush=True)
        if any(codes):
            sys.exit(3)


if __name__ == "__main__":
    main()
