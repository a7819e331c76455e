"""Every option refusal that needs no process, in one table: a bad value or combination is a ``ValueError`` naming
the option, the value and what is allowed, raised in this process before any process group exists.

Each row is made the way a user makes it: the Trainer's ``MiCSStrategy(...)`` (and Fabric's, which takes the same
options: ``both``), a ``L.Trainer`` or ``L.Fabric`` around it (the checks against the world size and the precision
run there, ``validate_world`` and the precision check), or ``MiCSConfig(...).validate_world(world, ranks_per_node)``
for a world no Trainer on this machine can have. What a refusal looks like from a real job (the process exits
non-zero with the message, every rank alike, before any collective) is in test_bad_inputs.py beside this file.
"""

from __future__ import annotations

import re
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_mics import MiCSConfig, MiCSStrategy
from lightning_mics import fabric as mics_fabric

BOTH, TRAINER_INIT, FABRIC_INIT, TRAINER, FABRIC, CONFIG = "both", "trainer-init", "fabric-init", "trainer", "fabric", \
    "config"


def _mixed(kind: str, precision: str):
    if kind == TRAINER:
        from lightning.pytorch.plugins.precision import MixedPrecision

        return MixedPrecision(precision, "cpu")
    from lightning.fabric.plugins.precision import MixedPrecision

    return MixedPrecision(precision, "cpu", torch.amp.GradScaler("cpu"))


def _async_io():
    from lightning.pytorch.plugins import AsyncCheckpointIO

    return AsyncCheckpointIO()


# (id, how it is made, options, what surrounds it (Trainer / Fabric keywords; CONFIG: (world, ranks per node)),
#  what the message holds: substrings, or patterns where the order matters)
ROWS = [
    # values, one option at a time (MiCSConfig.__post_init__)
    ("degree-zero", BOTH, dict(sharded_data_parallel_degree=0), {},
     ["sharded_data_parallel_degree=0", "allowed is an integer >= 1 or None"]),
    ("bucket-zero", BOTH, dict(reduce_bucket_size=0), {}, ["reduce_bucket_size=0", "allowed is an integer >= 1"]),
    ("persistence-negative", BOTH, dict(param_persistence_threshold=-1), {},
     ["param_persistence_threshold=-1", "allowed is an integer >= 0"]),
    ("prefetch-negative", BOTH, dict(prefetch=-1), {}, ["prefetch=-1", "allowed is an integer >= 0"]),
    ("prefetch-float", BOTH, dict(prefetch=1.5), {}, ["prefetch=1.5", "allowed is an integer >= 0"]),
    ("reshard-string", BOTH, dict(reshard_after_forward="no"), {},
     ["reshard_after_forward='no'", "allowed is True or False"]),
    ("reshard-int", BOTH, dict(reshard_after_forward=1), {}, [re.compile(r"reshard_after_forward=1 .*True or False")]),
    ("hierarchical-string", BOTH, dict(hierarchical_allgather="yes"), {},
     ["hierarchical_allgather='yes'", "allowed is None (two hops when a sharding group spans whole nodes), True or False"]),
    ("shard-units-not-a-list", BOTH, dict(shard_units=[3]), {},
     ["shard_units=[3]", "allowed is a list of module classes or their dotted names"]),
    ("shard-units-not-a-module", BOTH, dict(shard_units=["torch.Tensor"]), {},
     ["shard_units=['torch.Tensor']", "allowed is a list of nn.Module classes or their dotted names"]),
    ("shard-units-not-importable", BOTH, dict(shard_units=["no.such.Block"]), {},
     ["shard_units=['no.such.Block']", "allowed is a list of nn.Module classes or their dotted names"]),
    ("checkpointing-not-importable", BOTH, dict(activation_checkpointing=["no.such.Block"]), {},
     ["activation_checkpointing=['no.such.Block']", "allowed is a list of nn.Module classes or their dotted names"]),
    ("param-dtype-int8", BOTH, dict(param_dtype="int8"), {},
     ["param_dtype='int8'", "allowed is one of ['16', '32', 'bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32']"]),
    ("reduce-dtype-fp8", BOTH, dict(reduce_dtype="fp8"), {}, ["reduce_dtype='fp8'", "allowed is one of ["]),
    ("kernels-x", BOTH, dict(kernels="x"), {}, ["kernels='x'", "allowed is 'auto' | 'triton' | 'torch'"]),
    ("kernels-cuda", BOTH, dict(kernels="cuda"), {}, ["kernels='cuda'", "allowed is 'auto' | 'triton' | 'torch'"]),
    ("state-dict-type-x", BOTH, dict(state_dict_type="x"), {}, ["state_dict_type='x'", "allowed is 'sharded'", "'full'"]),
    ("state-dict-type-zip", CONFIG, dict(state_dict_type="zip"), None, ["state_dict_type='zip'", "allowed is 'sharded'"]),
    ("timeout-zero", BOTH, dict(timeout=0), {}, ["timeout=0", "allowed is a positive number of seconds"]),
    ("timeout-inf", BOTH, dict(timeout=float("inf")), {}, ["timeout=inf", "allowed is a positive number", "< 8.64e+13 s"]),
    ("timeout-nan", BOTH, dict(timeout=float("nan")), {}, ["timeout=nan", "allowed is a positive number", "< 8.64e+13 s"]),
    ("timeout-past-timedelta", BOTH, dict(timeout=1e300), {}, ["timeout=1e+300", "datetime.timedelta, < 8.64e+13 s"]),
    ("timeout-negative-timedelta", BOTH, dict(timeout=timedelta(seconds=-1)), {},
     [re.compile(r"timeout=datetime.timedelta\(days=-1.*allowed is a positive number of seconds or a positive "
                 r"datetime.timedelta")]),
    ("start-method-thread", TRAINER_INIT, dict(start_method="thread"), {}, ["start_method='thread'", "allowed is one of"]),
    ("stop-on-nonfinite-string", BOTH, dict(stop_on_nonfinite="yes"), {},
     ["stop_on_nonfinite='yes' is invalid: allowed is True or False"]),
    ("tp-zero", TRAINER_INIT, dict(tensor_parallel_degree=0), {}, ["tensor_parallel_degree=0", "allowed"]),
    ("tp-under-fabric", FABRIC_INIT, dict(tensor_parallel_degree=2), {},
     ["tensor_parallel_degree=2 is invalid under Fabric: allowed is 1"]),
    ("unknown-keyword", FABRIC_INIT, dict(prefetchh=1), {}, ["option prefetchh=1 is invalid: allowed is a keyword of"]),
    ("quantize-gradients-string", BOTH, dict(quantize_gradients="int8"), {}, ["quantize_gradients='int8'", "allowed"]),
    ("quantize-allgather-int", BOTH, dict(quantize_allgather=1), {}, ["quantize_allgather=1", "allowed"]),
    ("quantization-block-zero", BOTH, dict(quantization_block_size=0), {}, ["quantization_block_size=0", "allowed"]),
    ("quantization-block-huge", BOTH, dict(quantization_block_size=1 << 17), {},
     ["quantization_block_size=131072", "allowed"]),
    ("quantization-block-alone", BOTH, dict(quantization_block_size=4096), {},  # without a quantize option
     ["quantization_block_size=4096", "allowed"]),
    # combinations (MiCSConfig.__post_init__)
    ("offload-without-checkpointing", BOTH, dict(activation_offload=True), {},
     ["activation_offload=True", "allowed is True only together with activation_checkpointing"]),
    ("group-size-without-checkpointing", BOTH, dict(checkpoint_group_size=2), {},
     ["checkpoint_group_size=2", "allowed is the default 1 unless activation_checkpointing"]),
    ("optimizer-state-with-live-cap", BOTH,
     dict(shard_optimizer_state=True, sharded_data_parallel_degree=1, max_live_parameters=1000), {},
     ["max_live_parameters=1000", "allowed is the default 1000000000 with shard_optimizer_state=True"]),
    ("optimizer-state-with-live-cap-default-degree", BOTH, dict(shard_optimizer_state=True, max_live_parameters=100),
     {}, ["max_live_parameters=100 ", "allowed"]),
    ("optimizer-state-with-prefetch", BOTH, dict(shard_optimizer_state=True, prefetch=2), {},
     ["prefetch=2", "allowed is the default 1 with shard_optimizer_state=True"]),
    ("optimizer-state-with-units", BOTH, dict(shard_optimizer_state=True, shard_units=["torch.nn.Linear"]), {},
     ["shard_units=['torch.nn.Linear']", "allowed is None with shard_optimizer_state=True"]),
    ("optimizer-state-keep-gathered", BOTH, dict(shard_optimizer_state=True, reshard_after_forward=False), {},
     ["reshard_after_forward=False", "allowed is True (the default) with shard_optimizer_state=True"]),
    ("optimizer-state-with-tp", TRAINER_INIT, dict(shard_optimizer_state=True, tensor_parallel_degree=2), {},
     ["shard_optimizer_state=True", "allowed is False with tensor_parallel_degree > 1"]),
    ("prescaled-without-tp", TRAINER_INIT, dict(prescaled_batch=True), {},
     ["prescaled_batch=True", "allowed is True only with tensor_parallel_degree > 1"]),
    ("checkpoint-io-sharded", TRAINER, {}, dict(devices=2, plugins=[_async_io]),  # the plugin would not see a sharded save
     ["checkpoint_io=AsyncCheckpointIO with state_dict_type='sharded'", "allowed is a CheckpointIO plugin only with "
      "state_dict_type='full'"]),
    # against the world (validate_world, when the Trainer or Fabric is made)
    ("degree-not-dividing-world", TRAINER, dict(sharded_data_parallel_degree=3), dict(devices=2),
     ["sharded_data_parallel_degree=3", "allowed is a divisor of the world size 2: [1, 2]"]),
    ("degree-not-dividing-world-4", TRAINER, dict(sharded_data_parallel_degree=3), dict(devices=4),
     [re.compile(r"sharded_data_parallel_degree=3 .*divisor of the world size 4")]),
    ("fabric-degree-not-dividing-world", FABRIC, dict(sharded_data_parallel_degree=3), dict(devices=4),
     [re.compile(r"sharded_data_parallel_degree=3 .*allowed is a divisor of the world size 4")]),
    ("degree-not-dividing-dp", TRAINER, dict(sharded_data_parallel_degree=2, tensor_parallel_degree=2), dict(devices=2),
     ["sharded_data_parallel_degree=2", "allowed is a divisor of the data-parallel size 1 (world 2 / "
      "tensor_parallel_degree 2): [1]"]),
    ("degree-not-dividing-dp-8", CONFIG, dict(tensor_parallel_degree=2, sharded_data_parallel_degree=3), (8, 8),
     [re.compile(r"sharded_data_parallel_degree=3 .*data-parallel size 4")]),
    ("ranks-per-node-not-dividing", TRAINER, dict(ranks_per_node=3), dict(devices=2),
     ["ranks_per_node=3", "allowed is a divisor of the world size 2"]),
    ("tp-not-dividing-world", TRAINER, dict(tensor_parallel_degree=3), dict(devices=2),
     ["tensor_parallel_degree=3", "allowed is a divisor of the world size 2: [1, 2]"]),
    ("tp-not-dividing-world-8", CONFIG, dict(tensor_parallel_degree=3), (8, 8),
     [re.compile(r"tensor_parallel_degree=3 .*divisor of the world size 8")]),
    ("error-feedback-zero1", CONFIG,
     dict(shard_optimizer_state=True, sharded_data_parallel_degree=1, quantize_gradients="error_feedback"), (4, 2),
     [re.compile(r"quantize_gradients='error_feedback' .*sharded_data_parallel_degree=1")]),
    # options that would not act in this layout (validate_world)
    ("quantized-gradients-one-replica", TRAINER, dict(sharded_data_parallel_degree=4, quantize_gradients=True),
     dict(devices=4), ["allowed is False", "a single replica"]),
    ("error-feedback-all-replicated", TRAINER,
     dict(sharded_data_parallel_degree=1, quantize_gradients="error_feedback"), dict(devices=4),
     ["allowed is False", "every parameter stays replicated"]),
    ("quantized-gather-one-hop", TRAINER, dict(sharded_data_parallel_degree=2, quantize_allgather=True),
     dict(devices=4), ["allowed is False", "unless the parameter gather takes two hops"]),
    ("quantized-gather-hierarchical-off", TRAINER,
     dict(sharded_data_parallel_degree=2, ranks_per_node=1, hierarchical_allgather=False, quantize_allgather=True),
     dict(devices=4), ["allowed is False", "hierarchical_allgather=False"]),
    # DiLoCo ([Note: DiLoCo across replica groups] in options.py): values, combinations, the layout
    ("replica-sync-unknown", BOTH, dict(replica_sync="local_sgd"), {},
     ["replica_sync='local_sgd'", "allowed is 'exact' (the replica all-reduce every optimizer step) or 'diloco'"]),
    ("sync-every-zero", BOTH, dict(replica_sync="diloco", sync_every=0), {}, ["sync_every=0", "allowed is an integer >= 1"]),
    ("sync-every-float", BOTH, dict(replica_sync="diloco", sync_every=2.5), {},
     ["sync_every=2.5", "allowed is an integer >= 1"]),
    ("outer-lr-zero", BOTH, dict(replica_sync="diloco", outer_lr=0), {}, ["outer_lr=0", "allowed is a positive finite"]),
    ("outer-momentum-one", BOTH, dict(replica_sync="diloco", outer_momentum=1.0), {},
     ["outer_momentum=1.0", "allowed is a number in [0, 1)"]),
    ("outer-nesterov-string", BOTH, dict(replica_sync="diloco", outer_nesterov="yes"), {},
     ["outer_nesterov='yes'", "allowed is True or False"]),
    ("nesterov-without-momentum", BOTH, dict(replica_sync="diloco", outer_momentum=0.0), {},
     ["outer_nesterov=True", "allowed is False with outer_momentum=0"]),
    ("exact-with-sync-every", BOTH, dict(sync_every=4), {},
     ["sync_every=4", "allowed is the default 16 unless replica_sync='diloco'"]),
    ("exact-with-outer-lr", BOTH, dict(outer_lr=1.0), {}, ["outer_lr=1.0", "allowed is the default 0.7 unless"]),
    ("exact-with-outer-momentum", BOTH, dict(outer_momentum=0.0), {}, ["outer_momentum=0.0", "the default 0.9 unless"]),
    ("exact-with-outer-nesterov", BOTH, dict(outer_nesterov=False), {}, ["outer_nesterov=False", "the default True"]),
    ("diloco-zero1", BOTH, dict(replica_sync="diloco", shard_optimizer_state=True, sharded_data_parallel_degree=1), {},
     ["shard_optimizer_state=True", "allowed is False with replica_sync='diloco'"]),
    ("diloco-rows-over-replicas", BOTH,
     dict(replica_sync="diloco", shard_optimizer_state=True, sharded_data_parallel_degree=2), {},
     ["shard_optimizer_state=True", "allowed is False with replica_sync='diloco'"]),
    ("diloco-error-feedback", BOTH, dict(replica_sync="diloco", quantize_gradients="error_feedback"), {},
     ["quantize_gradients='error_feedback'", "allowed is False or True with replica_sync='diloco'"]),
    # what DiLoCo under fault tolerance leaves out
    ("exact-fault-tolerance-int8", BOTH, dict(fault_tolerance=True, quantize_gradients=True),
     {}, ["quantize_gradients=True", "allowed is False with fault_tolerance=True and exact sync"]),
    ("diloco-tensor-parallel", BOTH, dict(replica_sync="diloco", tensor_parallel_degree=2), {},
     ["tensor_parallel_degree=2", "allowed is 1 with replica_sync='diloco'"]),
    ("exact-with-fragments", BOTH, dict(sync_fragments=2), {}, ["sync_fragments=2", "the default 1 unless replica_sync"]),
    ("exact-with-delay", BOTH, dict(sync_delay=1), {}, ["sync_delay=1", "the default 0 unless replica_sync"]),
    ("exact-with-mixing", BOTH, dict(fragment_mixing=0.5), {}, ["fragment_mixing=0.5", "the default 0.0 unless"]),
    ("fragments-zero", BOTH, dict(replica_sync="diloco", sync_fragments=0), {},
     ["sync_fragments=0", "allowed is an integer >= 1"]),
    ("fragments-not-dividing", BOTH, dict(replica_sync="diloco", sync_every=16, sync_fragments=3), {},
     ["sync_fragments=3", "allowed is a divisor of sync_every=16"]),
    ("delay-negative", BOTH, dict(replica_sync="diloco", sync_delay=-1), {}, ["sync_delay=-1", "an integer >= 0"]),
    ("delay-float", BOTH, dict(replica_sync="diloco", sync_delay=0.5), {}, ["sync_delay=0.5", "an integer >= 0"]),
    ("delay-a-whole-period", BOTH, dict(replica_sync="diloco", sync_every=16, sync_fragments=4, sync_delay=4), {},
     ["sync_delay=4", "allowed is an integer in [0, 3]: less than sync_every / sync_fragments = 4"]),
    ("delay-without-fragments", BOTH, dict(replica_sync="diloco", sync_every=2, sync_delay=2), {},
     ["sync_delay=2", "allowed is an integer in [0, 1]"]),
    ("mixing-above-one", BOTH, dict(replica_sync="diloco", fragment_mixing=1.5), {},
     ["fragment_mixing=1.5", "allowed is a number in [0, 1]"]),
    ("mixing-bool", BOTH, dict(replica_sync="diloco", fragment_mixing=True), {},
     ["fragment_mixing=True", "allowed is a number in [0, 1]"]),
    ("diloco-one-replica", TRAINER, dict(replica_sync="diloco", sharded_data_parallel_degree=4), dict(devices=4),
     ["replica_sync='diloco'", "allowed is 'exact' with sharded_data_parallel_degree=4 and one replica group"]),
    ("fabric-diloco-one-replica", FABRIC, dict(replica_sync="diloco", sharded_data_parallel_degree=2), dict(devices=2),
     ["replica_sync='diloco'", "allowed is 'exact' with sharded_data_parallel_degree=2 and one replica group"]),
    # two hops asked for where the sharding group is not several whole nodes (before: a warning, the flat gather)
    ("two-hop-inside-one-node", CONFIG, dict(sharded_data_parallel_degree=2, hierarchical_allgather=True), (8, 4),
     ["hierarchical_allgather=True", "allowed is None or False where a sharding group of 2 ranks does not span"]),
    ("two-hop-one-whole-node", CONFIG, dict(sharded_data_parallel_degree=4, hierarchical_allgather=True), (8, 4),
     ["hierarchical_allgather=True", "of 4 ranks does not span whole nodes of 4"]),
    ("two-hop-zero1", CONFIG, dict(shard_optimizer_state=True, hierarchical_allgather=True), (8, 4),
     ["hierarchical_allgather=True", "a sharding group of 1 ranks"]),
    ("diloco-one-replica-8", CONFIG, dict(replica_sync="diloco", sharded_data_parallel_degree=8), (8, 8),
     ["replica_sync='diloco'", "one replica group"]),
    # under fault tolerance each torchrun job is one DiLoCo replica: replicas inside it would never be averaged
    ("diloco-fault-tolerance-replicas-inside", CONFIG,
     dict(replica_sync="diloco", fault_tolerance=True, sharded_data_parallel_degree=2), (4, 4),
     ["sharded_data_parallel_degree=2", "allowed is 4 (one replica per group) with fault_tolerance=True"]),
    # against the precision (when the Trainer or Fabric is made)
    ("stop-with-16-mixed", TRAINER, dict(stop_on_nonfinite=True), dict(devices=2, plugins=["16-mixed"]),
     ["stop_on_nonfinite=True", "precision='16-mixed'", "allowed is False there"]),
    ("stop-with-16-mixed-one-device", TRAINER, dict(stop_on_nonfinite=True), dict(devices=1, plugins=["16-mixed"]),
     ["stop_on_nonfinite=True is invalid with precision='16-mixed'"]),
    ("fabric-stop-with-16-mixed", FABRIC, dict(stop_on_nonfinite=True), dict(devices=2, plugins=["16-mixed"]),
     ["stop_on_nonfinite=True is invalid with precision='16-mixed'"]),
    ("fabric-64-true", FABRIC, {}, dict(devices=2, precision="64-true"),
     [re.compile(r"precision='64-true'.*allowed precision is one of")]),
]


def _make(kind, options, around):
    if kind in (BOTH, TRAINER_INIT):
        MiCSStrategy(**options)
    if kind in (BOTH, FABRIC_INIT):
        mics_fabric.MiCSStrategy(**options)
    if kind == CONFIG:
        MiCSConfig(**options).validate_world(*around) if around else MiCSConfig(**options)
    if kind in (TRAINER, FABRIC):
        around = dict(around)
        plugins = [_mixed(kind, p) if isinstance(p, str) else p() for p in around.pop("plugins", [])]
        if kind == TRAINER:
            L.Trainer(accelerator="cpu", logger=False, strategy=MiCSStrategy(**options), plugins=plugins, **around)
        else:
            L.Fabric(accelerator="cpu", strategy=mics_fabric.MiCSStrategy(**options), plugins=plugins, **around)


@pytest.mark.parametrize("kind, options, around, expected", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_refused_naming_option_value_and_allowed(kind, options, around, expected):
    fronts = [TRAINER_INIT, FABRIC_INIT] if kind == BOTH else [kind]
    for front in fronts:  # under BOTH, each front end refuses alone
        with pytest.raises(ValueError) as err:
            _make(front, options, around)
        message = str(err.value)
        for text in expected:
            found = text.search(message) if isinstance(text, re.Pattern) else text in message
            assert found, f"{front}: {getattr(text, 'pattern', text)!r} not in {message!r}"
    assert not dist.is_initialized()  # refused before any process group


@pytest.mark.parametrize("options", [
    dict(tensor_parallel_degree=2, state_dict_type="full"),  # full checkpoints gather the tp parts too
    dict(shard_optimizer_state=True, sharded_data_parallel_degree=2),  # [Note: optimizer rows over replicas]
    dict(shard_optimizer_state=True, sharded_data_parallel_degree=2, prefetch=2, max_live_parameters=100),
    dict(replica_sync="diloco"),  # the outer defaults: H = 16, Nesterov SGD at lr 0.7, momentum 0.9
    dict(replica_sync="diloco", sync_every=1, outer_lr=1, outer_momentum=0, outer_nesterov=False),
    dict(replica_sync="diloco", quantize_gradients=True),
    dict(replica_sync="diloco", sync_every=16, sync_fragments=4, sync_delay=3, fragment_mixing=1, quantize_gradients=True),
    dict(replica_sync="diloco", sync_every=4, sync_delay=3, fragment_mixing=0.5),  # one fragment, overlapped
])
def test_accepted(options):
    MiCSStrategy(**options)


@pytest.mark.parametrize("front", [TRAINER, FABRIC])
def test_kernels_triton_refused_where_its_kernels_cannot_run(front, monkeypatch):
    """``kernels="triton"`` on CPU without the interpreter is refused when the Trainer or Fabric is made (before: the
    first forward's bucket copy raised a RuntimeError naming no option, after the process groups existed); under
    ``TRITON_INTERPRET=1`` (this suite's setting, conftest.py) it is accepted."""
    from lightning_mics_kernels import _backend

    monkeypatch.setattr(_backend, "_INTERPRETED", False)  # what a process without TRITON_INTERPRET=1 reads
    with pytest.raises(ValueError) as err:
        _make(front, dict(kernels="triton"), dict(devices=2))
    assert "kernels='triton' is invalid here: on CPU tensors they run only under TRITON_INTERPRET=1" in str(err.value)
    assert "allowed is 'auto' (Triton where it runs, torch elsewhere) or 'torch'" in str(err.value)
    assert not dist.is_initialized()
    monkeypatch.setattr(_backend, "_INTERPRETED", True)
    _make(front, dict(kernels="triton"), dict(devices=2))


def test_accepted_against_the_world():
    assert MiCSConfig(tensor_parallel_degree=2).validate_world(8, 8) == 4
    assert MiCSConfig(sharded_data_parallel_degree=8, hierarchical_allgather=True).validate_world(8, 4) == 8
    # [Note: quantized optimizer rows]: int8 with the rows over replicas (s > 1); at s = 1 (ZeRO-1) nothing to quantize
    MiCSConfig(shard_optimizer_state=True, sharded_data_parallel_degree=2, quantize_gradients=True).validate_world(4, 2)
    # DiLoCo at s = 1 (every parameter replicated): its pseudo-gradients go in int8 all the same
    assert MiCSConfig(replica_sync="diloco", sharded_data_parallel_degree=1, quantize_gradients=True
                      ).validate_world(4, 4) == 1
    # fault tolerance: s = every rank of the group's job (given, or ranks per node on one node)
    assert MiCSConfig(replica_sync="diloco", fault_tolerance=True, sharded_data_parallel_degree=4).validate_world(4, 4) == 4
    assert MiCSConfig(replica_sync="diloco", fault_tolerance=True).validate_world(2, 2) == 2
