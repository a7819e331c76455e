"""The package as users install it: a wheel in a fresh virtual environment, run from a folder of their own.

One module-scoped fixture builds the wheel from a copy of the source tree (so a stale ``build/`` in the
checkout cannot leak into it), checks what it holds, and installs it with pip into a new ``python -m venv``
under the CPU torch constraint. The venv sees the system's site-packages (torch, Lightning and Hydra are not
downloaded again), but the package itself must come from the wheel: every test asserts that
``lightning_mics`` and its configs are imported from inside the venv. The commands run from a temporary
folder outside the repository, with no ``PYTHONPATH``, through the venv's own ``lightning-mics-train``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest

REPO = Path(__file__).resolve().parents[2]
# The TINY overrides of test_train_app.py (one-layer GPT, 2 ranks), cut to 2 optimizer steps.
TINY_2_STEPS = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.warmup_steps=2",
    "data.max_bytes=300000", "data.batch_size=8", "data.max_val_blocks=64",
    "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "trainer.devices=2",
    "callbacks.progress_bar.refresh_rate=0", "strategy.param_persistence_threshold=1000",
]
_LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")


def _sh(args: List[str], cwd: Path, env: Dict[str, str] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


def _source_copy(dst: Path) -> None:
    """The files a build reads: pyproject, README, the packages and conf/ (no caches, no build outputs)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    for name in ("lightning_mics", "triton_kernels", "conf"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)


class Installed:
    def __init__(self, root: Path, wheel: Path) -> None:
        self.root = root
        self.wheel = wheel
        self.venv = root / "venv"
        self.bin = self.venv / "bin"
        self.python = self.bin / "python"
        self.script = self.bin / "lightning-mics-train"
        self.env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(self.venv),
                        PYTHONUNBUFFERED="1")

    def user_dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir()
        assert REPO not in d.resolve().parents
        return d


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    _source_copy(src)
    dist = root / "dist"
    # --no-build-isolation: build with this interpreter's setuptools (the [dev] extra pins it), no download
    _sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src], cwd=root)
    (wheel,) = dist.glob("lightning_mics-*.whl")
    inst = Installed(root, wheel)
    _sh([sys.executable, "-m", "venv", "--system-site-packages", inst.venv], cwd=root)
    _sh([inst.python, "-m", "pip", "install", "-c", REPO / "constraints-cpu.txt", wheel], cwd=root, env=inst.env)
    return inst


def test_wheel_holds_every_module_and_config(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "lightning_mics").rglob("*.py")
                if "__pycache__" not in p.parts}
    expected |= {"lightning_mics_kernels/" + p.relative_to(REPO / "triton_kernels").as_posix()
                 for p in (REPO / "triton_kernels").rglob("*.py") if "__pycache__" not in p.parts}
    expected |= {"lightning_mics/app/conf/" + p.relative_to(REPO / "conf").as_posix()
                 for p in (REPO / "conf").rglob("*") if p.suffix in (".yaml", ".py")}
    assert "lightning_mics/app/conf/config.yaml" in expected and "lightning_mics/app/conf/strategy/mics.yaml" in expected
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith(("conf/", "tests/", "lightning_mics/conf/", "triton_kernels/")) for n in names), \
        sorted(names)  # no top-level triton_kernels: triton's own repository ships a package of that name
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "lightning-mics-train = lightning_mics.app.train:main" in zipfile.ZipFile(installed.wheel).read(
        entry_points).decode()


def test_installed_package_comes_from_the_wheel(installed: Installed) -> None:
    code = ("import importlib.resources as r, lightning_mics, lightning_mics.app.train as t; "
            "print(lightning_mics.__file__); print(r.files(t.CONF_MODULE).joinpath('config.yaml'))")
    proc = _sh([installed.python, "-c", code], cwd=installed.user_dir("imports"), env=installed.env)
    package_file, config_yaml = (Path(line) for line in proc.stdout.split())
    site = installed.venv.resolve()
    assert site in package_file.resolve().parents, package_file
    assert site in config_yaml.resolve().parents and config_yaml.is_file(), config_yaml


def test_installed_beside_another_triton_kernels_both_import(installed: Installed) -> None:
    """Triton's repository ships a package named ``triton_kernels`` (vLLM installs it): the wheel claims no such
    top-level name, so with one installed beside it both import, each its own."""
    site = installed.user_dir("other_site")
    (site / "triton_kernels").mkdir()
    (site / "triton_kernels" / "__init__.py").write_text("OTHER = 'triton-lang/triton_kernels'\n")
    code = ("import triton_kernels, lightning_mics_kernels, lightning_mics; "
            "print(triton_kernels.OTHER); print(lightning_mics_kernels.__file__); print(lightning_mics.__file__)")
    env = dict(installed.env, PYTHONPATH=str(site))
    proc = _sh([installed.python, "-c", code], cwd=installed.user_dir("both"), env=env)
    other, ours, package = proc.stdout.split()
    assert other == "triton-lang/triton_kernels"
    assert installed.venv.resolve() in Path(ours).resolve().parents, ours
    assert installed.venv.resolve() in Path(package).resolve().parents, package


def test_console_script_prints_config_from_any_folder(installed: Installed) -> None:
    proc = _sh([installed.script, "--cfg", "job"], cwd=installed.user_dir("cfg"), env=installed.env, timeout=120)
    assert "_target_: lightning_mics.MiCSStrategy" in proc.stdout
    assert "_target_: lightning_mics.app.models.lit_gpt.LitGPT" in proc.stdout
    assert "_target_: lightning_mics.app.data.ByteCorpusDataModule" in proc.stdout


def test_two_step_run_writes_its_report(installed: Installed) -> None:
    """The main job with its default output folder (``outputs/<date>/<time>/`` under the working folder)."""
    cwd = installed.user_dir("run")
    proc = _sh([installed.script, *TINY_2_STEPS], cwd=cwd, env=installed.env)
    (run_dir,) = cwd.glob("outputs/*/*")
    for name in ("report.json", "report.md", "loss.png", "csv/metrics.csv", "checkpoints/last.ckpt/meta.pt"):
        assert (run_dir / name).is_file(), f"{name} missing\n{(proc.stdout + proc.stderr)[-4000:]}"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["strategy"] == "MiCSStrategy" and report["steps"] == 2 and report["world_size"] == 2
    assert report["tokens_per_second"] > 0 and report["val_loss_final"] is not None
    assert len(report["model_state"]["per_rank"]) == 2 and report["comm_per_step"]["collectives"]
    assert "[report] model state, rank 0:" in proc.stdout


def test_users_own_module_and_data_from_config_dir(installed: Installed) -> None:
    """README's example: a user's LightningModule and data module (examples/custom_module) selected with
    ``--config-dir``, the strategy's options as overrides; run from a copy of that folder."""
    cwd = installed.user_dir("custom")
    shutil.copytree(REPO / "examples" / "custom_module", cwd, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    proc = _sh([installed.python, "-m", "lightning_mics.app.train", "--config-dir", "conf", "model=regressor",
                "data=teacher", "strategy.sharded_data_parallel_degree=2", "trainer.devices=2",
                "trainer.max_steps=16", "trainer.val_check_interval=8", "callbacks.progress_bar.refresh_rate=0",
                "hydra.run.dir=run"], cwd=cwd, env=installed.env)
    report = json.loads((cwd / "run" / "report.json").read_text())
    assert report["strategy"] == "MiCSStrategy" and report["steps"] == 16
    assert report["model"] == "my_project.Regressor" and report["world_size"] == 2
    history = [loss for _, loss in report["val_loss_history"]]
    assert len(history) == 2 and history[-1] < history[0], history
    assert report["tokens_per_second"] is None and report["samples_per_second"] > 0  # float inputs: no tokens
    for rank in report["model_state"]["per_rank"]:
        assert rank["fraction_of_unsharded"] < 0.6, report["model_state"]  # the 256x256 blocks are sharded
    assert "samples/s" in proc.stdout
