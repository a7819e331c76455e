"""One rank of benchmarks/cluster.py, started by ``torchrun --nnodes 2 --nproc-per-node 2`` in each host's namespace.

Every case runs through Lightning's Trainer on the same GPT (benchmarks/peers.py's model, from the same seed), the
same batches (drawn per global rank from a fixed seed, no sampler) and AdamW, fp32:

  ddp          Lightning's ``DDPStrategy`` (torch DDP: one all-reduce over the 4 ranks in 25 MB buckets, during
               the boundary micro-batch's backward; ``no_sync`` before it)
  fsdp2_full   Lightning's ``ModelParallelStrategy`` with FSDP2 ``fully_shard`` per block and on the root over all 4
               ranks (ZeRO-3 across hosts), its defaults: all-gathers and a reduce-scatter every micro-batch
  fsdp2_hsdp   the same over a (2 hosts x 2) (replicate, shard) mesh, tuned as a careful user runs it:
               ``set_requires_all_reduce`` only on the boundary micro-batch, so the replica all-reduce runs once
               per optimizer step
  mics_host    ``MiCSStrategy(sharded_data_parallel_degree=2, ranks_per_node=2)``: a sharding group per host
  mics_twohop  ``MiCSStrategy(sharded_data_parallel_degree=4, hierarchical_allgather=True)``: one group over both
               hosts, the parameter all-gather in two hops
  mics_host_os mics_host with ``shard_optimizer_state=True``: the optimizer's rows over the two hosts, the replica
               all-reduce split into a reduce-scatter before the step and an all-gather that the next forward
               waits for unit by unit ([Note: optimizer rows over replicas] in lightning_mics/engine/optimizer_rows.py)
  mics_host_q8    mics_host with ``quantize_gradients=True``: the replica all-reduce (across hosts) in int8 blocks
  mics_twohop_q8  mics_twohop with ``quantize_allgather=True``: the gather's cross-host hop in int8 blocks
  mics_host_os_q8 mics_host_os with ``quantize_gradients="error_feedback"``: the reduce-scatter and the rows'
                  change in int8 blocks ([Note: quantized optimizer rows] in lightning_mics/engine/optimizer_rows.py)
  mics_host_diloco    mics_host with ``replica_sync="diloco", sync_every=H`` (``--sync-every``, the outer SGD's
                      defaults): inside a window nothing crosses the hosts (each host's shard group trains alone);
                      every H-th optimizer step ends with the pseudo-gradients' all-reduce between the hosts
                      ([Note: DiLoCo across replica groups] in lightning_mics/options.py). Not exact data
                      parallelism: the other cases are its exact peers
  mics_host_diloco_q8 mics_host_diloco with ``quantize_gradients=True``: the pseudo-gradients in int8 blocks
  mics_host_diloco_stream    mics_host_diloco streaming (``STREAMING``): two fragments synced in turn, one every
                             H / 2 steps, its all-reduce in flight over ``--sync-delay`` inner steps (1), mixed in
                             at 0.5
                             ([Note: streaming fragments] in lightning_mics/engine/fragments.py)
  mics_host_diloco_stream_q8 mics_host_diloco_stream with the pseudo-gradients in int8 blocks
The MiCS cases shard every parameter (``param_persistence_threshold=0``), as FSDP2 does.

[Note: the benchmark's communication clock]
``CommClock`` wraps the ``torch.distributed`` collectives that DDP's hook, FSDP2 and the MiCS engine call
(``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, and ``all_to_all_single`` of the int8 all-reduce) and ``Work.wait``: per collective and scope (``cross``: its group spans both hosts,
``local``: one host) it counts calls and bytes (the larger of input and output) and the seconds this rank was
blocked: the whole call when synchronous, the ``wait()`` when asynchronous. DDP's reducer waits for its buckets
in C++, out of sight: for ``ddp`` the blocked time is estimated as the last bucket's completion minus the last
bucket's issue (the end of backward's compute). A ``StepClock`` callback stamps every optimizer step's end, takes
the window, and (with ``--marks``) has the link's counters read while all ranks wait at the timed window's two
ends, the warm-up's last step and the last step ([Note: step marks] in twohosts.py); a step is timed from the
previous step's end (after its handshake, where it had one) to its own end.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

CASES = ("ddp", "fsdp2_full", "fsdp2_hsdp", "mics_host", "mics_twohop", "mics_host_os", "mics_host_q8",
         "mics_twohop_q8", "mics_host_os_q8", "mics_host_diloco", "mics_host_diloco_q8", "mics_host_diloco_stream",
         "mics_host_diloco_stream_q8")
DILOCO = tuple(c for c in CASES if "_diloco" in c)  # the replica groups apart between syncs: not exact
STREAMED = tuple(c for c in DILOCO if "_stream" in c)  # DiLoCo's fragments synced in turn (``STREAMING``)
# the streaming cases' settings: the quality grid's (benchmarks/diloco_quality.py, fragments=2:delay=1:mixing=0.5)
STREAMING = {"sync_fragments": 2, "sync_delay": 1, "fragment_mixing": 0.5}


def syncs_per_window(case: str) -> int:
    """The outer syncs in one window of H steps: one, or one per fragment when streaming."""
    return STREAMING["sync_fragments"] if case in STREAMED else 1
RANKS_PER_HOST = 2
# collective -> index of the positional argument holding its larger buffer (the output of a gather, the input of
# a reduce-scatter); every one of them takes ``group`` and ``async_op`` keywords
_WRAPPED = {"all_reduce": 0, "all_gather_single": 0, "all_gather_into_tensor": 0, "reduce_scatter_single": 1,
            "reduce_scatter_tensor": 1, "all_to_all_single": 1}


class CommClock:
    """Counts and times collectives per ``op/scope`` ([Note: the benchmark's communication clock])."""

    def __init__(self, ranks_per_host: int = RANKS_PER_HOST, timeline: bool = False) -> None:
        self.ranks_per_host = ranks_per_host
        self.timeline: Optional[List[List[Any]]] = [] if timeline else None  # [t, event, op/scope, bytes]
        self.window: Dict[str, List[float]] = defaultdict(lambda: [0, 0, 0.0])  # calls, bytes, seconds blocked
        self._pending: Dict[int, Any] = {}  # id(work) -> (key, work): an asynchronous collective not waited yet
        self._scopes: Dict[int, str] = {}
        self.ddp_issued: List[float] = []
        self.ddp_done: List[float] = []

    def scope(self, group: Any) -> str:
        key = id(group)
        if key not in self._scopes:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            self._scopes[key] = "cross" if len({r // self.ranks_per_host for r in ranks}) > 1 else "local"
        return self._scopes[key]

    def install(self) -> None:
        """Wraps the collectives and ``Work.wait`` of this process (``uninstall`` puts them back)."""
        work_cls = dist.distributed_c10d.Work
        # the names this torch has (``*_single`` from 2.13)
        self._originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}
        self._original_wait = original_wait = work_cls.wait
        for name, fn in self._originals.items():
            setattr(dist, name, self._wrap(name, fn, _WRAPPED[name]))
        clock = self

        def wait(work: Any, *a: Any, **k: Any) -> Any:
            entry = clock._pending.pop(id(work), None)
            t0 = time.perf_counter()
            out = original_wait(work, *a, **k)
            if entry is not None:
                clock.window[entry[0]][2] += time.perf_counter() - t0
                clock.stamp("wait", entry[0], 0, t0)
                clock.stamp("waited", entry[0], 0)
            return out

        work_cls.wait = wait

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        dist.distributed_c10d.Work.wait = self._original_wait

    def _wrap(self, name: str, fn: Any, arg: int) -> Any:
        sig = inspect.signature(fn)

        def call(*a: Any, **k: Any) -> Any:
            bound = sig.bind(*a, **k).arguments
            key = f"{name}/{self.scope(bound.get('group'))}"
            tensor = a[arg] if len(a) > arg else bound[list(sig.parameters)[arg]]
            entry = self.window[key]
            nbytes = tensor.numel() * tensor.element_size()
            entry[0] += 1
            entry[1] += nbytes
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.stamp("issue", key, nbytes, t0)
            if bound.get("async_op"):
                self._pending[id(out)] = (key, out)
                if self.timeline is not None:  # completion, seen from gloo's thread (where the Work has a future)
                    try:
                        out.get_future().add_done_callback(lambda _f, key=key: self.stamp("done", key, 0))
                    except RuntimeError:  # e.g. gloo's reduce-scatter: its completion is seen at its wait only
                        pass
            else:
                entry[2] += time.perf_counter() - t0
                self.stamp("done", key, 0)
            return out

        return call

    def stamp(self, event: str, key: str, nbytes: int, t: Optional[float] = None) -> None:
        if self.timeline is not None:
            self.timeline.append([time.perf_counter() if t is None else t, event, key, nbytes])

    def take(self) -> Dict[str, Any]:
        """The window since the last call: ``{op/scope: {calls, bytes, wait_s}}`` (+ ``ddp_exposed_s``), reset."""
        out: Dict[str, Any] = {k: dict(calls=v[0], bytes=v[1], wait_s=v[2]) for k, v in sorted(self.window.items())}
        if self.ddp_issued and self.ddp_done:
            out["ddp_exposed_s"] = max(0.0, max(self.ddp_done) - max(self.ddp_issued))
        self.window.clear()
        self.ddp_issued, self.ddp_done = [], []
        for k, (_, work) in list(self._pending.items()):
            if work.is_completed():  # waited for elsewhere (a future, C++): not blocked time we can see
                del self._pending[k]
        return out


def ddp_hook(clock, bucket):  # unannotated: DDP checks a hook's annotation against dist.GradBucket
    """torch's default DDP all-reduce over the world (sum / world, asynchronous), its issue and completion stamped."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(tensor, async_op=True)
    clock.ddp_issued.append(time.perf_counter())

    def done(fut: torch.futures.Future) -> torch.Tensor:
        clock.ddp_done.append(time.perf_counter())
        return fut.value()[0]

    return work.get_future().then(done)


def make_module(case: str, args: argparse.Namespace):
    import lightning as L

    from lightning_mics.app.models import GPT, GPTConfig
    from peers import fsdp2_shard

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                                     n_head=args.heads, n_embd=args.width))
            self.n_params = self.gpt.num_params()

        def configure_model(self) -> None:
            if not case.startswith("fsdp2") or hasattr(self.gpt, "set_requires_all_reduce"):
                return
            from torch.distributed.device_mesh import init_device_mesh

            world = dist.get_world_size()
            if case == "fsdp2_full":
                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            else:
                mesh = init_device_mesh("cpu", (world // RANKS_PER_HOST, RANKS_PER_HOST),
                                        mesh_dim_names=("replicate", "shard"))
            fsdp2_shard(self.gpt, mesh)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            if case == "fsdp2_hsdp":  # the replica all-reduce only on the boundary micro-batch
                self.gpt.set_requires_all_reduce((idx + 1) % args.accum == 0)
            x = batch[0]
            return self.gpt.loss(x[:, :-1], x[:, 1:])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Net()


def make_strategy(case: str, clock: CommClock, sync_every: int = 16, sync_delay: int = STREAMING["sync_delay"]):
    if case == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    if case.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2 * RANKS_PER_HOST, tensor_parallel_size=1,
                                     process_group_backend="gloo")
    from lightning_mics import MiCSStrategy

    if case in DILOCO:
        return MiCSStrategy(sharded_data_parallel_degree=RANKS_PER_HOST, ranks_per_node=RANKS_PER_HOST,
                            param_persistence_threshold=0, replica_sync="diloco", sync_every=sync_every,
                            quantize_gradients=case.endswith("_q8"),
                            **({**STREAMING, "sync_delay": sync_delay} if case in STREAMED else {}))
    if case.startswith("mics_host"):
        os, q8 = "_os" in case, case.endswith("_q8")
        return MiCSStrategy(sharded_data_parallel_degree=RANKS_PER_HOST, ranks_per_node=RANKS_PER_HOST,
                            param_persistence_threshold=0, quantize_gradients="error_feedback" if os and q8 else q8,
                            shard_optimizer_state=os)
    return MiCSStrategy(sharded_data_parallel_degree=2 * RANKS_PER_HOST, ranks_per_node=RANKS_PER_HOST,
                        hierarchical_allgather=True, param_persistence_threshold=0,
                        quantize_allgather=case.endswith("_q8"))


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from twohosts import ask_mark

    clock = CommClock(timeline=args.timeline)
    clock.install()
    case = args.case

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.ends: List[float] = []
            self.resumes: List[float] = []  # after the step-mark handshake ([Note: step marks] in twohosts.py)
            self.conn: Any = None
            self.comm: List[Dict[str, Any]] = []
            self.telemetry: List[Dict[str, float]] = []
            self.outer_steps: List[int] = []  # DiLoCo: the engine's outer syncs so far, at each step's end

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if case == "ddp":  # Lightning registers comm hooks on CUDA only
                trainer.strategy.model.register_comm_hook(clock, ddp_hook)
            clock.take()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == len(self.ends):
                return  # inside an accumulation window
            self.ends.append(time.time())
            clock.stamp("step", "", trainer.global_step)
            self.comm.append(clock.take())
            self.telemetry.append(dict(getattr(trainer.strategy, "comm_stats", {}) or {}))
            if case in DILOCO:
                self.outer_steps.append(trainer.strategy.engine.outer.outer_steps)
            if args.marks and trainer.global_step in (args.warmup, steps):  # [Note: step marks]
                dist.barrier()
                if dist.get_rank() == 0:
                    self.conn = ask_mark(args.marks, trainer.global_step, self.conn)
                dist.barrier()
            self.resumes.append(time.time())
            clock.stamp("resume", "", trainer.global_step)

    rank = int(os.environ["RANK"])
    steps = args.warmup + 1 + args.steps  # the step after the warm-up's counters is not timed ([Note: step marks])
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, args.vocab, (steps * args.accum * args.batch, args.seq + 1), generator=g)
    timer = StepClock()
    module = make_module(case, args)
    strategy = make_strategy(case, clock, args.sync_every, args.sync_delay)
    trainer = L.Trainer(accelerator="cpu", devices=RANKS_PER_HOST, num_nodes=2, max_steps=steps,
                        accumulate_grad_batches=args.accum, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[timer])
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=args.batch))
    out = dict(rank=trainer.global_rank, case=case, ends=timer.ends, resumes=timer.resumes, comm=timer.comm,
               telemetry=timer.telemetry, n_params=module.n_params, global_step=trainer.global_step,
               timeline=clock.timeline, outer_steps=timer.outer_steps, sync_every=args.sync_every,
               package=sys.modules[type(trainer.strategy).__module__].__file__ if case.startswith("mics") else None)
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def parser() -> argparse.ArgumentParser:
    """The model and run arguments (benchmarks/cluster.py takes the same and passes them on)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch (sequences) per rank")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run (benchmarks/cluster.py: "
                    "of the exact cases; a DiLoCo case times --windows x --sync-every)")
    ap.add_argument("--warmup", type=int, default=1, help="optimizer steps before the timed ones (>= 1)")
    ap.add_argument("--sync-every", type=int, default=16,
                    help="H of the DiLoCo cases: optimizer steps between outer syncs")
    ap.add_argument("--sync-delay", type=int, default=STREAMING["sync_delay"],
                    help="the streaming cases' sync_delay: inner steps a fragment's all-reduce is in flight")
    ap.add_argument("--timeline", action="store_true",
                    help="stamp every collective's issue, completion and wait in rank<k>.json (benchmarks/timeline.py)")
    return ap


if __name__ == "__main__":
    ap = argparse.ArgumentParser(parents=[parser()])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--accum", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--marks", default=None, help="Unix socket of benchmarks/cluster.py's step marks")
    run(ap.parse_args())
