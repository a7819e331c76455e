"""The planner's arithmetic: bytes per GPU and communication per optimizer step for one layout.

[Note: planner arithmetic]
Model state per GPU follows the engine's layout rules, imported rather than restated where they are code:
``sharding.stays_replicated`` (small parameters whole on every rank), ``placement.Rows`` (each sharded parameter
cut on dim 0 into ceil(d0/s)-row chunks, zero-padded), ``collectives.bucket_runs`` (gradient buckets), and
``options.default_dtypes`` (gathered and reduction dtypes per precision). Per shard rank j:
  params     the unit's padded flat shard (masters, the parameters' dtype) + replicated parameters whole;
  grads      per unit with a trainable parameter, its padded accumulator (the reduction dtype; the gradients are
             views of it when the dtypes agree, else unpadded copies), + the replicated parameters' all-reduce
             buckets (fp32, with one flag per parameter);
  optimizer  k tensors of each trainable parameter's unpadded local rows (AdamW k=2, SGD+momentum 1, SGD 0).

[Note: planner communication]
Communication per optimizer step, in the telemetry's units (``comm/<op>/<group>/bytes``: the all-gather's output,
the reduce-scatter's input, the all-reduce's buffer), for A micro-batches and U non-root units: the root is
gathered once per step (kept for backward and across the accumulation window), each other unit twice per
micro-batch, except the last one of the forward (kept for backward); one reduce-scatter per unit bucket per
micro-batch; at the boundary one replica all-reduce per unit bucket and the replicated parameters' world
all-reduce. The gathered peak (elements) is the root plus min(U, 1 + prefetch) of the largest units, at most
``max_live_parameters`` plus the running unit ([Note: live cap] in schedule.py).

[Note: planner with optimizer-state sharding]
With ``shard_optimizer_state`` and s = 1 ([Note: optimizer-state-only sharding] in gradients.py) one root unit
holds every parameter with its placement over all W data-parallel ranks, so params, grads and optimizer state are
those of s = W for that unit, plus its full parameters (gathered dtype) kept on every rank; per step one
reduce-scatter per bucket and one all-gather over the W ranks at the boundary, whatever the accumulation, and the
world all-reduce.
With ``shard_optimizer_state`` and s > 1 ([Note: optimizer rows over replicas] in optimizer_rows.py) the units
are MiCS's, but each replica steps ceil(n / r) of its chunk's n rows: optimizer state and the gradients it sees
are those rows; the replica all-reduce is one reduce-scatter per unit (the reduction dtype) and one all-gather
per unit after the step (the master dtype), each of r x the rows' slots; each unit keeps a copy of this replica's
row (the master dtype, counted with params), and each of the window's forwards after its first all-reduces a
4-byte flag per unit over the replica group ([Note: rows between steps] in optimizer_rows.py).

[Note: planner DiLoCo]
With ``replica_sync="diloco"`` ([Note: DiLoCo across replica groups] in options.py) an inner step has no replica
traffic: the unit buckets' replica all-reduce is gone and the replicated parameters' all-reduce runs on the shard
group. Every ``sync_every`` steps one all-reduce on the replica group carries each rank's masters' pseudo-gradient
(its flat shards and replicated parameters, fp32, or int8 blocks with ``quantize_gradients``); the replica link's
bytes and the step's seconds are the window's mean. With ``sync_fragments`` F one fragment's all-reduce runs every H / F
steps ([Note: streaming fragments] in engine/fragments.py, the engine's cut of the units): one sync is the largest
fragment's, the window's mean the same as F = 1's. The anchors (fp32) and the outer momentum count as optimizer
state. A degree with one replica group is not planned.

[Note: planner quantized traffic]
With ``quantize_gradients`` ([Note: quantized traffic] in options.py) each replica all-reduce moves the int8 wire
of its bucket, ``quantized.wire_bytes`` = b (1 + 4/B) bytes up to padding, in place of b times the reduction dtype
(x (1 + 4/B)/4 against fp32), in the same ring time (an all-to-all and an all-gather of it); with
``"error_feedback"`` each rank keeps, per bucket, its residual (b elements) and its reduced chunk's (b / r), in the
reduction dtype, counted as gradients. With ``quantize_allgather`` and two hops the inter hop's output is n int8
rows of the shard, ``wire_bytes(S, 1, B)`` each. The replicated parameters' world all-reduce stays fp32.
With ``shard_optimizer_state`` (s > 1) the optimizer rows' reduce-scatter moves the int8 wire of the unit's r
rows, and with ``"error_feedback"`` their all-gather the int8 deltas, r rows of ``wire_bytes(row, 1, B)``; the
residuals are then r x row elements in the reduction dtype and a row in the master dtype per unit
([Note: quantized optimizer rows] in optimizer_rows.py).

[Note: planner time]
Links: a shard group inside a node uses the intra-node link; one across nodes the inter-node link (two hops:
the first hop across nodes, the second inside); replica and world all-reduces cross nodes when there are
several. Time is a ring model without overlap: (k-1)/k of the buffer per rank for all-gather and
reduce-scatter over k ranks, 2(k-1)/k for all-reduce, at the intra-node bandwidth per GPU or the node's
inter-node bandwidth shared by its GPUs.

[Note: planner activations]
Activations (transformer dims known) per GPU, Korthikanti et al. 2022 without sequence parallelism, scaled to
the activation dtype: per layer L b (10 h + (8 h + 4 f) / t) (plus 5 a L^2 b / t without flash attention);
checkpointing keeps each layer's input (L b h, two when offloaded) plus one layer being recomputed; the logits
add L b V / t (activation bytes + 8 for the fp32 loss and its gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_mics.comm.collectives import bucket_runs
from lightning_mics.layout.placement import Rows
from lightning_mics.plan.models import ModelSpec, ParamShape, UnitShapes
from lightning_mics.plan.settings import GiB, OPTIMIZER_STATES, Settings, _fail
from lightning_mics.comm.quantized import chunk_numel, feedback_numel, wire_bytes
from lightning_mics.engine.fragments import split_units
from lightning_mics.engine.replicated import DDP_BUCKET_BYTES
from lightning_mics.layout.sharding import stays_replicated
from lightning_mics.layout.topology import plan_layout

LINKS = ("intra-node", "inter-node", "replica")


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
    comm_seconds: float  # per optimizer step; with DiLoCo the mean over a window, its outer sync included
    budget: int
    outer_sync: Dict[str, Dict[str, int]] = field(default_factory=dict)  # DiLoCo: one outer sync's collectives

    @property
    def total(self) -> int:
        return self.model_state["total"] + (self.activations or 0) + self.gathered + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


@dataclass
class _Unit:
    sharded: List[ParamShape]
    replicated: List[ParamShape]
    padded: List[int]  # padded elements per sharded parameter (one rank's chunk)
    local: List[int]  # unpadded elements on shard rank j that the optimizer steps
    slots: List[int]  # padded elements per parameter in one replica's part ([Note: optimizer rows over replicas])

    @property
    def shard_numel(self) -> int:
        return sum(self.padded)

    @property
    def full_numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.sharded)


def _layout_units(units: List[UnitShapes], st: Settings, s: int) -> Tuple[List[UnitShapes], int]:
    """The units and shard-group size the engine uses for degree s: with shard_optimizer_state (s = 1), one root
    unit holding every parameter, its placement over all W data-parallel ranks."""
    if not _zero1(st, s):
        return units, s
    return [UnitShapes("", [p for u in units for p in u.params])], st.dp_world


def _zero1(st: Settings, s: int) -> bool:
    """[Note: optimizer-state-only sharding]; with s > 1 [Note: optimizer rows over replicas] instead."""
    return st.shard_optimizer_state and s == 1


def _over_replicas(st: Settings, s: int) -> int:
    """The replicas each unit's optimizer rows are cut over (1: not cut)."""
    return st.dp_world // s if st.shard_optimizer_state and s > 1 else 1


def _split(units: List[UnitShapes], st: Settings, s: int, rank: int, replica: int = 0) -> List[_Unit]:
    reps = _over_replicas(st, s)
    units, s = _layout_units(units, st, s)
    t = st.tensor_parallel_degree
    out = []
    for u in units:
        sharded, replicated, padded, local, slots = [], [], [], [], []
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
            rows = Rows(shape[0], math.prod(shape[1:]), s, rank, reps, replica if reps > 1 else 0)
            sharded.append(p)
            padded.append(rows.padded_numel)
            local.append((rows.sub_hi - rows.sub_lo) * rows.rest)  # the optimizer's rows
            slots.append(rows.sub_chunk * rows.rest)
        out.append(_Unit(sharded, replicated, padded, local, slots))
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


def model_state_bytes(spec: ModelSpec, st: Settings, s: int, rank: int = 0, replica: int = 0) -> Dict[str, int]:
    """What ``MiCSStrategy.model_state_bytes()`` reports on shard rank ``rank`` (of replica ``replica``) after a
    step."""
    master, _, reduce = st.dtypes()
    k = OPTIMIZER_STATES[st.optimizer]
    units = _split(spec.units, st, s, rank, replica)
    params = grads = opt = 0
    for u in units:
        params += u.shard_numel * master + sum(math.prod(p.shape) for p in u.replicated) * master
        if _over_replicas(st, s) > 1 and u.sharded:  # [Note: rows between steps]: this replica's rows, a copy
            params += _row(u) * master
        trainable = [i for i, p in enumerate(u.sharded) if p.trainable]
        if trainable and _over_replicas(st, s) > 1:  # the reduce-scatter's output is the gradients
            grads += sum(u.slots) * reduce if reduce == master else sum(u.local[i] for i in trainable) * master
        elif trainable:
            grads += u.shard_numel * reduce if reduce == master else sum(u.local[i] for i in trainable) * master
        opt += k * master * (sum(u.local[i] for i in trainable)
                             + sum(math.prod(p.shape) for p in u.replicated if p.trainable))
    grads += _feedback_bytes(units, st, s, reduce)
    if any(p.trainable for u in units for p in u.replicated):
        buckets = _world_buckets(units, st)
        grads += sum(buckets) * 4 if master == 4 else \
            sum(math.prod(p.shape) for u in units for p in u.replicated if p.trainable) * master
    if st.replica_sync == "diloco":  # [Note: planner DiLoCo]: the anchors, and the outer momentum once it steps
        opt += _outer_numel(units) * 4 * (2 if st.outer_momentum > 0 else 1)
    if _zero1(st, s):  # the pinned root: its full parameters (gathered dtype) stay on every rank, and a copy of the
        # masters they were filled from ([Note: masters moved outside a step] in user_code/write_back.py)
        params += units[0].full_numel * st.dtypes()[1] + units[0].shard_numel * master
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _feedback_bytes(units: List[_Unit], st: Settings, s: int, reduce: int) -> int:
    """Error-feedback residuals ([Note: error feedback] in quantized.py): per replica bucket, b + its chunk."""
    r = st.dp_world // s
    if st.quantize_gradients != "error_feedback" or r == 1:
        return 0
    if _over_replicas(st, s) > 1:  # [Note: quantized optimizer rows]: the contribution and the delta, per unit
        master = st.dtypes()[0]
        return sum(r * _row(u) * reduce + _row(u) * master for u in units if u.sharded)
    return reduce * sum(feedback_numel(b, r, st.quantization_block_size)
                        for u in units if u.sharded for b in _unit_buckets(u, st))


def _row(u: _Unit) -> int:
    """One replica's row of a unit's optimizer rows, padded to a quantized chunk
    ([Note: quantized optimizer rows] in optimizer_rows.py)."""
    return chunk_numel(sum(u.slots))


def _replica_bytes(b: int, r: int, reduce: int, st: Settings) -> int:
    """One replica all-reduce of a b-element bucket, in the telemetry's units."""
    return wire_bytes(b, r, st.quantization_block_size) if st.quantize_gradients else b * reduce


def comm_per_step(spec: ModelSpec, st: Settings, s: int) -> Dict[str, Dict[str, int]]:
    """Bytes and calls per collective and group per optimizer step, as the telemetry records them."""
    master, gathered, reduce = st.dtypes()
    units = _split(spec.units, st, s, 0)
    zero1 = _zero1(st, s)
    s = _layout_units(spec.units, st, s)[1]
    layout = plan_layout(st.dp_world, s, st.dp_per_node if st.dp_world > st.dp_per_node else None)
    two_hop = st.hierarchical_allgather and layout.hierarchical_possible
    A, r, W = st.accumulation, layout.replicas, st.dp_world
    diloco = st.replica_sync == "diloco"  # [Note: planner DiLoCo]
    out: Dict[str, Dict[str, int]] = {}

    def add(key: str, nbytes: int, calls: int = 1) -> None:
        if calls:
            entry = out.setdefault(key, {"bytes": 0, "calls": 0})
            entry["bytes"] += nbytes * calls
            entry["calls"] += calls

    if zero1:  # [Note: optimizer-state-only sharding] in gradients.py
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
            inter = wire_bytes(u.shard_numel, 1, st.quantization_block_size) if st.quantize_allgather else \
                u.shard_numel * gathered
            add("all_gather/inter", n * inter, n_gathers)
            add("all_gather/intra", s * u.shard_numel * gathered, n_gathers)
        else:
            add("all_gather/shard", s * u.shard_numel * gathered, n_gathers)
        for b in _unit_buckets(u, st):
            add("reduce_scatter/shard", s * b * reduce, A)
            if r > 1 and not st.shard_optimizer_state and not diloco:
                add("all_reduce/replicate", _replica_bytes(b, r, reduce, st))
        if r > 1 and st.shard_optimizer_state:  # [Note: optimizer rows over replicas]: reduce-scatter (trainable)
            B = st.quantization_block_size  # [Note: quantized optimizer rows]
            add("reduce_scatter/replicate", wire_bytes(r * _row(u), r, B) if st.quantize_gradients else
                r * sum(u.slots) * reduce, 1 if _unit_buckets(u, st) else 0)
            add("all_gather/replicate", r * wire_bytes(_row(u), 1, B) if st.quantize_gradients == "error_feedback"
                else r * sum(u.slots) * master)
    rows_units = sum(1 for u in units if u.sharded)
    if r > 1 and st.shard_optimizer_state and rows_units:  # [Note: rows between steps]: a flag per unit, fp32
        add("all_reduce/replicate", 4 * rows_units, A - 1)  # on the forwards inside the window (no step before)
    group, size = ("shard", s) if diloco else ("world", W)  # the replicated parameters' all-reduce
    if size > 1:
        for b in _world_buckets(units, st):
            add(f"all_reduce/{group}", b * 4)
    return out


def _outer_numel(units: List[_Unit]) -> int:
    """Elements of one rank's masters: each unit's flat shard and its replicated parameters whole."""
    return sum((u.shard_numel if u.sharded else 0) + sum(math.prod(p.shape) for p in u.replicated) for u in units)


def outer_syncs(spec: ModelSpec, st: Settings, s: int) -> List[Dict[str, Dict[str, int]]]:
    """DiLoCo's outer syncs of one window ([Note: planner DiLoCo]): per fragment (one without ``sync_fragments``),
    one all-reduce of its pseudo-gradients on the replica group."""
    r = st.dp_world // s
    if st.replica_sync != "diloco" or r == 1:
        return []
    units = [u for u in _split(spec.units, st, s, 0) if u.sharded or u.replicated]
    runs = split_units([u.full_numel + sum(math.prod(p.shape) for p in u.replicated) for u in units],
                       st.sync_fragments)
    out = []
    for run in runs:
        n = _outer_numel([units[i] for i in run])
        nbytes = wire_bytes(n, r, st.quantization_block_size) if st.quantize_gradients else n * 4
        out.append({"all_reduce/replicate": {"bytes": nbytes, "calls": 1}})
    return out


def outer_sync_comm(spec: ModelSpec, st: Settings, s: int) -> Dict[str, Dict[str, int]]:
    """One outer sync's collectives: the whole shard's, or the largest fragment's ([Note: planner DiLoCo])."""
    return _largest(outer_syncs(spec, st, s))


def _largest(syncs: List[Dict[str, Dict[str, int]]]) -> Dict[str, Dict[str, int]]:
    return max(syncs, key=lambda c: c["all_reduce/replicate"]["bytes"]) if syncs else {}


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
    # ([Note: staging in place] in full_storage.py); the root inside an accumulation window, or pinned, stages apart
    in_place = reduce <= gathered and not (largest is units[0] and (st.accumulation > 1 or _zero1(st, s)))
    buffers = group * largest.shard_numel * (gathered + (0 if in_place else reduce)) if group > 1 else 0
    links = {k: 0 for k in LINKS}
    for key, e in comm.items():
        links[_link_of(key, st, group)] += e["bytes"]
    syncs = outer_syncs(spec, st, s)  # DiLoCo: each once per sync_every steps, counted as their mean per step
    for key, e in ((k, e) for sync in syncs for k, e in sync.items()):
        links[_link_of(key, st, group)] += e["bytes"] // st.sync_every
    seconds = _seconds(comm, st, group) + sum(_seconds(sync, st, group) for sync in syncs) / st.sync_every
    budget = int(st.gpu_memory_gib * GiB * (1 - st.headroom))
    held = 0 if _zero1(st, s) else peak * gathered  # pinned parameters are model state already
    return Estimate(s, st.tensor_parallel_degree, st.dp_world // s, state, activation_bytes(spec, st), peak,
                    held, buffers, comm, links, seconds, budget,
                    _largest(syncs))


def degrees_to_plan(st: Settings, degrees: Optional[Sequence[int]] = None) -> List[int]:
    """The sharding degrees to estimate: every divisor of the data-parallel world, or those of ``degrees``, which
    must be among them (with ``shard_optimizer_state``: 1 is ZeRO-1, s > 1 the optimizer's rows over replicas)."""
    valid = [d for d in range(1, st.dp_world + 1) if st.dp_world % d == 0]
    if degrees is not None:
        bad = [d for d in degrees if d not in valid]
        if bad:
            _fail("degrees", list(degrees), f"divisors of the data-parallel world size {st.dp_world}: {valid}")
        valid = sorted(degrees)
    if st.replica_sync == "diloco":  # several replica groups ([Note: planner DiLoCo])
        if valid == [st.dp_world]:
            _fail("degrees", [st.dp_world], f"a degree below the data-parallel world {st.dp_world} with "
                  "replica_sync='diloco' (one replica group has nothing to sync with)")
        valid = [d for d in valid if d < st.dp_world]
    return valid
