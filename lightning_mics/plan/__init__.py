"""The planner: which sharding degree s, and what it costs, before a job starts.

    python -m lightning_mics.plan --model gpt-neox-20b --instance p4d.24xlarge --nodes 2 --seq-len 2048 \\
        --micro-batch 4 --activation-checkpointing --png plan.png
    lightning_mics.plan("gpt-neox-20b", instance="p4d.24xlarge", nodes=2, micro_batch=4, ...) -> Plan

[Note: planner arithmetic]
Model state per GPU follows the engine's layout rules, imported rather than restated where they are code:
``sharding.stays_replicated`` (small parameters whole on every rank), ``placement.Rows`` (each sharded parameter
cut on dim 0 into ceil(d0/s)-row chunks, zero-padded), ``collectives.bucket_runs`` (gradient buckets), and
``precision.default_dtypes`` (gathered and reduction dtypes per precision). Per shard rank j:
  params     the unit's padded flat shard (masters, the parameters' dtype) + replicated parameters whole;
  grads      per unit with a trainable parameter, its padded accumulator (the reduction dtype; the gradients are
             views of it when the dtypes agree, else unpadded copies), + the replicated parameters' all-reduce
             buckets (fp32, with one flag per parameter);
  optimizer  k tensors of each trainable parameter's unpadded local rows (AdamW k=2, SGD+momentum 1, SGD 0).
Communication per optimizer step, in the telemetry's units (``comm/<op>/<group>/bytes``: the all-gather's output,
the reduce-scatter's input, the all-reduce's buffer), for A micro-batches and U non-root units: the root is
gathered once per step (kept for backward and across the accumulation window), each other unit twice per
micro-batch, except the last one of the forward (kept for backward); one reduce-scatter per unit bucket per
micro-batch; at the boundary one replica all-reduce per unit bucket and the replicated parameters' world
all-reduce. The gathered peak (elements) is the root plus min(U, 1 + prefetch) of the largest units, at most
``max_live_parameters`` plus the running unit ([Note: live cap] in schedule.py).
With ``shard_optimizer_state`` (s = 1): one root unit holds every parameter with its placement over all W
data-parallel ranks, so params, grads and optimizer state are those of s = W for that unit, plus its full
parameters (gathered dtype) kept on every rank; per step one reduce-scatter per bucket and one all-gather over the
W ranks at the boundary, whatever the accumulation, and the world all-reduce.
Links: a shard group inside a node uses the intra-node link; one across nodes the inter-node link (two hops:
the first hop across nodes, the second inside); replica and world all-reduces cross nodes when there are
several. Time is a ring model without overlap: (k-1)/k of the buffer per rank for all-gather and
reduce-scatter over k ranks, 2(k-1)/k for all-reduce, at the intra-node bandwidth per GPU or the node's
inter-node bandwidth shared by its GPUs.
Activations (transformer dims known) per GPU, Korthikanti et al. 2022 without sequence parallelism, scaled to
the activation dtype: per layer L b (10 h + (8 h + 4 f) / t) (plus 5 a L^2 b / t without flash attention);
checkpointing keeps each layer's input (L b h, two when offloaded) plus one layer being recomputed; the logits
add L b V / t (activation bytes + 8 for the fp32 loss and its gradient).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightning_mics.collectives import bucket_runs
from lightning_mics.config import MiCSConfig, parse_dtype
from lightning_mics.placement import Rows
from lightning_mics.plan.models import ModelSpec, ParamShape, UnitShapes, resolve
from lightning_mics.precision import default_dtypes
from lightning_mics.replicated import DDP_BUCKET_BYTES
from lightning_mics.sharding import stays_replicated
from lightning_mics.topology import plan_layout

GiB = 2 ** 30


@dataclass(frozen=True)
class Instance:
    gpus_per_node: int
    gpu_memory_gib: float
    intra_node_gbps: float  # GB/s per GPU, one direction
    inter_node_gbps: float  # GB/s per node, one direction


# Nominal figures (A100 NVLink 3: 300 GB/s per direction; 4x100 Gbps EFA = 50 GB/s; H100: 450 GB/s, 3200 Gbps).
INSTANCES: Dict[str, Instance] = {
    "p4d.24xlarge": Instance(8, 40, 300, 50),
    "p4de.24xlarge": Instance(8, 80, 300, 50),
    "p5.48xlarge": Instance(8, 80, 450, 400),
}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
LINKS = ("intra-node", "inter-node", "replica")


def _fail(option: str, value: Any, allowed: str) -> None:
    raise ValueError(f"plan option {option}={value!r} is invalid: allowed is {allowed}.")


def _nbytes(dtype: Any) -> int:
    return _BYTES[str(dtype).replace("torch.", "")]


@dataclass
class Settings:
    """Everything but the model; validated on construction (MiCSConfig checks the strategy's own options)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 50.0
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    seq_len: int = 2048
    micro_batch: int = 1
    accumulation: int = 1
    activation_checkpointing: bool = False
    activation_offload: bool = False
    flash_attention: bool = True
    prefetch: int = 1
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 1_000_000
    reduce_bucket_size: int = 500_000_000
    hierarchical_allgather: bool = True
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    tensor_parallel_degree: int = 1
    shard_optimizer_state: bool = False  # ZeRO-1: s = 1, optimizer state over all W ([Note: planner arithmetic])
    headroom: float = 0.10

    def __post_init__(self) -> None:
        MiCSConfig(prefetch=self.prefetch, max_live_parameters=self.max_live_parameters,
                   param_persistence_threshold=self.param_persistence_threshold,
                   reduce_bucket_size=self.reduce_bucket_size, param_dtype=self.param_dtype,
                   reduce_dtype=self.reduce_dtype, shard_optimizer_state=self.shard_optimizer_state)
        if self.shard_optimizer_state and self.tensor_parallel_degree > 1:
            _fail("shard_optimizer_state", True, "False with tensor_parallel_degree > 1")
        for name in ("nodes", "gpus_per_node", "seq_len", "micro_batch", "accumulation", "tensor_parallel_degree"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(name, v, "an integer >= 1")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                _fail(name, v, "a positive number")
        if self.precision not in PRECISIONS:
            _fail("precision", self.precision, " | ".join(PRECISIONS))
        if self.optimizer not in OPTIMIZER_STATES:
            _fail("optimizer", self.optimizer, " | ".join(OPTIMIZER_STATES))
        if self.gpus_per_node % self.tensor_parallel_degree:
            _fail("tensor_parallel_degree", self.tensor_parallel_degree,
                  f"a divisor of gpus_per_node={self.gpus_per_node} (a tensor-parallel group stays in one node)")
        if not 0 <= self.headroom < 1:
            _fail("headroom", self.headroom, "a fraction in [0, 1)")
        if self.activation_offload and not self.activation_checkpointing:
            _fail("activation_offload", True, "True only together with activation_checkpointing")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp_world(self) -> int:
        return self.world // self.tensor_parallel_degree

    @property
    def dp_per_node(self) -> int:
        return self.gpus_per_node // self.tensor_parallel_degree

    def dtypes(self) -> Tuple[int, int, int]:
        """(master, gathered, reduction) bytes per element."""
        param_default, reduce_default = default_dtypes(self.precision)
        master = 2 if self.precision in ("bf16-true", "16-true") else 4
        gathered = parse_dtype("param_dtype", self.param_dtype) or param_default
        reduce = parse_dtype("reduce_dtype", self.reduce_dtype) or reduce_default
        return master, (_nbytes(gathered) if gathered is not None else master), _nbytes(reduce)


@dataclass
class Estimate:
    """One layout (s, t): bytes per GPU, communication per optimizer step, whether it fits."""

    s: int
    t: int
    r: int
    model_state: Dict[str, int]  # params, grads, optimizer, total (shard rank 0: the largest)
    activations: Optional[int]
    gathered_elements: int  # peak of gathered parameter elements (telemetry's mem/gathered_elements_peak)
    gathered: int  # bytes of those
    buffers: int  # transient: the largest unit's all-gather output and reduce-scatter input (if not in place)
    comm: Dict[str, Dict[str, int]]  # "<op>/<group>" -> {"bytes", "calls"} per optimizer step (telemetry's keys)
    link_bytes: Dict[str, int]  # intra-node / inter-node / replica
    comm_seconds: float
    budget: int

    @property
    def total(self) -> int:
        return self.model_state["total"] + (self.activations or 0) + self.gathered + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


@dataclass
class Plan:
    model: ModelSpec
    settings: Settings
    estimates: List[Estimate]
    recommended: Optional[Estimate]
    notes: List[str] = field(default_factory=list)

    def estimate(self, s: int) -> Estimate:
        for e in self.estimates:
            if e.s == s:
                return e
        _fail("s", s, f"one of {[e.s for e in self.estimates]}")
        raise AssertionError

    def unit(self) -> Tuple[str, int]:
        """The size unit that suits this plan's figures: GiB, MiB or KiB."""
        top = max(e.total for e in self.estimates)
        return next((u for u in (("GiB", GiB), ("MiB", 2 ** 20)) if top >= u[1]), ("KiB", 2 ** 10))

    def table(self) -> str:
        name, div = self.unit()
        comm_name, comm_div = ("GB", 1e9) if name == "GiB" else ("MB", 1e6)
        head = (f"| s | t | r | model state {name} | activations {name} | gathered {name} | buffers {name} | "
                f"total {name} | intra-node {comm_name}/step | inter-node {comm_name}/step | "
                f"replica {comm_name}/step | comm s/step | fits |")
        lines = [head, "|" + "---|" * (head.count("|") - 1)]
        for e in self.estimates:
            act = f"{e.activations / div:.2f}" if e.activations is not None else "n/a"
            mark = "yes" if e.fits else "no"
            if e is self.recommended:
                mark = "**yes: recommended**"
            lines.append(f"| {e.s} | {e.t} | {e.r} | {e.model_state['total'] / div:.2f} | {act} | "
                         f"{e.gathered / div:.2f} | {e.buffers / div:.2f} | {e.total / div:.2f} | "
                         + " | ".join(f"{e.link_bytes[k] / comm_div:.3f}" for k in LINKS)
                         + f" | {e.comm_seconds:.3g} | {mark} |")
        return "\n".join(lines)

    def explain(self) -> str:
        st, m = self.settings, self.model
        name, div = self.unit()
        size = lambda n: f"{n / div:.3g} {name}"  # noqa: E731
        parts = lambda e: (f"model state {size(e.model_state['total'])} + " + (  # noqa: E731
            f"activations {size(e.activations)}" if e.activations is not None else "activations not estimated")
            + f" + gathered parameters and buffers {size(e.gathered + e.buffers)}")
        budget = self.estimates[0].budget
        count = f"{m.n_params / 1e9:.3g}B" if m.n_params >= 1e9 else f"{m.n_params / 1e6:.3g}M"
        out = [f"{m.name}: {count} parameters ({m.source}); {st.nodes} node(s) x {st.gpus_per_node} "
               f"GPUs of {st.gpu_memory_gib:g} GiB, t={st.tensor_parallel_degree}, {st.precision}, {st.optimizer}, "
               f"sequence {st.seq_len}, micro-batch {st.micro_batch}, accumulation {st.accumulation}, "
               f"activation checkpointing {'on' if st.activation_checkpointing else 'off'}"
               f"{' with offload' if st.activation_offload else ''}; budget {budget / GiB:.3g} GiB per GPU "
               f"({st.headroom:.0%} headroom)."]
        rec = self.recommended
        if rec is None:
            best = min(self.estimates, key=lambda e: e.total)
            out.append(f"No s fits: the least memory is s={best.s} with {size(best.total)} per GPU "
                       f"({parts(best)}). Use more GPUs, tensor parallelism, activation checkpointing (and offload) "
                       "or a smaller micro-batch.")
        else:
            out.append(f"Recommended s={rec.s} (r={rec.r} replicas): {size(rec.total)} per GPU ({parts(rec)}), "
                       f"{size(budget - rec.total)} under the budget.")
            smaller = [e for e in self.estimates if e.s < rec.s]
            if smaller:
                e = smaller[-1]
                out.append(f"s={e.s} does not fit: {size(e.total)} ({parts(e)}).")
            lb = rec.link_bytes
            traffic = (f"Per optimizer step and GPU: {lb['intra-node'] / 1e9:.3g} GB intra-node, "
                       f"{lb['inter-node'] / 1e9:.3g} GB inter-node, {lb['replica'] / 1e9:.3g} GB across replicas; "
                       f"{rec.comm_seconds:.3g} s predicted without overlap.")
            if rec.s == 1:
                out.append("At s=1 every GPU holds the whole model state (plain data parallelism): no per-layer "
                           "collectives, one gradient all-reduce per optimizer step. " + traffic)
            else:
                if rec.s <= st.dp_per_node:
                    where = "inside one node, on the intra-node links"
                else:
                    hops = " (two hops: the first across nodes, the second inside)" \
                        if st.hierarchical_allgather else ""
                    where = f"across {math.ceil(rec.s / st.dp_per_node)} nodes{hops}"
                out.append(f"A larger s shards further but puts more ranks into every per-layer all-gather and "
                           f"reduce-scatter and leaves fewer replicas. At s={rec.s} those stay {where}; replicas "
                           f"meet once per optimizer step (the all-reduce at the accumulation boundary). " + traffic)
        out += self.notes + m.notes
        return "\n".join(out)

    def __str__(self) -> str:
        return self.explain() + "\n\n" + self.table()

    def plot(self, path: str) -> None:
        """A PNG: memory per GPU against s, stacked by kind, with the GPU's memory and the budget."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        es = self.estimates
        xs = list(range(len(es)))
        parts = [("model state", [e.model_state["total"] for e in es]),
                 ("activations", [e.activations or 0 for e in es]),
                 ("gathered params + buffers", [e.gathered + e.buffers for e in es])]
        fig, ax = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(es)
        for label, vals in parts:
            ax.bar(xs, [v / GiB for v in vals], bottom=bottom, label=label)
            bottom = [b + v / GiB for b, v in zip(bottom, vals)]
        ax.axhline(self.settings.gpu_memory_gib, color="k", lw=1, label="GPU memory")
        ax.axhline(es[0].budget / GiB, color="r", lw=1, ls="--", label="budget (headroom)")
        ax.set_xticks(xs, [f"s={e.s}" + (" *" if e is self.recommended else "") for e in es])
        ax.set_ylabel("GiB per GPU")
        mem = self.settings.gpu_memory_gib
        top = max(1.5 * mem, min(max(bottom), 3 * mem)) * 1.05  # bars far above the GPU are cut, labelled
        ax.set_ylim(0, top)
        for x, total in zip(xs, bottom):
            ax.text(x, min(total, top * 0.93), f"{total:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{self.model.name}: memory per GPU vs sharding degree (* recommended)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


# -- arithmetic ([Note: planner arithmetic]) -----------------------------------------------------------------

@dataclass
class _Unit:
    sharded: List[ParamShape]
    replicated: List[ParamShape]
    padded: List[int]  # padded elements per sharded parameter (one rank's chunk)
    local: List[int]  # unpadded elements on shard rank j

    @property
    def shard_numel(self) -> int:
        return sum(self.padded)

    @property
    def full_numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.sharded)


def _layout_units(units: List[UnitShapes], st: Settings, s: int) -> Tuple[List[UnitShapes], int]:
    """The units and shard-group size the engine uses for degree s: with shard_optimizer_state (s = 1), one root
    unit holding every parameter, its placement over all W data-parallel ranks."""
    if not st.shard_optimizer_state:
        return units, s
    if s != 1:
        _fail("sharded_data_parallel_degree", s, "1 with shard_optimizer_state=True")
    return [UnitShapes("", [p for u in units for p in u.params])], st.dp_world


def _split(units: List[UnitShapes], st: Settings, s: int, rank: int) -> List[_Unit]:
    units, s = _layout_units(units, st, s)
    t = st.tensor_parallel_degree
    out = []
    for u in units:
        sharded, replicated, padded, local = [], [], [], []
        for p in u.params:
            shape = p.shape
            replicate = stays_replicated(shape, st.param_persistence_threshold, s)  # the global shape, as the engine
            if p.tp and t > 1 and shape:
                d = p.tp_dim
                shape = shape[:d] + (math.ceil(shape[d] / t),) + tuple(shape[d + 1:])
            p = ParamShape(shape, p.trainable)
            if replicate:
                replicated.append(p)
                continue
            rows = Rows(shape[0], math.prod(shape[1:]), s, rank)
            sharded.append(p)
            padded.append(rows.padded_numel)
            local.append(rows.local_rows * rows.rest)
        out.append(_Unit(sharded, replicated, padded, local))
    return out


def _world_buckets(units: List[_Unit], st: Settings) -> List[int]:
    """Elements of each replicated all-reduce bucket, flags included ([Note: replicated gradients])."""
    trainable = [math.prod(p.shape) for u in units for p in u.replicated if p.trainable][::-1]
    cap = max(1, min(st.reduce_bucket_size, DDP_BUCKET_BYTES // 4))
    runs = bucket_runs(trainable, cap) or [[]]
    sizes = [sum(trainable[i] for i in run) + len(run) for run in runs]
    sizes[-1] += sum(1 for u in units for p in u.sharded if p.trainable)  # the sharded parameters' flags
    return sizes


def _unit_buckets(u: _Unit, st: Settings) -> List[int]:
    """Padded shard elements of each of a unit's gradient buckets (its trainable parameters)."""
    slots = [i for i, p in enumerate(u.sharded) if p.trainable]
    runs = bucket_runs([math.prod(u.sharded[i].shape) for i in slots], st.reduce_bucket_size)
    return [sum(u.padded[slots[k]] for k in run) for run in runs] if slots else []


def model_state_bytes(spec: ModelSpec, st: Settings, s: int, rank: int = 0) -> Dict[str, int]:
    """What ``MiCSStrategy.model_state_bytes()`` reports on shard rank ``rank`` after a step."""
    master, _, reduce = st.dtypes()
    k = OPTIMIZER_STATES[st.optimizer]
    units = _split(spec.units, st, s, rank)
    params = grads = opt = 0
    for u in units:
        params += u.shard_numel * master + sum(math.prod(p.shape) for p in u.replicated) * master
        trainable = [i for i, p in enumerate(u.sharded) if p.trainable]
        if trainable:
            grads += u.shard_numel * reduce if reduce == master else sum(u.local[i] for i in trainable) * master
        opt += k * master * (sum(u.local[i] for i in trainable)
                             + sum(math.prod(p.shape) for p in u.replicated if p.trainable))
    if any(p.trainable for u in units for p in u.replicated):
        buckets = _world_buckets(units, st)
        grads += sum(buckets) * 4 if master == 4 else \
            sum(math.prod(p.shape) for u in units for p in u.replicated if p.trainable) * master
    if st.shard_optimizer_state:  # the pinned root: its full parameters (gathered dtype) stay on every rank
        params += units[0].full_numel * st.dtypes()[1]
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def comm_per_step(spec: ModelSpec, st: Settings, s: int) -> Dict[str, Dict[str, int]]:
    """Bytes and calls per collective and group per optimizer step, as the telemetry records them."""
    _, gathered, reduce = st.dtypes()
    units = _split(spec.units, st, s, 0)
    s = _layout_units(spec.units, st, s)[1]
    layout = plan_layout(st.dp_world, s, st.dp_per_node if st.dp_world > st.dp_per_node else None)
    two_hop = st.hierarchical_allgather and layout.hierarchical_possible
    A, r, W = st.accumulation, layout.replicas, st.dp_world
    out: Dict[str, Dict[str, int]] = {}

    def add(key: str, nbytes: int, calls: int = 1) -> None:
        if calls:
            entry = out.setdefault(key, {"bytes": 0, "calls": 0})
            entry["bytes"] += nbytes * calls
            entry["calls"] += calls

    if st.shard_optimizer_state:  # [Note: optimizer-state-only sharding] in runtime.py
        root = units[0]
        if root.sharded and W > 1:
            for b in _unit_buckets(root, st):
                add("reduce_scatter/shard", W * b * reduce)  # once, at the boundary
            add("all_gather/shard", W * root.shard_numel * gathered)  # the post-step refresh
        if W > 1:
            for b in _world_buckets(units, st):
                add("all_reduce/world", b * 4)
        return out

    root, others = units[0], [u for u in units[1:] if u.sharded]
    keep = root.full_numel + 2 * max((u.full_numel for u in others), default=0) <= st.max_live_parameters
    for i, u in enumerate([root] + others):
        if not u.sharded:
            continue
        if i == 0:
            n_gathers = 1 if keep else 2 * A
        else:
            n_gathers = A if (keep and u is others[-1]) else 2 * A
        if two_hop:
            n = s // layout.ranks_per_node
            add("all_gather/inter", n * u.shard_numel * gathered, n_gathers)
            add("all_gather/intra", s * u.shard_numel * gathered, n_gathers)
        else:
            add("all_gather/shard", s * u.shard_numel * gathered, n_gathers)
        for b in _unit_buckets(u, st):
            add("reduce_scatter/shard", s * b * reduce, A)
            if r > 1:
                add("all_reduce/replicate", b * reduce)
    if W > 1:
        for b in _world_buckets(units, st):
            add("all_reduce/world", b * 4)
    return out


def _gathered_peak(units: List[_Unit], st: Settings) -> int:
    root, sizes = units[0].full_numel, sorted((u.full_numel for u in units[1:] if u.sharded), reverse=True)
    ahead = sum(sizes[:1 + st.prefetch])
    largest = max([root] + sizes)
    return min(root + ahead, st.max_live_parameters + largest)


def _link_of(key: str, st: Settings, s: int) -> str:
    op, group = key.split("/")
    if group in ("replicate", "world"):
        return "replica"
    if group == "inter":
        return "inter-node"
    if group == "intra":
        return "intra-node"
    return "intra-node" if s <= st.dp_per_node else "inter-node"


def _seconds(comm: Dict[str, Dict[str, int]], st: Settings, s: int) -> float:
    layout = plan_layout(st.dp_world, s, st.dp_per_node if st.dp_world > st.dp_per_node else None)
    inter_per_gpu = st.inter_node_gbps * 1e9 / st.gpus_per_node
    total = 0.0
    for key, e in comm.items():
        op, group = key.split("/")
        k = {"shard": s, "inter": s // max(layout.ranks_per_node, 1), "intra": layout.ranks_per_node,
             "replicate": layout.replicas, "world": st.dp_world}[group]
        factor = (2 if op == "all_reduce" else 1) * (k - 1) / k
        cross = _link_of(key, st, s) == "inter-node" or (group in ("replicate", "world") and st.nodes > 1)
        total += factor * e["bytes"] / (inter_per_gpu if cross else st.intra_node_gbps * 1e9)
    return total


def activation_bytes(spec: ModelSpec, st: Settings) -> Optional[int]:
    d = spec.dims
    if d is None:
        return None
    e = 4 if st.precision == "32-true" else 2
    L, b, h, t = st.seq_len, st.micro_batch, d.hidden, st.tensor_parallel_degree
    f = d.ffn * (1.5 if d.gated else 1)  # a SwiGLU MLP keeps two f-wide outputs and their product
    layer = L * b * (10 * h + (8 * h + 4 * f) / t) * e / 2
    if not st.flash_attention:
        layer += 5 * d.n_head * L * L * b / t * e / 2
    if st.activation_checkpointing:
        kept = (2 if st.activation_offload else d.n_layer) * L * b * h * e
        body = kept + layer
    else:
        body = d.n_layer * layer
    logits = L * b * d.vocab / t * (e + 8)
    return int(body + logits)


def estimate(spec: ModelSpec, st: Settings, s: int) -> Estimate:
    _, gathered, reduce = st.dtypes()
    units = _split(spec.units, st, s, 0)
    state = model_state_bytes(spec, st, s)
    comm = comm_per_step(spec, st, s)
    peak = _gathered_peak(units, st)
    largest = max(units, key=lambda u: u.shard_numel)
    group = _layout_units(spec.units, st, s)[1]  # the shard group's size (all W ranks with shard_optimizer_state)
    # the reduce-scatter input lies in the unit's own storage when it fits and the unit is released after it
    # ([Note: staging in place] in runtime.py); the root inside an accumulation window, or pinned, stages apart
    in_place = reduce <= gathered and not (largest is units[0] and (st.accumulation > 1 or st.shard_optimizer_state))
    buffers = group * largest.shard_numel * (gathered + (0 if in_place else reduce)) if group > 1 else 0
    links = {k: 0 for k in LINKS}
    for key, e in comm.items():
        links[_link_of(key, st, group)] += e["bytes"]
    budget = int(st.gpu_memory_gib * GiB * (1 - st.headroom))
    held = 0 if st.shard_optimizer_state else peak * gathered  # pinned parameters are model state already
    return Estimate(s, st.tensor_parallel_degree, st.dp_world // s, state, activation_bytes(spec, st), peak,
                    held, buffers, comm, links, _seconds(comm, st, group), budget)


def plan(model: Any, *, instance: Optional[str] = None, degrees: Optional[Sequence[int]] = None,
         shard_units: Optional[List[Any]] = None, **settings: Any) -> Plan:
    """Plans every valid sharding degree s (divisors of the data-parallel world) and recommends the smallest that
    fits with headroom. ``model``: see :mod:`lightning_mics.plan.models`; ``instance``: a key of
    :data:`INSTANCES` (sets GPUs per node, memory and bandwidths unless given); other keywords: :class:`Settings`."""
    if instance is not None:
        if instance not in INSTANCES:
            _fail("instance", instance, " | ".join(INSTANCES))
        preset = INSTANCES[instance].__dict__
        settings = {**preset, **settings}
    unknown = set(settings) - set(Settings.__dataclass_fields__)
    if unknown:
        _fail(sorted(unknown)[0], settings[sorted(unknown)[0]], f"a keyword of {sorted(Settings.__dataclass_fields__)}")
    st = Settings(**settings)
    spec = resolve(model, shard_units)
    valid = [d for d in range(1, st.dp_world + 1) if st.dp_world % d == 0]
    if st.shard_optimizer_state:  # [Note: optimizer-state-only sharding]: the layout is fixed
        valid = [1]
    if degrees is not None:
        bad = [d for d in degrees if d not in valid]
        if bad:
            _fail("degrees", list(degrees), f"divisors of the data-parallel world size {st.dp_world}: {valid}"
                  if not st.shard_optimizer_state else "[1] with shard_optimizer_state=True")
        valid = sorted(degrees)
    estimates = [estimate(spec, st, s) for s in valid]
    recommended = next((e for e in estimates if e.fits), None)
    notes = []
    if st.tensor_parallel_degree > 1 and not any(p.tp for u in spec.units for p in u.params):
        notes.append(f"t={st.tensor_parallel_degree}, but no parameter of this model is marked tensor-parallel: "
                     "plan a module after parallelizing it (its DTensor parameters) or a transformer layout.")
    elif st.tensor_parallel_degree > 1:
        notes.append(f"t={st.tensor_parallel_degree}: the tensor-parallel parts are those of "
                     + ("the module's own plan." if spec.source.startswith("nn.Module") else
                        "a Megatron-style plan (attention and MLP column- then row-parallel, embeddings and head "
                        "split on the vocabulary, norms whole)."))
    return Plan(spec, st, estimates, recommended, notes)


# -- command line ------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_mics.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="reference name (gpt-neox-20b, gpt-neox-65b, gpt2, llama-2-7b), "
                    "'gpt' or 'gpt:n_layer=8,n_embd=256' (the app's GPT), a count (20e9, 1.3B) or a config.json")
    ap.add_argument("--instance", choices=sorted(INSTANCES), help="sets the next four unless given")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--gpu-memory-gib", type=float)
    ap.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU inside a node")
    ap.add_argument("--inter-node-gbps", type=float, help="GB/s per node across nodes")
    ap.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--activation-offload", action="store_true")
    ap.add_argument("--no-flash-attention", dest="flash_attention", action="store_false")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--max-live-parameters", type=float, default=1e9)
    ap.add_argument("--param-persistence-threshold", type=float, default=1e6)
    ap.add_argument("--tensor-parallel", dest="tensor_parallel_degree", type=int, default=1)
    ap.add_argument("--shard-optimizer-state", action="store_true",
                    help="SageMaker's optimizer state sharding (ZeRO-1): s = 1, optimizer state over all ranks")
    ap.add_argument("--headroom", type=float, default=0.10)
    ap.add_argument("--png", help="write the chart of memory per GPU against s here")
    args = vars(ap.parse_args(argv))
    model, instance, png = args.pop("model"), args.pop("instance"), args.pop("png")
    for k in ("max_live_parameters", "param_persistence_threshold"):
        args[k] = int(args[k])
    settings = {k: v for k, v in args.items() if v is not None}
    try:
        result = plan(model, instance=instance, **settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result)
    if png:
        result.plot(png)
        print(f"\nchart: {png}")
    return 0

