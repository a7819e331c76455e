"""The planner's inputs other than the model: the cluster, the job and the strategy's options, validated.

The strategy's own options (``prefetch``, ``max_live_parameters``, ...) take their defaults from
:class:`lightning_mics.options.MiCSConfig`'s fields and are checked by it, so the planner cannot drift from the
strategy it plans for. The rest (cluster, precision, optimizer, batch shape) is the planner's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Tuple

from lightning_mics.options import MiCSConfig, MiCSOptions, check_quantization, parse_dtype
from lightning_mics.options import default_dtypes

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
_DEFAULTS = MiCSOptions()  # the strategy's defaults ([Note: one option list] in options.py)
# The strategy's options the planner takes, passed on to MiCSConfig for its checks.
_STRATEGY_OPTIONS = ("prefetch", "max_live_parameters", "param_persistence_threshold", "reduce_bucket_size",
                     "param_dtype", "reduce_dtype", "shard_optimizer_state", "quantize_gradients",
                     "tensor_parallel_degree", "replica_sync", "sync_every", "outer_lr", "outer_momentum",
                     "outer_nesterov", "sync_fragments", "sync_delay")


def _fail(option: str, value: Any, allowed: str) -> None:
    raise ValueError(f"plan option {option}={value!r} is invalid: allowed is {allowed}.")


def _nbytes(dtype: Any) -> int:
    return _BYTES[str(dtype).replace("torch.", "")]


def _strategy_default(name: str) -> Any:
    """A field whose default is the strategy's (all of these are immutable: ints, bools, None)."""
    return field(default=getattr(_DEFAULTS, name))


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
    activation_checkpointing: bool = False  # the strategy's option is a list of module classes; here on or off
    activation_offload: bool = _strategy_default("activation_offload")
    flash_attention: bool = True
    prefetch: int = _strategy_default("prefetch")
    max_live_parameters: int = _strategy_default("max_live_parameters")
    param_persistence_threshold: int = _strategy_default("param_persistence_threshold")
    reduce_bucket_size: int = _strategy_default("reduce_bucket_size")
    # True: two hops whenever the shard group spans whole nodes, which is the strategy's default (None) there
    hierarchical_allgather: bool = True
    param_dtype: Optional[str] = _strategy_default("param_dtype")
    reduce_dtype: Optional[str] = _strategy_default("reduce_dtype")
    tensor_parallel_degree: int = _strategy_default("tensor_parallel_degree")
    # ZeRO-1: s = 1, optimizer state over all W ([Note: planner with optimizer-state sharding] in estimate.py)
    shard_optimizer_state: bool = _strategy_default("shard_optimizer_state")
    # [Note: quantized traffic] in options.py: int8 blocks across the slow hop (checked by check_quantization)
    quantize_gradients: Any = _strategy_default("quantize_gradients")  # False | True | "error_feedback"
    quantize_allgather: bool = _strategy_default("quantize_allgather")
    quantization_block_size: int = _strategy_default("quantization_block_size")
    # [Note: DiLoCo across replica groups] in options.py ([Note: planner DiLoCo] in estimate.py)
    replica_sync: str = _strategy_default("replica_sync")
    sync_every: int = _strategy_default("sync_every")
    outer_lr: float = _strategy_default("outer_lr")
    outer_momentum: float = _strategy_default("outer_momentum")
    outer_nesterov: bool = _strategy_default("outer_nesterov")
    sync_fragments: int = _strategy_default("sync_fragments")  # streaming: one sync moves one fragment's bytes
    sync_delay: int = _strategy_default("sync_delay")  # (checked; the seconds do not model its overlap)
    headroom: float = 0.10

    def __post_init__(self) -> None:
        MiCSConfig(**{name: getattr(self, name) for name in _STRATEGY_OPTIONS})
        self.quantization_block_size = check_quantization(self.quantize_gradients, self.quantize_allgather,
                                                          self.quantization_block_size)
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

    @classmethod
    def of(cls, instance: Optional[str] = None, **settings: Any) -> "Settings":
        """Settings from keywords, an ``instance`` preset (a key of :data:`INSTANCES`) filling what is not given."""
        if instance is not None:
            if instance not in INSTANCES:
                _fail("instance", instance, " | ".join(INSTANCES))
            settings = {**INSTANCES[instance].__dict__, **settings}
        names = sorted(f.name for f in fields(cls))
        unknown = sorted(set(settings) - set(names))
        if unknown:
            _fail(unknown[0], settings[unknown[0]], f"a keyword of {names}")
        return cls(**settings)

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
