"""The strategy's options as one validated dataclass.

The same class is Hydra's structured config for ``conf/strategy/mics.yaml``, so a typo or a wrong type
fails when Hydra composes the config, and a wrong value fails here, in ``__post_init__``, before any process
group exists (a rank that raised alone inside a collective would leave the others hanging).

Checks that need the world size (``sharded_data_parallel_degree`` must divide it) live in
:meth:`MiCSConfig.validate_world`, called by the strategy before it creates any group.

[Note: one option list]
The options are listed once, as ``MiCSConfig``'s fields. ``MiCSOptions`` is the frozen copy made from those
fields (lists become tuples) that the front ends (``frontends/trainer.py`` for the Trainer, ``fabric.py`` for Fabric), the
engine and the planner's defaults read; both front ends take the options as keywords (``**options``) and
``config_from`` refuses an unknown name; ``with_options_signature`` shows them in ``help()``/``inspect.signature``
(both in frontends/keywords.py). :meth:`MiCSOptions.resolved` fills what the precision and the layout decide
(gathered and reduction dtypes, one-hop or two-hop gather) before the engine is built.
"""

from __future__ import annotations

from datetime import timedelta
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, Dict, List, Optional

import torch


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "16": torch.float16}
_KERNELS = ("auto", "triton", "torch")
_STATE_DICT_TYPES = ("sharded", "full")
_DEFAULT_MAX_LIVE = 1_000_000_000
QUANT_BLOCK_SIZE = 2048  # elements per scale (DeepSpeed's ZeRO++ uses 2k-8k)
_QUANT_MAX_BLOCK = 1 << 16  # triton_kernels' limit: one Triton program holds a block in registers
QUANTIZE_GRADIENTS = (False, True, "error_feedback")
REPLICA_SYNCS = ("exact", "diloco")
# the outer optimizer's defaults: DiLoCo's (arXiv 2311.08105: Nesterov SGD, lr 0.7, momentum 0.9); H as torchft's examples
OUTER_DEFAULTS = {"sync_every": 16, "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True,
                  "sync_fragments": 1, "sync_delay": 0, "fragment_mixing": 0.0}  # streaming: off
_MAX_TIMEOUT_S = timedelta.max.total_seconds()  # the process groups take their timeout as a timedelta


def _fail(option: str, value: Any, allowed: str) -> None:
    raise ValueError(f"MiCSStrategy option {option}={value!r} is invalid: allowed is {allowed}.")


def parse_dtype(option: str, value: Any) -> Optional[torch.dtype]:
    """``None`` | a ``torch.dtype`` | a name such as ``"bf16"`` -> ``Optional[torch.dtype]``."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in _DTYPES.values():
            _fail(option, value, "one of float32, bfloat16, float16 (or None: from the precision)")
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    _fail(option, value, f"one of {sorted(set(_DTYPES))} or None (from the trainer's precision)")
    return None  # unreachable


def _int_like(option: str, value: Any, minimum: int, allow_none: bool = False) -> Optional[int]:
    """Accepts ints and integral floats (``5e8``: the seed writes sizes that way)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and not value.is_integer()
    ):
        _fail(option, value, f"an integer >= {minimum}" + (" or None" if allow_none else ""))
    if int(value) < minimum:
        _fail(option, value, f"an integer >= {minimum}" + (" or None" if allow_none else ""))
    return int(value)


def check_quantization(quantize_gradients: Any, quantize_allgather: Any, block_size: Any) -> int:
    """Value checks of the quantization options ([Note: quantized traffic]); returns the block size as an int.

    [Note: quantized traffic]
    ``quantize_gradients`` sends the replica all-reduce of shard gradients as int8 blocks with one fp32 scale per
    ``quantization_block_size`` elements, summed in fp32 (``"error_feedback"``: each rank keeps its rounding error
    and adds it to the next step's contribution); ``quantize_allgather`` sends the cross-node hop of the two-hop
    parameter gather the same way, dequantized into ``param_dtype`` on arrival (the fp32 masters never see the
    rounding). The collectives are ``lightning_mics/comm/quantized.py`` ([Note: quantized all-reduce]). With
    ``shard_optimizer_state`` and s > 1 the replica sync is a reduce-scatter and an all-gather of the updated rows:
    the first goes in int8, and with ``"error_feedback"`` the rows' change too ([Note: quantized optimizer rows]
    in optimizer_rows.py).
    """
    if not any(quantize_gradients is v or quantize_gradients == v and isinstance(v, str) for v in QUANTIZE_GRADIENTS):
        _fail("quantize_gradients", quantize_gradients, "False, True or 'error_feedback'")
    if not isinstance(quantize_allgather, bool):
        _fail("quantize_allgather", quantize_allgather, "True or False")
    block = _int_like("quantization_block_size", block_size, 1)
    if block > _QUANT_MAX_BLOCK:
        _fail("quantization_block_size", block_size, f"an integer in [1, {_QUANT_MAX_BLOCK}] (elements per scale)")
    if block != QUANT_BLOCK_SIZE and quantize_gradients is False and not quantize_allgather:
        _fail("quantization_block_size", block_size,
              f"the default {QUANT_BLOCK_SIZE} unless quantize_gradients or quantize_allgather is on")
    return block


def optimizer_state_only(cfg: Any) -> bool:
    """``shard_optimizer_state`` with s = 1 (or unset): ZeRO-1 over every rank ([Note: optimizer-state-only sharding] in
    gradients.py). With s > 1 the option shards the optimizer state over the replicas too."""
    return cfg.shard_optimizer_state and cfg.sharded_data_parallel_degree in (None, 1)


def check_layout_options(cfg: Any, s: int, r: int, ranks_per_node: int) -> None:
    """An option that would not act on this layout is refused ([Note: quantized traffic]): the int8 replica
    all-reduce needs sharded parameters (s > 1) and several replicas (r > 1); the two-hop gather (and its int8
    hop) a sharding group of whole nodes, no tensor-parallel axis (and ``hierarchical_allgather`` not False)."""
    diloco = cfg.replica_sync == "diloco"  # acts with s = 1 too; under fault tolerance the groups are its replicas
    if cfg.quantize_gradients is not False and (s == 1 and not diloco or r == 1 and not (diloco and cfg.fault_tolerance)):
        why = "every parameter stays replicated with s = 1 and their all-reduce is not quantized" if s == 1 else \
            "a single replica (s = the data-parallel size) has no replica all-reduce"
        _fail("quantize_gradients", cfg.quantize_gradients,
              f"False with sharded_data_parallel_degree={s} and {r} replica(s): {why}")
    p, t = ranks_per_node, cfg.tensor_parallel_degree
    possible = t == 1 and s > p and s % p == 0  # a sharding group of whole nodes (Layout.hierarchical_possible)
    if cfg.hierarchical_allgather and not possible:
        _fail("hierarchical_allgather", True, f"None or False where a sharding group of {s} ranks does not span whole nodes of {p} (t={t})")
    two_hop = possible and cfg.hierarchical_allgather is not False
    if cfg.quantize_allgather and not two_hop:
        _fail("quantize_allgather", True,
              f"False unless the parameter gather takes two hops (a sharding group of whole nodes: s={s} with "
              f"{p} ranks per node, tensor_parallel_degree={t}, hierarchical_allgather="
              f"{cfg.hierarchical_allgather}); only the cross-node hop is quantized")


# [Note: fault-tolerant replica groups]
# With ``fault_tolerance`` each replica group is a torchrun job of its own (its ranks are the world the strategy
# sees) and the groups meet only through torchft's Manager: a lighthouse forms a quorum of the live groups every
# optimizer step (with ``replica_sync="diloco"`` every ``sync_every``-th), the shard gradients (the pseudo-gradients)
# are averaged across the quorum's groups (rank k with rank k: the same shard), and a step (the outer step) commits
# only if every rank of the group got through it. A layout that needs the same replicas on every step is refused:
# the optimizer's rows over replicas (``shard_optimizer_state``), int8 gradients under exact sync (DiLoCo's int8
# pseudo-gradients have no residuals), and a tensor-parallel axis (never run under it). The front-end glue is
# ``frontends/fault_tolerance/groups.py``; the managed group, ``comm/managed.py``.
def check_fault_tolerance(cfg: Any) -> None:
    """The options ``fault_tolerance`` rules out, refused at construction ([Note: fault-tolerant replica groups])."""
    if not isinstance(cfg.fault_tolerance, bool):
        _fail("fault_tolerance", cfg.fault_tolerance, "True or False")
    if not cfg.fault_tolerance:
        return
    if cfg.shard_optimizer_state:
        _fail("shard_optimizer_state", True, "False with fault_tolerance=True: the optimizer's rows are cut over a "
              "fixed set of replicas (s > 1) or over every rank (s = 1), while a fault-tolerant job's replica "
              "groups come and go")
    if cfg.quantize_gradients is not False and cfg.replica_sync != "diloco":
        _fail("quantize_gradients", cfg.quantize_gradients, "False with fault_tolerance=True and exact sync (its "
              "gradient average is torchft's, unquantized; residuals could not follow a group that leaves or "
              "joins); True is allowed with replica_sync='diloco'")
    if cfg.tensor_parallel_degree != 1:
        _fail("tensor_parallel_degree", cfg.tensor_parallel_degree, "1 with fault_tolerance=True (a tensor-parallel "
              "axis was never run under it)")


# [Note: DiLoCo across replica groups]
# With ``replica_sync="diloco"`` the replica groups train apart: a gradient is averaged over its shard group only and
# nothing crosses the replica groups inside a window. Every ``sync_every`` optimizer steps each rank averages over the
# replica groups the change of its own fp32 shard since the last sync (anchor - shard; int8 blocks with
# ``quantize_gradients=True``), an outer SGD steps the anchor with it, and the anchor becomes every replica's shard:
# all ranks of a shard rank hold the same anchor and outer momentum, the inner optimizer's state stays each replica's.
# It changes the optimization: only H = 1 with outer SGD at lr 1, no momentum, is exact data parallelism.
# Streaming ([Note: streaming fragments] in engine/fragments.py): the units in ``sync_fragments`` fragments, one synced
# every H / F steps, its average applied ``sync_delay`` steps after it was sent, merged by ``fragment_mixing``.
# The engine's part is ``engine/outer_sync.py``; with ``fault_tolerance`` the replica groups are torchrun jobs and
# the average goes through torchft's manager ([Note: DiLoCo across fault-tolerant groups] in fault_tolerance/groups.py).
def check_diloco(cfg: Any) -> None:
    """Value checks of the DiLoCo options ([Note: DiLoCo across replica groups]), before any process group."""
    if cfg.replica_sync not in REPLICA_SYNCS:
        _fail("replica_sync", cfg.replica_sync, "'exact' (the replica all-reduce every optimizer step) or 'diloco'")
    if cfg.replica_sync == "exact":
        for name, default in OUTER_DEFAULTS.items():
            if getattr(cfg, name) != default or type(getattr(cfg, name)) is not type(default):
                _fail(name, getattr(cfg, name), f"the default {default!r} unless replica_sync='diloco' (exact sync has "
                      "no outer optimizer)")
        return
    cfg.sync_every = _int_like("sync_every", cfg.sync_every, 1)
    lr = cfg.outer_lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        _fail("outer_lr", lr, "a positive finite number (the outer SGD's learning rate)")
    cfg.outer_lr = float(lr)
    mom = cfg.outer_momentum
    if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 0 <= mom < 1:
        _fail("outer_momentum", mom, "a number in [0, 1)")
    cfg.outer_momentum = float(mom)
    if not isinstance(cfg.outer_nesterov, bool):
        _fail("outer_nesterov", cfg.outer_nesterov, "True or False")
    if cfg.outer_nesterov and cfg.outer_momentum == 0:
        _fail("outer_nesterov", True, "False with outer_momentum=0 (Nesterov needs momentum)")
    check_fragments(cfg)
    if cfg.shard_optimizer_state:
        _fail("shard_optimizer_state", True, "False with replica_sync='diloco': the optimizer's rows are cut over the "
              "replicas (s > 1) or every rank (s = 1), while DiLoCo's replica groups step apart")
    if cfg.quantize_gradients == "error_feedback":
        _fail("quantize_gradients", "error_feedback", "False or True with replica_sync='diloco' (the pseudo-gradients "
              "go in int8 blocks; error feedback on them is not built)")
    if cfg.tensor_parallel_degree != 1:
        _fail("tensor_parallel_degree", cfg.tensor_parallel_degree, "1 with replica_sync='diloco' (never run with a "
              "tensor-parallel axis)")


def check_fragments(cfg: Any) -> None:
    """Streaming DiLoCo's options: F divides H, a delay under H / F (one sync lands before the next is sent)."""
    frags = cfg.sync_fragments = _int_like("sync_fragments", cfg.sync_fragments, 1)
    delay = cfg.sync_delay = _int_like("sync_delay", cfg.sync_delay, 0)
    if cfg.sync_every % frags:
        _fail("sync_fragments", frags, f"a divisor of sync_every={cfg.sync_every} (one fragment synced every "
              "sync_every / sync_fragments steps, each once per window)")
    if delay >= cfg.sync_every // frags:
        _fail("sync_delay", delay, f"an integer in [0, {cfg.sync_every // frags - 1}]: less than sync_every / "
              f"sync_fragments = {cfg.sync_every // frags}, so one fragment's sync lands before the next is sent")
    mix = cfg.fragment_mixing
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 <= mix <= 1:
        _fail("fragment_mixing", mix, "a number in [0, 1] (the local parameters' weight against the synced ones)")
    cfg.fragment_mixing = float(mix)


def check_diloco_layout(cfg: Any, s: int, r: int) -> None:
    """DiLoCo's replicas ([Note: DiLoCo across replica groups]): groups in this world, or one per fault-tolerant job."""
    if cfg.replica_sync == "diloco" and r == 1 and not cfg.fault_tolerance:
        _fail("replica_sync", "diloco", f"'exact' with sharded_data_parallel_degree={s} and one replica group")
    if cfg.replica_sync == "diloco" and cfg.fault_tolerance and r > 1:
        _fail("sharded_data_parallel_degree", s,
              f"{s * r} (one replica per group) with fault_tolerance=True and replica_sync='diloco'")


@dataclass
class MiCSConfig:
    """Options of :class:`lightning_mics.MiCSStrategy` (named after SageMaker's ``sdp_*`` knobs)."""

    sharded_data_parallel_degree: Optional[int] = None  # s; None: ranks per node
    hierarchical_allgather: Optional[bool] = None  # None: two hops whenever a shard group spans whole nodes
    ranks_per_node: Optional[int] = None  # None: from the cluster environment
    reduce_bucket_size: int = 500_000_000
    param_persistence_threshold: int = 1_000_000
    max_live_parameters: int = _DEFAULT_MAX_LIVE
    prefetch: int = 1
    reshard_after_forward: bool = True  # False: a unit stays gathered from its forward into its backward
    shard_optimizer_state: bool = False  # optimizer state over all data-parallel ranks (s = 1: ZeRO-1; s > 1: rows
    # over replicas too)
    tensor_parallel_degree: int = 1  # t: a "tp" mesh axis of t contiguous ranks for the user's parallelize plan
    prescaled_batch: bool = False  # with t > 1: each tensor-parallel group reads one batch (not one per rank)
    shard_units: Optional[List[str]] = None
    activation_checkpointing: Optional[List[str]] = None
    checkpoint_group_size: int = 1
    activation_offload: bool = False
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    kernels: str = "auto"
    state_dict_type: str = "sharded"  # checkpoints: a DCP directory of shards, or "full": one file by rank 0
    timeout: float = 1800.0  # seconds; a datetime.timedelta is taken too
    stop_on_nonfinite: bool = False  # raise on every rank at the first non-finite loss or gradient norm
    # [Note: quantized traffic]: int8 blocks on the slow hop
    quantize_gradients: Any = False  # False | True | "error_feedback": the replica all-reduce in int8 blocks
    quantize_allgather: bool = False  # the cross-node hop of the two-hop parameter gather in int8 blocks
    quantization_block_size: int = QUANT_BLOCK_SIZE  # elements per fp32 scale
    fault_tolerance: bool = False  # replica groups through torchft ([Note: fault-tolerant replica groups])
    # replica_sync="diloco": [Note: DiLoCo across replica groups]
    replica_sync: str = "exact"  # "exact": the replica all-reduce every step; "diloco": an outer step every H steps
    sync_every: int = OUTER_DEFAULTS["sync_every"]  # H: optimizer steps between outer syncs (diloco)
    outer_lr: float = OUTER_DEFAULTS["outer_lr"]
    outer_momentum: float = OUTER_DEFAULTS["outer_momentum"]
    outer_nesterov: bool = OUTER_DEFAULTS["outer_nesterov"]
    sync_fragments: int = OUTER_DEFAULTS["sync_fragments"]  # F: streaming DiLoCo's fragments, synced in turn
    sync_delay: int = OUTER_DEFAULTS["sync_delay"]  # tau: inner steps a fragment's average is in flight
    fragment_mixing: float = OUTER_DEFAULTS["fragment_mixing"]  # alpha: the local parameters' weight at the merge

    def __post_init__(self) -> None:
        self.sharded_data_parallel_degree = _int_like(
            "sharded_data_parallel_degree", self.sharded_data_parallel_degree, 1, allow_none=True
        )
        self.ranks_per_node = _int_like("ranks_per_node", self.ranks_per_node, 1, allow_none=True)
        self.reduce_bucket_size = _int_like("reduce_bucket_size", self.reduce_bucket_size, 1)
        self.param_persistence_threshold = _int_like("param_persistence_threshold", self.param_persistence_threshold, 0)
        self.max_live_parameters = _int_like("max_live_parameters", self.max_live_parameters, 1)
        self.prefetch = _int_like("prefetch", self.prefetch, 0)
        self.checkpoint_group_size = _int_like("checkpoint_group_size", self.checkpoint_group_size, 1)
        self.tensor_parallel_degree = _int_like("tensor_parallel_degree", self.tensor_parallel_degree, 1)
        for name in ("reshard_after_forward", "shard_optimizer_state", "prescaled_batch"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False")
        zero1 = optimizer_state_only(self)  # (s > 1: [Note: optimizer rows over replicas])
        if zero1 and self.max_live_parameters != _DEFAULT_MAX_LIVE:
            _fail("max_live_parameters", self.max_live_parameters,
                  f"the default {_DEFAULT_MAX_LIVE} with shard_optimizer_state=True: parameters stay whole on "
                  "every rank, nothing is gathered per layer")
        if zero1 and self.shard_units is not None:
            _fail("shard_units", self.shard_units, "None with shard_optimizer_state=True: parameters stay whole "
                  "on every rank, no unit is ever gathered or released")
        if zero1 and self.prefetch != 1:
            _fail("prefetch", self.prefetch, "the default 1 with shard_optimizer_state=True: nothing is gathered "
                  "per layer, so there is nothing to prefetch")
        if zero1 and not self.reshard_after_forward:
            _fail("reshard_after_forward", False,
                  "True (the default) with shard_optimizer_state=True: parameters are never resharded then")
        if self.tensor_parallel_degree > 1 and self.shard_optimizer_state:
            _fail("shard_optimizer_state", True, "False with tensor_parallel_degree > 1")
        if self.prescaled_batch and self.tensor_parallel_degree == 1:
            _fail("prescaled_batch", True, "True only with tensor_parallel_degree > 1")
        if self.hierarchical_allgather is not None and not isinstance(self.hierarchical_allgather, bool):
            _fail("hierarchical_allgather", self.hierarchical_allgather,
                  "None (two hops when a sharding group spans whole nodes), True or False")
        if not isinstance(self.activation_offload, bool):
            _fail("activation_offload", self.activation_offload, "True or False")
        for name in ("shard_units", "activation_checkpointing"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = [value]
            if value is not None:
                value = list(value)
                if not all(isinstance(v, (str, type)) for v in value):
                    _fail(name, value, "a list of module classes or their dotted names")
            setattr(self, name, value)
        if self.checkpoint_group_size != 1 and not self.activation_checkpointing:
            _fail("checkpoint_group_size", self.checkpoint_group_size,
                  "the default 1 unless activation_checkpointing names the modules to checkpoint in groups")
        if self.activation_offload and not self.activation_checkpointing:
            _fail("activation_offload", True, "True only together with activation_checkpointing")
        parse_dtype("param_dtype", self.param_dtype)
        parse_dtype("reduce_dtype", self.reduce_dtype)
        if self.kernels not in _KERNELS:
            _fail("kernels", self.kernels, " | ".join(repr(k) for k in _KERNELS))
        if self.state_dict_type not in _STATE_DICT_TYPES:
            _fail("state_dict_type", self.state_dict_type,
                  "'sharded' (a directory: every rank writes its shards through torch.distributed.checkpoint) or "
                  "'full' (one file, gathered on rank 0); both load under any layout")
        given = self.timeout  # seconds, or a timedelta as Lightning's own strategies take it
        seconds = given.total_seconds() if isinstance(given, timedelta) else given
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < _MAX_TIMEOUT_S:
            _fail("timeout", given, f"a positive number of seconds or a positive datetime.timedelta, < {_MAX_TIMEOUT_S:.3g} s")
        self.timeout = float(seconds)
        if not isinstance(self.stop_on_nonfinite, bool):
            _fail("stop_on_nonfinite", self.stop_on_nonfinite, "True or False")
        self.quantization_block_size = check_quantization(
            self.quantize_gradients, self.quantize_allgather, self.quantization_block_size)
        check_fault_tolerance(self)
        check_diloco(self)

    def validate_world(self, world_size: int, ranks_per_node: int) -> int:
        """Resolves and checks the sharding degree against the world; returns s. Call before any group.

        With ``tensor_parallel_degree`` t, the data-parallel ranks number W / t and s must divide that."""
        if self.ranks_per_node is not None and world_size % self.ranks_per_node != 0:
            _fail("ranks_per_node", self.ranks_per_node, f"a divisor of the world size {world_size}")
        t = self.tensor_parallel_degree
        if world_size % t != 0:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            _fail("tensor_parallel_degree", t, f"a divisor of the world size {world_size}: {divisors}")
        dp = world_size // t
        s = self.sharded_data_parallel_degree
        if self.fault_tolerance and s is not None and dp % s != 0:
            _fail("sharded_data_parallel_degree", s, f"a divisor of {world_size}, the ranks of this replica group "
                  "(fault_tolerance: the world is one group's torchrun job, and a shard group cannot span groups)")
        if s is None:
            s = 1 if self.shard_optimizer_state else max(1, min(ranks_per_node, world_size) // t)
        if dp % s != 0:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            what = f"the world size {world_size}" if t == 1 else \
                f"the data-parallel size {dp} (world {world_size} / tensor_parallel_degree {t})"
            _fail("sharded_data_parallel_degree", s, f"a divisor of {what}: {divisors}")
        check_layout_options(self, s, dp // s, ranks_per_node)
        check_diloco_layout(self, s, dp // s)
        return s

    @classmethod
    def names(cls) -> List[str]:
        return [f.name for f in fields(cls)]

    def freeze(self) -> "MiCSOptions":
        """The validated options as the frozen ``MiCSOptions`` (lists as tuples)."""
        return MiCSOptions(**{name: _frozen(getattr(self, name)) for name in self.names()})


# One line per option, for the README's options table (``python docs/options_table.py --write`` regenerates it;
# tests/project/test_docs.py keeps it in step). Data only: the checks live in ``MiCSConfig.__post_init__``.
DESCRIPTIONS: Dict[str, str] = {
    "sharded_data_parallel_degree": "s: ranks in one sharding group; divides the data-parallel size, "
                                    "r = W / (s t) replicas. None: ranks per node (1 with shard_optimizer_state)",
    "hierarchical_allgather": "two-hop parameter all-gather (across nodes, then inside) when a sharding group "
                              "spans whole nodes. None: wherever that applies",
    "ranks_per_node": "what counts as a node (simulates nodes on one machine). None: from the cluster environment",
    "reduce_bucket_size": "elements per gradient communication bucket (reduce-scatter; the replicated "
                          "parameters' all-reduce takes at most DDP's 25 MiB)",
    "param_persistence_threshold": "parameters with fewer elements stay whole on every rank, never gathered; "
                                   "their gradients are all-reduced",
    "max_live_parameters": "cap on gathered elements alive at once (prefetch waits beyond it); a model under it "
                           "is plain again after fit",
    "prefetch": "how many units ahead to all-gather, in the recorded order",
    "reshard_after_forward": "False: a unit stays gathered from its forward into its backward (one gather per "
                             "micro-batch instead of two)",
    "shard_optimizer_state": "optimizer state over all data-parallel ranks: with s = 1 ZeRO-1 (parameters stay "
                             "whole); with s > 1 each replica steps 1/r of its shard's rows",
    "tensor_parallel_degree": "t: a \"tp\" mesh axis of t contiguous ranks for the user's parallelize plan",
    "prescaled_batch": "with t > 1: each tensor-parallel group reads one batch (not one per rank)",
    "shard_units": "module classes (or dotted names) that form one gather/release unit. None: the blocks of "
                   "ModuleLists",
    "activation_checkpointing": "module classes (or dotted names) whose forward is recomputed in backward",
    "checkpoint_group_size": "k consecutive checkpointed sibling blocks form one segment (one input kept per k)",
    "activation_offload": "keep the checkpointed segments' inputs in host memory (with activation_checkpointing)",
    "param_dtype": "dtype of the gathered parameters. None: from the precision (bf16 under bf16-mixed)",
    "reduce_dtype": "dtype of gradient reduction. None: from the precision (fp32 under the mixed ones)",
    "kernels": "bucket copies and int8 passes: \"auto\" (Triton on CUDA for large buckets, torch elsewhere), "
               "\"triton\" or \"torch\"",
    "state_dict_type": "checkpoints: \"sharded\" (a DCP directory, every rank writes its rows) or \"full\" (one "
                       "file gathered on rank 0)",
    "timeout": "seconds (or a datetime.timedelta) a collective may take on every group before the job ends",
    "stop_on_nonfinite": "every rank raises NonFiniteError at the first non-finite loss or gradient norm",
    "quantize_gradients": "replica gradient sync in int8 blocks with fp32 sums; \"error_feedback\" carries each "
                          "rank's rounding into the next step",
    "quantize_allgather": "the cross-node hop of the two-hop parameter gather in int8 blocks",
    "quantization_block_size": "elements per fp32 scale of the int8 blocks (1 to 65536)",
    "fault_tolerance": "replica groups through torchft: each its own torchrun job under a lighthouse; a lost group "
                       "is dropped, a restarted one heals from a live peer (docs/fault-tolerance.md)",
    "replica_sync": "\"exact\" (the replica all-reduce every optimizer step) or \"diloco\": replica groups train apart "
                    "and an outer optimizer syncs their shards every sync_every steps (docs/diloco.md)",
    "sync_every": "diloco: H, optimizer steps between outer syncs",
    "outer_lr": "diloco: the outer SGD's learning rate on the averaged pseudo-gradient",
    "outer_momentum": "diloco: the outer SGD's momentum",
    "outer_nesterov": "diloco: Nesterov momentum in the outer SGD",
    "sync_fragments": "diloco: F, the units in F fragments synced in turn, one every sync_every / F steps "
                      "(streaming DiLoCo); 1: all at once",
    "sync_delay": "diloco: inner steps a fragment's average is in flight before it applies (overlapped); 0: blocking",
    "fragment_mixing": "diloco: the local parameters' weight when a synced fragment is merged (0: the synced values)",
}


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def default_dtypes(precision: str) -> "tuple[Optional[torch.dtype], torch.dtype]":
    """(param_dtype, reduce_dtype) for a precision string: None means 'the parameters' own dtype'."""
    return {"32-true": (None, torch.float32), "64-true": (None, torch.float64),
            "bf16-mixed": (torch.bfloat16, torch.float32), "16-mixed": (torch.float16, torch.float32),
            "bf16-true": (None, torch.float32), "16-true": (None, torch.float32)}[precision]


def _resolved(self: Any, precision: str, hierarchical: bool) -> "MiCSOptions":
    """These options with what the engine needs decided: the gathered and reduction dtypes (from the precision
    where not given) and whether the parameter all-gather takes two hops."""
    param_default, reduce_default = default_dtypes(precision)
    return replace(self, param_dtype=parse_dtype("param_dtype", self.param_dtype) or param_default,
                   reduce_dtype=parse_dtype("reduce_dtype", self.reduce_dtype) or reduce_default,
                   hierarchical_allgather=bool(hierarchical))


# [Note: one option list]: the frozen twin of MiCSConfig, generated from its fields
MiCSOptions = make_dataclass(
    "MiCSOptions", [(f.name, f.type, field(default=f.default)) for f in fields(MiCSConfig)], frozen=True,
    namespace={"resolved": _resolved, "validate_world": MiCSConfig.validate_world, "names": MiCSConfig.names,
               "__module__": __name__,
               "__doc__": "The strategy's options, validated and frozen (built by ``MiCSConfig.freeze``)."})
