"""The main job through its real entry point (``python -m lightning_mics.app.train``), as a user runs it.

Runs use tiny overrides (one-layer GPT, a few steps, 2 ranks on gloo) and write under pytest's ``tmp_path``.
The configs are also composed in-process for every strategy x trainer option (cheap, no processes).
The installed wheel, run from a folder outside the repository, is tested in ``test_wheel.py``.
"""

from __future__ import annotations

import ast
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


def _run(args: List[str], cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, "-m", "lightning_mics.app.train", *args], cwd=cwd, env=env,
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
    # The unsharded figure is measured on the plain module and optimizer after fit; check it against the
    # parameter count (fp32 under 32-true) and AdamW's two state tensors per parameter, counted independently.
    unsharded = report["model_state"]["unsharded"]
    param_bytes = report["model_params"] * 4
    assert unsharded == {"params": param_bytes, "grads": param_bytes, "optimizer": 2 * param_bytes,
                         "total": 4 * param_bytes}, (unsharded, report["model_params"])
    return report


def test_main_job_mics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run([*TINY, *MICS_TINY, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    report = _check_run_dir(run_dir, out)
    assert report["strategy"] == "MiCSStrategy"
    # per-rank bytes from the strategy: sharded over s=2 (everything but biases and LayerNorms), so each rank
    # holds about half of the unsharded model state
    per_rank = report["model_state"]["per_rank"]
    assert per_rank and len(per_rank) == 2
    full = report["model_state"]["unsharded"]["total"]
    for b in per_rank:
        assert b["total"] == b["params"] + b["grads"] + b["optimizer"]
        assert b["fraction_of_unsharded"] == pytest.approx(b["total"] / full)
        assert 0.45 < b["fraction_of_unsharded"] < 0.6, (per_rank, full)
    # bytes per collective and group per optimizer step, from the strategy's telemetry
    comm = {(c["op"], c["group"]): c for c in report["comm_per_step"]["collectives"]}
    assert comm[("all_gather", "shard")]["bytes"] > 0 and comm[("all_gather", "shard")]["calls"] >= 1
    assert comm[("reduce_scatter", "shard")]["bytes"] > 0
    assert report["comm_per_step"]["steps_sampled"] == report["steps"]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[report]")]
    assert any("model state, rank 1:" in line and "x of" in line and "unsharded" in line for line in printed), printed
    assert any("comm per optimizer step" in line and "all_gather/shard" in line for line in printed), printed
    assert any("tokens/s" in line for line in printed), printed
    md = (run_dir / "report.md").read_text()
    assert "| rank 1 |" in md and "unsharded" in md and "| all_gather | shard |" in md
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "outputs").exists()  # every rank wrote into hydra.run.dir


def test_multirun_sweep_ddp_and_mics(tmp_path: Path) -> None:
    """``-m``: each sweep job launches its own ranks (Lightning re-runs the command) into its own folder."""
    sweep_dir = tmp_path / "sweep"
    proc = _run(["-m", "strategy=ddp,mics", *TINY, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    ddp = _check_run_dir(sweep_dir / "0", out)
    mics = _check_run_dir(sweep_dir / "1", out)
    assert ddp["strategy"] == "DDPStrategy" and mics["strategy"] == "MiCSStrategy"
    # DDP exposes neither per-rank bytes nor telemetry: its report says so instead of failing
    assert ddp["model_state"]["per_rank"] is None and ddp["comm_per_step"] is None
    assert "not exposed by DDPStrategy" in (sweep_dir / "0" / "report.md").read_text()
    assert ddp["model_state"]["unsharded"] == mics["model_state"]["unsharded"]  # same model, same optimizer
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


def test_sharding_degree_must_divide_world(tmp_path: Path) -> None:
    """MiCSStrategy raises ValueError naming the option before any process is launched."""
    proc = _run(["strategy.sharded_data_parallel_degree=3", "trainer.devices=4",
                 f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "sharded_data_parallel_degree" in proc.stderr, proc.stderr[-3000:]
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_console_script_prints_config(tmp_path: Path) -> None:
    """The installed console script (``pip install -e .`` puts it on PATH); a missing one fails the test."""
    script = shutil.which("lightning-mics-train")
    assert script, "lightning-mics-train is not on PATH: install the package (pip install -e .)"
    proc = subprocess.run([script, "--cfg", "job", "strategy.sharded_data_parallel_degree=2",
                           "trainer.devices=4"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded_data_parallel_degree: 2" in proc.stdout and "_target_: lightning_mics.MiCSStrategy" in proc.stdout


# -- every config composes (in-process, no training) ------------------------------------------------------
@pytest.mark.parametrize("strategy", ["mics", "ddp"])
@pytest.mark.parametrize("trainer", ["cpu", "gpu"])
def test_configs_compose(strategy: str, trainer: str) -> None:
    from hydra import compose, initialize_config_module

    from lightning_mics.app.train import CONF_MODULE

    overrides = [f"strategy={strategy}", f"trainer={trainer}", "model.n_layer=6", "trainer.accumulate_grad_batches=4"]
    if strategy == "mics":
        overrides.append("strategy.sharded_data_parallel_degree=2")
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    assert cfg.model.n_layer == 6 and cfg.trainer.accumulate_grad_batches == 4
    assert cfg.data.block_size == cfg.model.block_size
    assert cfg.trainer.accelerator == trainer
    if strategy == "mics":
        from lightning_mics.config import MiCSConfig

        assert set(MiCSConfig.names()) <= set(cfg.strategy.keys())
        assert cfg.strategy.sharded_data_parallel_degree == 2


def test_mics_yaml_instantiates() -> None:
    import hydra
    from hydra import compose, initialize_config_module

    from lightning_mics import MiCSStrategy
    from lightning_mics.app.train import CONF_MODULE

    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy.sharded_data_parallel_degree=2",
                                                       "strategy.shard_units=[lightning_mics.app.models.gpt.Block]"])
    strategy = hydra.utils.instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, MiCSStrategy)
    assert strategy.config.sharded_data_parallel_degree == 2
    assert strategy.config.shard_units == ["lightning_mics.app.models.gpt.Block"]


def test_engine_never_imports_the_app() -> None:
    """The library stands apart from the example app: importing lightning_mics loads nothing of it."""
    code = ("import sys, lightning_mics, triton_kernels; "
            "print(sorted(m for m in sys.modules if m.startswith('lightning_mics.app')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
    # and no engine module imports it anywhere (also inside functions, which the check above cannot see)
    for path in sorted((REPO / "lightning_mics").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = "lightning_mics." * (node.level > 0) + (node.module or "")
                names = [base.rstrip(".")] + [f"{base.rstrip('.')}.{a.name}" for a in node.names]
            else:
                continue
            assert not any(n == "lightning_mics.app" or n.startswith("lightning_mics.app.") for n in names), (
                f"{path.name}:{node.lineno} imports the app: {names}")
