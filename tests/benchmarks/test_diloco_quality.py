"""benchmarks/diloco_quality.py without its jobs: the overrides each run name gives the main job, a wrong name
refused, and the table it writes from the jobs' reports (the jobs themselves run for minutes: see benchmarks/LOG.md)."""

import importlib.util

import pytest

from tests.helpers.launch import REPO

spec = importlib.util.spec_from_file_location("diloco_quality", REPO / "benchmarks" / "diloco_quality.py")
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


def test_run_names_become_the_main_jobs_overrides():
    base = quality.overrides("exact", 96, 32)
    assert "strategy.sharded_data_parallel_degree=2" in base and "trainer.devices=4" in base
    assert not any("replica_sync" in o for o in base)
    run = quality.overrides("diloco:16:int8:lr=1:momentum=0", 96, 32)
    assert run[len(base):] == ["strategy.replica_sync=diloco", "strategy.sync_every=16",
                               "strategy.quantize_gradients=true", "strategy.outer_lr=1.0",
                               "strategy.outer_momentum=0.0", "strategy.outer_nesterov=false"]
    run = quality.overrides("diloco:16:fragments=4:delay=1:mixing=0.5", 96, 32)
    assert run[len(base):] == ["strategy.replica_sync=diloco", "strategy.sync_every=16", "strategy.sync_fragments=4",
                               "strategy.sync_delay=1", "strategy.fragment_mixing=0.5"]
    assert quality.syncs("diloco:16:fragments=4:delay=1", 96) == 24  # one fragment's all-reduce every 4 steps
    for bad in ("diloco", "diloco:x", "diloco:4:fp8", "local:4", "diloco:4:fragments=", "diloco:4:fragments=two",
                "diloco:4:delay=0.5"):
        with pytest.raises(SystemExit):
            quality.overrides(bad, 96, 32)


def test_table_at_equal_tokens():
    reports = {"exact": {"val_loss_history": [[31, 3.0], [63, 2.0]], "val_loss_final": 2.0, "tokens": 100,
                         "steps": 64},
               "diloco:16": {"val_loss_history": [[31, 3.5], [63, 2.2]], "val_loss_final": 2.2, "tokens": 100,
                             "steps": 64}}
    lines = quality.table(["exact", "diloco:16"], reports).splitlines()
    assert lines[0].startswith("| run | tokens | val loss @ step 32 | val loss @ step 64 |")
    assert lines[2] == "| exact | 100 | 3.0000 | 2.0000 | +0.0% | 64 |"
    assert lines[3] == "| diloco:16 | 100 | 3.5000 | 2.2000 | +10.0% | 4 |"
