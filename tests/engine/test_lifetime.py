"""What a dropped model leaves behind: nothing. A model set up under MiCS, trained and then dropped by
its user is freed with its engine and its optimizer, variant after variant in one process (a notebook, a sweep's
jobs): under Fabric, which keeps the module sharded, and under the Trainer, where fit makes a small model plain
again and leaves a model larger than ``max_live_parameters`` sharded ([Note: engines beside their modules] in
frontends/shared.py). Before, every sharded module stayed alive to the end of the process: the engines' registry held
each engine, which holds its module, and the parameters' gradient hooks, kept from C++, held their units."""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
BLOCK = "lightning_mics.app.models.gpt.Block"
SCRIPT = REPO / "tests" / "engine" / "lifetime.py"


def _assert_freed(res, kept_sharded):
    """Every variant on every rank: sharded (or not) after training as expected, then freed with its engine and
    optimizer, and no engine left registered."""
    for rank in res:
        assert [r["kept_sharded"] for r in rank] == kept_sharded, rank
        assert [r["alive"] for r in rank] == len(kept_sharded) * [[False, False, False]], rank  # module, engine, opt
        assert [r["engines_registered"] for r in rank] == len(kept_sharded) * [0], rank


def test_a_dropped_model_is_freed_with_its_engine(tmp_path):
    variants = [{"sharded_data_parallel_degree": 2}, {"sharded_data_parallel_degree": 1},
                {"sharded_data_parallel_degree": 1, "shard_optimizer_state": True},
                {"sharded_data_parallel_degree": 2, "activation_checkpointing": [BLOCK], "checkpoint_group_size": 2,
                 "activation_offload": True},
                {"front": "trainer", "sharded_data_parallel_degree": 2},
                {"front": "trainer", "sharded_data_parallel_degree": 2, "max_live_parameters": 1000},
                {"sharded_data_parallel_degree": 2, "precision": "bf16-mixed"},  # (its param_dtype copies too)
                {"front": "trainer", "sharded_data_parallel_degree": 2, "max_live_parameters": 1000,
                 "precision": "bf16-mixed"}]
    res = run_ranks(SCRIPT, 2, ["--variants", json.dumps(variants)], tmp_path)
    _assert_freed(res, [True, True, True, True, False, True, True, True])


def test_quantized_and_optimizer_rows_layouts_are_freed_too(tmp_path):
    """4 ranks (s = 2, r = 2): int8 replica traffic with error feedback (its residuals), the optimizer's rows over
    replicas (their all-gathers after each step), both together, and the Trainer keeping the rows layout sharded."""
    variants = [{"sharded_data_parallel_degree": 2, "quantize_gradients": "error_feedback"},
                {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
                {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True,
                 "quantize_gradients": "error_feedback"},
                {"front": "trainer", "sharded_data_parallel_degree": 2, "shard_optimizer_state": True,
                 "max_live_parameters": 1000}]
    res = run_ranks(SCRIPT, 4, ["--variants", json.dumps(variants)], tmp_path)
    _assert_freed(res, 4 * [True])


def test_groups_are_released_alike_whatever_each_ranks_collector_did(tmp_path):
    """4 ranks (s = 2, r = 2: real sub-groups), the garbage collector run between fits on rank 1 only. A model left
    sharded by fit 1 and dropped is garbage held by a reference cycle: freed on rank 1, not yet on the others
    when fit 2 (whose model is made plain) ends and each rank decides whether the layout's groups are still used.
    Deciding on what each rank's collector happened to free, rank 1 destroyed them and the others kept them, and
    fit 3 hung, rank 1 creating groups the others never joined (measured: killed at the 90 s bound). The ranks now
    decide on what the program holds: the three fits end alike, the model as it is on every rank."""
    res = run_ranks(SCRIPT, 4, ["--uneven-collection"], tmp_path, timeout=300)
    assert [[f["kept_sharded"] for f in rank] for rank in res] == 4 * [[True, False, False]], res
    sums = {f["checksum"] for rank in res for f in rank[1:]}
    assert len(sums) == 1 and None not in sums, res  # fits 2 and 3: the same model, data and seed, on every rank
