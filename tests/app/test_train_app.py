"""The main job through its real entry point (``python -m lightning_mics.app.train``), as a user runs it.

Runs use tiny overrides (one-layer GPT, a few steps, 2 ranks on gloo) and write under pytest's ``tmp_path``.
The configs are also composed in-process for every strategy x trainer option (cheap, no processes).
The installed wheel, run from a folder outside the repository, is tested in ``test_wheel.py``.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers.app import COMMAND, MICS_TINY, TINY, app_env, run_app as _run, run_app_forked

REPO = Path(__file__).resolve().parents[2]


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
    # every value in the report carries its unit
    other = [line for line in md.splitlines() if line.startswith("- mem/") or line.startswith("- time/")]
    assert other and all(line.endswith(("B", "KiB", "MiB", "GiB", " s", " ms", "elements")) for line in other), other
    # Lightning's messages reach the run's logs (rank 0: train.log; rank 1: its own), with the report
    train_log = (run_dir / "train.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 0" in train_log and "[report] model state, rank 1:" in train_log
    assert "Initializing distributed: GLOBAL_RANK: 1" in (run_dir / "train_ddp_process_1.log").read_text()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """``-m strategy=ddp,mics`` once for the module, with the gloo-thread probe loaded in every rank
    (``sitecustomize``, see test_every_rank_ends_with_its_gloo_threads_joined): what the sweep writes and how
    its ranks end are two tests of one run. Returns (the folder it ran in, its CompletedProcess, the probe's
    folder)."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    probe_dir = _probe(tmp_path)
    env = app_env()
    env["PYTHONPATH"] = f"{probe_dir}:{env.get('PYTHONPATH', '')}".rstrip(":")
    env["GLOO_PROBE_DIR"] = str(probe_dir)
    proc = _run(["-m", "strategy=ddp,mics", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path,
                timeout=240, env=env)
    return tmp_path, proc, probe_dir


def test_multirun_sweep_ddp_and_mics(sweep) -> None:
    """``-m``: each sweep job launches its own ranks (Lightning re-runs the command) into its own folder."""
    tmp_path, proc, _ = sweep
    sweep_dir = tmp_path / "sweep"
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
    # the sweep ends with a comparison of its jobs: one row per job, the override that differs, its figures
    table = [line for line in (sweep_dir / "sweep.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 3, table
    assert table[1].startswith("| 0 | strategy=ddp | DDPStrategy | 2 | 24 |")
    assert f"{ddp['val_loss_final']:.4f}" in table[1]
    assert table[2].startswith("| 1 | strategy=mics | MiCSStrategy | 2 | 24 |") and "tokens/s" in table[2]
    assert (sweep_dir / "sweep.png").stat().st_size > 1000
    assert "[sweep] 2 jobs compared" in proc.stdout


def _params(ckpt: Path) -> dict:
    dcp_to_torch_save(ckpt, ckpt.parent / "whole.pt")
    return torch.load(ckpt.parent / "whole.pt", weights_only=False)["state_dict"]


def test_model_compile_compiles_each_block_in_place() -> None:
    """``model.compile=true`` (conf/model/gpt.yaml, composed as the job composes it): every transformer block is
    compiled in place, so the parameter names, and so the checkpoints, are the eager model's."""
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    from lightning_mics.app.train import CONF_MODULE

    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        compiled, eager = (compose(config_name="config", overrides=[f"model.compile={c}", "model.n_layer=2"]).model
                           for c in ("true", "false"))
    compiled, eager = instantiate(compiled), instantiate(eager)
    assert all(block._compiled_call_impl is not None for block in compiled.model.h)
    assert all(block._compiled_call_impl is None for block in eager.model.h)
    assert list(compiled.state_dict()) == list(eager.state_dict())


@pytest.mark.slow
def test_main_job_compiled_blocks(tmp_path: Path) -> None:
    """``model.compile=true`` with activation checkpointing: each block compiled in place (inductor writes its
    kernels into the cache folder given), the checkpoint's parameter names are the eager run's, and it trains as
    the eager run does up to compile's rounding (measured: 4e-6 at most after 24 steps).

    Deselected by default (``-m slow`` runs it): a cold inductor compile in a folder of its own took 51-194 s of the
    suite. The default run covers what it checks: test_model_compile_compiles_each_block_in_place (the job's key
    compiles each block in place, the names stay the eager model's) and tests/engine/test_compile.py's
    ``test_compiled_model_with_activation_checkpointing[trainer-inplace-group2]`` (blocks compiled in place,
    grouped checkpointing, under the Trainer and MiCS: inductor's graphs built, nothing recompiled, the parameters
    equal compiled DDP's, names included)."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["model.compile=true"])):
        env = {**app_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
        args = [*TINY, *MICS_TINY, "strategy.activation_checkpointing=[lightning_mics.app.models.gpt.Block]",
                *extra, f"hydra.run.dir={tmp_path / name}"]
        proc = subprocess.run([*COMMAND, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        runs[name] = _params(tmp_path / name / "checkpoints" / "last.ckpt")
    kernels = list((tmp_path / "inductor-compiled").rglob("*.py"))
    assert kernels and not list((tmp_path / "inductor-eager").rglob("*.py")), kernels
    eager, compiled = runs["eager"], runs["compiled"]
    assert sorted(compiled) == sorted(eager) and not any("_orig_mod" in n for n in compiled), sorted(compiled)
    for n, want in eager.items():
        assert (compiled[n] - want).abs().max().item() <= 1e-4, n


@pytest.mark.parametrize(
    "override, message",
    [
        ("strategy.no_such_option=1", "no_such_option"),
        ("strategy.prefetch=abc", "strategy.prefetch"),
        ("model.n_layr=3", "model.n_layr=3: the config has no key model.n_layr; did you mean model.n_layer=3?"),
    ],
)
def test_bad_override_fails_at_compose(tmp_path: Path, override: str, message: str) -> None:
    """(Forked from the preloaded server, as in test_app_checks.py: the answer is what is checked.) A misspelled
    key is answered with the key meant, instead of Hydra's advice to add it with + ([Note: did you mean])."""
    proc = run_app_forked([override, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "To append to your config use +model.n_layr" not in proc.stderr
    assert not (tmp_path / "run" / "csv").exists()  # nothing ran


def test_sharding_degree_must_divide_world(tmp_path: Path) -> None:
    """MiCSStrategy raises ValueError naming the option before any process is launched (forked, as above)."""
    proc = run_app_forked(["strategy.sharded_data_parallel_degree=3", "trainer.devices=4",
                 f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "sharded_data_parallel_degree" in proc.stderr, proc.stderr[-3000:]
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    # and the job's log holds the error, with its traceback, not only the lines before it
    log = (tmp_path / "run" / "train.log").read_text()
    assert "the job failed:\nTraceback" in log and "sharded_data_parallel_degree=3 is invalid" in log, log[-3000:]


def test_help_lists_only_real_choices(tmp_path: Path) -> None:
    """The schemas live outside the config groups, so ``--help`` offers only configs a user can pick (what it says
    of each key: test_app_first_use.py, whose ``--help`` starts fresh, as a user types it; this one is forked from
    the preloaded server: the answer is what is checked)."""
    proc = run_app_forked(["--help"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Keys ==")[0]
    assert "strategy: ddp, mics" in groups and "trainer: cpu, gpu" in groups and "model: gpt" in groups, groups
    assert "schema" not in groups, groups


def test_console_script_prints_config(tmp_path: Path) -> None:
    """The installed console script (``pip install -e .`` puts it on PATH); a missing one fails the test."""
    script = shutil.which("lightning-mics-train")
    assert script, "lightning-mics-train is not on PATH: install the package (pip install -e .)"
    proc = subprocess.run([script, "--cfg", "job", "strategy.sharded_data_parallel_degree=2",
                           "trainer.devices=4"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
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
    assert cfg.ckpt_path is None
    # the trainer, model and data groups are typed by their schemas, and every value the YAMLs set passes the
    # checks their types cannot express
    from omegaconf import OmegaConf

    from lightning_mics.app import schema

    assert [OmegaConf.get_type(cfg[g]).__name__ for g in ("trainer", "model", "data")] == [
        "TrainerConf", "LitGPTConf", "ByteCorpusConf"]
    schema.check_config(cfg)
    if strategy == "mics":
        from lightning_mics.options import MiCSConfig

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
    assert strategy.options.sharded_data_parallel_degree == 2
    assert strategy.options.shard_units == ("lightning_mics.app.models.gpt.Block",)


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


_PROBE = '''
import atexit, json, os

def _gloo_threads_at_exit():  # registered before anything else, so it runs after every other atexit handler
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:
            pass
    path = os.path.join(os.environ["GLOO_PROBE_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"local_rank": os.environ.get("LOCAL_RANK", "0"), "threads": [n for n in names if "gloo" in n]}, f)

atexit.register(_gloo_threads_at_exit)
'''


def _probe(tmp_path: Path) -> Path:
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(_PROBE)
    return probe_dir


@pytest.mark.parametrize("sweep_run", [False, True], ids=["run", "sweep"])
def test_every_rank_ends_with_its_gloo_threads_joined(sweep, tmp_path: Path, sweep_run: bool) -> None:
    """[Note: every rank releases its groups]: a gloo worker thread still alive when the interpreter finalizes can
    abort the rank (-6), and Lightning's launcher then kills the job. Every rank of every job -- DDP's too, which
    leaves its group alive -- must have joined its gloo threads by the end of its last atexit handler (a probe
    loaded through ``sitecustomize`` before the job records them). The sweep is the module's ``sweep`` fixture
    (test_multirun_sweep_ddp_and_mics's run, 24 steps with its checkpoints and reports; both cases take it, so
    that xdist keeps them with the module's other user of it); the run is DDP's alone."""
    if sweep_run:
        _, proc, probe_dir = sweep
    else:
        probe_dir = _probe(tmp_path)
        env = app_env()
        env["PYTHONPATH"] = f"{probe_dir}:{env.get('PYTHONPATH', '')}".rstrip(":")
        env["GLOO_PROBE_DIR"] = str(probe_dir)
        steps = ["trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.checkpoint=null", "report=false"]
        proc = _run(["strategy=ddp", f"hydra.run.dir={tmp_path / 'run'}", *TINY, *steps], cwd=tmp_path,
                    timeout=240, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = [json.loads(p.read_text()) for p in probe_dir.glob("*.json")]
    # one process for rank 0 (both jobs of a sweep), one for each job's rank 1
    assert sorted(r["local_rank"] for r in records) == (["0", "1", "1"] if sweep_run else ["0", "1"]), records
    assert all(r["threads"] == [] for r in records), records
