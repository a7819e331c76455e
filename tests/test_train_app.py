"""The main job through its real entry point (``python -m lightning_mics.train``), as a user runs it.

Runs use tiny overrides (one-layer GPT, a few steps, 2 ranks on gloo) and write under pytest's ``tmp_path``.
The configs are also composed in-process for every strategy x trainer option (cheap, no processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]

# A model small enough to train in seconds, but with matrices above the persistence threshold so that
# MiCS really shards them (n_embd=32: c_fc 32x128 = 4096 elements > 1000).
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.warmup_steps=2",
    "data.max_bytes=300000", "data.batch_size=8", "data.max_val_blocks=64",
    "trainer.max_steps=24", "trainer.val_check_interval=8", "trainer.log_every_n_steps=2", "trainer.devices=2",
    "callbacks.progress_bar.refresh_rate=0",
]
MICS_TINY = ["strategy.param_persistence_threshold=1000"]


def _mics_available() -> bool:
    try:
        from lightning_mics import MiCSStrategy  # noqa: F401
    except ImportError:
        return False
    return True


needs_mics = pytest.mark.skipif(not _mics_available(), reason="written against MiCSStrategy, not importable")


def _run(args: List[str], cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, "-m", "lightning_mics.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _check_run_dir(run_dir: Path, out: str) -> dict:
    for name in ("report.json", "report.md", "loss.png", "csv/metrics.csv"):
        assert (run_dir / name).is_file(), f"{name} missing in {run_dir}\n{out[-3000:]}"
    assert (run_dir / "loss.png").stat().st_size > 1000
    report = json.loads((run_dir / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 24
    history = [loss for _, loss in report["val_loss_history"]]
    assert len(history) == 3, history
    assert history[-1] < history[0] - 0.1, f"validation loss did not fall: {history}"
    assert report["tokens_per_second"] and report["tokens_per_second"] > 0
    return report


@needs_mics
def test_main_job_mics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run([*TINY, *MICS_TINY, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    report = _check_run_dir(run_dir, out)
    assert report["strategy"] == "MiCSStrategy"
    # per-rank bytes from the strategy: sharded over s=2, so each rank holds less than the full model
    per_rank = report["model_state_bytes_per_rank"]
    assert per_rank and len(per_rank) == 2
    full_param_bytes = report["model_params"] * 4
    assert all(b["params"] < full_param_bytes for b in per_rank), (per_rank, full_param_bytes)
    assert "[report]" in proc.stdout and "model-state bytes" in proc.stdout
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "outputs").exists()  # every rank wrote into hydra.run.dir


def test_multirun_sweep_ddp_and_mics(tmp_path: Path) -> None:
    """``-m``: each sweep job launches its own ranks (Lightning re-runs the command) into its own folder."""
    strategies = "ddp,mics" if _mics_available() else "ddp"
    sweep_dir = tmp_path / "sweep"
    proc = _run(["-m", f"strategy={strategies}", *TINY, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    names = ["DDPStrategy", "MiCSStrategy"][: len(strategies.split(","))]
    for job, name in enumerate(names):
        report = _check_run_dir(sweep_dir / str(job), out)
        assert report["strategy"] == name
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("strategy.no_such_option=1", "no_such_option"),
        ("strategy.prefetch=abc", "strategy.prefetch"),
        ("model.n_layr=3", "n_layr"),
    ],
)
def test_bad_override_fails_at_compose(tmp_path: Path, override: str, message: str) -> None:
    proc = _run([override, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "csv").exists()  # nothing ran


@needs_mics
def test_sharding_degree_must_divide_world(tmp_path: Path) -> None:
    """MiCSStrategy raises ValueError naming the option before any process is launched."""
    proc = _run(["strategy.sharded_data_parallel_degree=3", "trainer.devices=4",
                 f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "sharded_data_parallel_degree" in proc.stderr, proc.stderr[-3000:]
    assert "Initializing distributed" not in proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("lightning-mics-train") is None, reason="console script not installed")
def test_console_script_prints_config(tmp_path: Path) -> None:
    proc = subprocess.run(["lightning-mics-train", "--cfg", "job", "strategy.sharded_data_parallel_degree=2",
                           "trainer.devices=4"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded_data_parallel_degree: 2" in proc.stdout and "_target_: lightning_mics.MiCSStrategy" in proc.stdout


# -- every config composes (in-process, no training) ------------------------------------------------------
@pytest.mark.parametrize("strategy", ["mics", "ddp"])
@pytest.mark.parametrize("trainer", ["cpu", "gpu"])
def test_configs_compose(strategy: str, trainer: str) -> None:
    from hydra import compose, initialize_config_dir

    from lightning_mics.train import CONF_DIR

    overrides = [f"strategy={strategy}", f"trainer={trainer}", "model.n_layer=6", "trainer.accumulate_grad_batches=4"]
    if strategy == "mics":
        overrides.append("strategy.sharded_data_parallel_degree=2")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    assert cfg.model.n_layer == 6 and cfg.trainer.accumulate_grad_batches == 4
    assert cfg.data.block_size == cfg.model.block_size
    assert cfg.trainer.accelerator == trainer
    if strategy == "mics":
        from lightning_mics.config import MiCSConfig

        assert set(MiCSConfig.names()) <= set(cfg.strategy.keys())
        assert cfg.strategy.sharded_data_parallel_degree == 2


@needs_mics
def test_mics_yaml_instantiates() -> None:
    import hydra
    from hydra import compose, initialize_config_dir

    from lightning_mics import MiCSStrategy
    from lightning_mics.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy.sharded_data_parallel_degree=2",
                                                       "strategy.shard_units=[lightning_mics.models.gpt.Block]"])
    strategy = hydra.utils.instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, MiCSStrategy)
    assert strategy.config.sharded_data_parallel_degree == 2
    assert strategy.config.shard_units == ["lightning_mics.models.gpt.Block"]
