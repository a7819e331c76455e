"""One rank of tests/engine/test_compile.py: ``torch.compile`` under MiCS against DDP compiled the same way.

    python compiled.py --out DIR --front fabric|trainer|trainer-blocks|trainer-inplace|trainer-titan
                       --strategy mics|ddp [--options JSON] [--precision P]
    python compiled.py --out DIR --cases JSON    # [{"front", "strategy", "options", "precision"}, ...]

``--cases``: the cases one after another in the same processes and process group (the suite's: starting a rank and
importing inductor's compiler cost more than a case's fit), rank 0 writing ``compiled<k>.pt`` for case k. Before
each case dynamo is reset (its caches and graph counters emptied: each case compiles its own graphs and counts only
them) and the warnings it raises are collected afresh (their "once per place" record cleared, the filters as set
before the case), as in a process of its own.

``fabric``: the whole model compiled before ``fabric.setup`` (litgpt's pretraining pattern); ``trainer``: the
LightningModule's network compiled in ``__init__`` (Lightning itself refuses ``trainer.fit(torch.compile(module))``
for every strategy outside its own list, DDP's and FSDP1's among them, so a compiled submodule is how a Trainer
user compiles under a sharded strategy, as with Lightning's ModelParallelStrategy); ``trainer-blocks``: each block
compiled on its own with ``fullgraph=True`` (torchtitan's pattern), ``trainer-inplace``: the same in place
(``block.compile(fullgraph=True)``: the parameter names stay the eager model's), ``trainer-titan``: torchtitan's
recipe, each block in torch's ``checkpoint_wrapper`` and then compiled whole (the checkpoint inside the graph).
AdamW, accumulation 2, clipping by norm, 4 optimizer steps. Rank 0 writes the final parameters and dynamo's graph
count after the first optimizer step and at the end: equal when swapping the gathered parameters in and out
recompiles nothing.
"""

import argparse
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from lightning_mics.fabric import MiCSStrategy as FabricMiCSStrategy  # noqa: E402
from tests.helpers.models import Net  # noqa: E402
from tests.helpers.trainer_cases import BATCH, Base, classification_data  # noqa: E402

STEPS, ACCUM = 4, 2


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class Probe:
    """What autograd keeps for backward of each forward (bytes packed by saved-tensor hooks outside any
    checkpoint segment: a segment's own hooks take what is inside it), and the blocks' calls that run inside
    backward (a checkpoint's replay), counted by a pre-hook dynamo does not trace."""

    def __init__(self, blocks):
        self.kept, self.replays = [], 0
        for block in blocks:
            block.register_forward_pre_hook(self._count)

    @torch.compiler.disable
    def _count(self, module, args):
        self.replays += torch._C._current_graph_task_id() != -1

    def keeping(self):
        self.kept.append(0)

        def pack(t):
            self.kept[-1] += t.numel() * t.element_size()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class Compiled(Base):
    def __init__(self, front):
        super().__init__()
        self.probe = Probe([] if front == "trainer-titan" else self.net.blocks)  # (its hook would break the graph)
        for i, block in enumerate(self.net.blocks):  # per block, whole graphs (fullgraph), as torchtitan does
            if front == "trainer-blocks":
                self.net.blocks[i] = torch.compile(block, fullgraph=True)
            elif front == "trainer-inplace":
                block.compile(fullgraph=True)
            elif front == "trainer-titan":  # torchtitan's recipe: torch's checkpoint wrapper, then compile
                self.net.blocks[i] = torch.compile(checkpoint_wrapper(block), fullgraph=True)
        if front == "trainer":
            self.net = torch.compile(self.net)

    def training_step(self, batch, batch_idx):
        with self.probe.keeping():  # the forward only: Lightning runs backward after this returns
            return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class FirstStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1 and not hasattr(self, "graphs"):
            self.graphs = graphs()


def mics_options(extra):
    return {"sharded_data_parallel_degree": 2, "param_persistence_threshold": 0, **extra}


def run_trainer(kind, world, rank, data, extra, precision, front):
    L.seed_everything(0, verbose=False)
    module = Compiled(front)
    strategy = MiCSStrategy(**mics_options(extra)) if kind == "mics" else "ddp"
    first = FirstStep()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, precision=precision,
                        accumulate_grad_batches=ACCUM, gradient_clip_val=0.5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[first])
    trainer.fit(module, DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, world, rank,
                                                                                        shuffle=False)))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, first.graphs, module.probe


def run_fabric(kind, world, rank, data, extra, precision, front):
    strategy = FabricMiCSStrategy(**mics_options(extra)) if kind == "mics" else "ddp"
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(0)
    net = Net()
    probe = Probe(net.blocks)
    model = fabric.setup(torch.compile(net))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, world, rank, shuffle=False))
    first = None
    for it, (idx, y) in enumerate(loader, start=1):
        accumulating = it % ACCUM != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            with probe.keeping():
                loss = F.cross_entropy(model(idx), y) / ACCUM
            fabric.backward(loss)
        if not accumulating:
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
            first = graphs() if first is None else first
    module = model.module  # the module as the user built it (Fabric compiled the one it runs)
    state = fabric.strategy.get_module_state_dict(module) if kind == "mics" else module.state_dict()
    return {n: t.detach().clone() for n, t in state.items()}, first, probe


FRONTS = ("fabric", "trainer", "trainer-blocks", "trainer-inplace", "trainer-titan")


def run_case(case, world, rank, data):
    """One case, as in a process of its own: dynamo reset, its warnings collected (UserWarning and subclasses
    listed in the result) and printed to the log."""
    torch._dynamo.reset()
    counters.clear()
    run = run_fabric if case["front"] == "fabric" else run_trainer
    with warnings.catch_warnings(record=True) as caught:  # entering it clears every "shown once" record
        params, first, probe = run(case["strategy"], world, rank, data, case.get("options", {}),
                                   case.get("precision", "32-true"), case["front"])
    for w in caught:
        sys.stderr.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    return {"params": params, "graphs_first_step": first, "graphs_end": graphs(), "kept": probe.kept,
            "replays": probe.replays,
            "user_warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                              if issubclass(w.category, UserWarning)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--front", choices=FRONTS)
    ap.add_argument("--strategy", choices=("mics", "ddp"))
    ap.add_argument("--options", default="{}", help="JSON of further MiCSStrategy options")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--cases", default="", help="JSON list of cases, one after another")
    args = ap.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    data = classification_data(STEPS * ACCUM * world * BATCH)
    if not args.cases:
        assert args.front and args.strategy, "--front and --strategy, or --cases"
        case = {"front": args.front, "strategy": args.strategy, "options": json.loads(args.options),
                "precision": args.precision}
        result = run_case(case, world, rank, data)
        if rank == 0:
            torch.save(result, Path(args.out) / "compiled.pt")
        (Path(args.out) / f"result{rank}.json").write_text("{}")
        return
    errors = []
    for k, case in enumerate(json.loads(args.cases)):
        print(f"=== case {k}: {json.dumps(case)}", flush=True)
        try:
            result = run_case(case, world, rank, data)
        except Exception:
            traceback.print_exc()
            result = {"error": traceback.format_exc()}
        errors.append(result.get("error"))
        if rank == 0:
            torch.save(result, Path(args.out) / f"compiled{k}.pt")
    (Path(args.out) / f"result{rank}.json").write_text(json.dumps({"errors": errors}))


if __name__ == "__main__":
    main()
