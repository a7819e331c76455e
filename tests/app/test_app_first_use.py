"""The main job as a new user meets it: what it says it read, where it saved, why a run is not sharded, why the
learning rate jumps on a resume, what a failed job leaves in its log, the key a misspelled one meant, and what
``--help`` says about every key.

Real processes through the app's entry point with the tiny overrides of the other app tests (2 ranks on gloo,
forked from the test launcher's preloaded server where what is checked is the answer, not the interpreter's
start; ``--help`` in a fresh interpreter, as a user runs it). The misspelled keys are checked in-process too, through
the same function the entry point calls before Hydra runs.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Dict, List

import pytest
from omegaconf import OmegaConf

from lightning_mics.app.models.lit_gpt import warmup_cosine
from tests.helpers.app import TINY, run_app, run_app_forked

REPO = Path(__file__).resolve().parents[2]


def _lr_at(metrics: Path, step: int) -> float:
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("lr-AdamW/pg1") and int(r["step"]) == step]
    return float(rows[0]["lr-AdamW/pg1"])


def test_a_run_says_what_it_read_where_it_saved_and_what_a_resume_changes(tmp_path: Path) -> None:
    """TINY without the app tests' lower threshold: every tensor of the tiny GPT (the largest, wte, 256 x 32 = 8192
    elements) is under mics.yaml's param_persistence_threshold=10000, so nothing is sharded, and the strategy says
    so. The run then continues to a longer max_steps: the learning rate jumps to the new schedule's, with a word."""
    first, longer = tmp_path / "first", tmp_path / "longer"
    args = [*TINY, "trainer.log_every_n_steps=1", "report=false"]
    proc = run_app_forked([*args, "trainer.max_steps=4", f"hydra.run.dir={first}"], cwd=tmp_path, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # the corpus: the standard library's first .py files, cut by data.max_bytes, and its split
    read = [line for line in proc.stdout.splitlines() if line.startswith("[data] ")]
    assert len(read) == 1, out[-6000:]  # rank 0 only
    assert re.match(r"\[data\] read 300,000 bytes from \d+ files under .+ matching '\*\.py': cut by "
                    r"data\.max_bytes=300000 \(of [\d,]+ matching files, [\d,]+ bytes\); split in pieces of "
                    r"data\.piece_bytes=16384, every 10th to validation \(data\.val_fraction=0\.1\): 283,616 bytes "
                    r"for training \(8,862 blocks of 33 bytes\), 16,384 for validation \(64 of 511 blocks, "
                    r"data\.max_val_blocks=64\)$", read[0]), read[0]
    assert read[0] in (first / "train.log").read_text()
    # nothing sharded: said once, with the figures and the fix
    warned = [line for line in out.splitlines() if "no parameter is sharded" in line]
    assert len(warned) == 1 and "param_persistence_threshold=10000 (the largest has 8192)" in warned[0] and \
        "param_persistence_threshold <= 8192" in warned[0], warned
    # where the checkpoint is, also without the report (report=false)
    last = first / "checkpoints" / "last.ckpt"
    assert last.exists()
    assert (f"[checkpoint] optimizer step 4 saved in {last}; continue with ckpt_path={last} "
            "trainer.max_steps=<more than 4>") in proc.stdout, proc.stdout[-3000:]

    proc = run_app_forked([*args, "trainer.max_steps=8", f"ckpt_path={last}", f"hydra.run.dir={longer}"],
                          cwd=tmp_path, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # the checkpoint's schedule ended at step 4 (3e-3 x 0.1); this run's ends at 8, so step 4 is partway down
    old = 3e-3 * warmup_cosine(4, 2, 4, 0.1)
    new = 3e-3 * warmup_cosine(4, 2, 8, 0.1)
    assert old == pytest.approx(3e-4) and new == pytest.approx(2.325e-3)
    said = [line for line in out.splitlines() if line.startswith("[lr] ")]
    assert len(said) == 1, out[-6000:]
    assert said[0].startswith("[lr] resuming at optimizer step 4 on a learning-rate schedule unlike the "
                              f"checkpoint's (trainer.max_steps 4 -> 8): the learning rate goes from {old:.3g} "
                              f"(the checkpoint's schedule) to {new:.3g} at this step"), said[0]
    assert _lr_at(longer / "csv" / "metrics.csv", 4) == pytest.approx(new, rel=1e-9)  # the step after the resume
    assert _lr_at(longer / "csv" / "metrics.csv", 7) == pytest.approx(3e-3 * warmup_cosine(7, 2, 8, 0.1), rel=1e-9)
    assert f"[checkpoint] optimizer step 8 saved in {longer / 'checkpoints' / 'last.ckpt'}" in proc.stdout


def test_the_data_line_says_what_was_read_and_whether_it_was_cut(tmp_path: Path) -> None:
    """The [data] line's first part for a folder (a binary file left out, a file read in part, files not read)
    and for a single file, whole or cut (in-process: the same Corpus the job lists)."""
    from lightning_mics.app.data import find_corpus

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("a" * 3000)
    (folder / "b.bin").write_bytes(b"\0" * 1000)
    (folder / "c.txt").write_text("c" * 3000)
    (folder / "d.txt").write_text("d" * 3000)
    cut = find_corpus(str(folder), None, 4000)
    assert cut.describe(4000) == (f"read 4,000 bytes from 2 files under {folder} matching '*': cut by "
                                  "data.max_bytes=4000 (of 4 matching files, 10,000 bytes, 1 binary file left out)")
    whole = find_corpus(str(folder), "*.txt", 10_000)
    assert whole.describe(10_000) == f"read 9,000 bytes from 3 files under {folder} matching '*.txt': all of it, " \
                                     "under data.max_bytes=10000"
    one = folder / "a.txt"
    assert find_corpus(str(one), None, 1000).describe(1000) == \
        f"read 1,000 bytes from {one}: cut by data.max_bytes=1000 (of its 3,000 bytes)"
    assert find_corpus(str(one), None, 3000).describe(3000) == \
        f"read 3,000 bytes from {one}: all of it, under data.max_bytes=3000"


def test_a_failed_job_leaves_its_error_in_every_rank_log(tmp_path: Path) -> None:
    """A mistake found only once the ranks run (a batch larger than a rank's share of the corpus): each rank's log
    file holds the error with its traceback, not only the lines before it."""
    run_dir = tmp_path / "run"
    proc = run_app_forked([*TINY, "data.batch_size=5000", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=150)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    for log in ("train.log", "train_ddp_process_1.log"):
        text = (run_dir / log).read_text()
        assert "[ERROR] - the job failed:\nTraceback (most recent call last):" in text, text[-3000:]
        assert "CorpusError: data.path=None gives 8862 training blocks, 4431 per rank on 2 ranks: fewer than one " \
               "batch of data.batch_size=5000" in text, text[-3000:]


# -- a misspelled key -----------------------------------------------------------------------------------------
EXAMPLE = str(REPO / "examples" / "custom_module" / "conf")


@pytest.mark.parametrize("argv, answer", [
    (["model.n_layr=3"], "model.n_layr=3: the config has no key model.n_layr; did you mean model.n_layer=3?"),
    (["trainer.max_step=10"], "did you mean trainer.max_steps=10?"),
    (["modle.n_layer=3"], "modle.n_layer=3: the config has no key modle.n_layer; did you mean model.n_layer=3?"),
    (["sed=7"], "did you mean seed=7?"),
    (["strategy=ddp", "strategy.find_unused_parameter=true"], "did you mean strategy.find_unused_parameters=true?"),
    (["-m", "model.n_layr=1,2"], "did you mean model.n_layer=1,2?"),
    (["strategy.prefetch=2", "data.batch_sise=4", "model.n_layr=2"],
     "data.batch_sise=4: the config has no key data.batch_sise; did you mean data.batch_size=4?\nmodel.n_layr=2"),
    (["--config-dir", EXAMPLE, "model=regressor", "data=teacher", "model.widht=64"], "did you mean model.width=64?"),
])
def test_a_misspelled_key_is_answered_with_the_key_meant(argv: List[str], answer: str) -> None:
    from lightning_mics.app.keys import check_keys
    from lightning_mics.app.train import CONF_MODULE

    with pytest.raises(SystemExit) as err:
        check_keys(argv, CONF_MODULE)
    assert answer in str(err.value), str(err.value)
    assert "+" not in str(err.value).split("?")[0]  # not Hydra's advice to append the key


@pytest.mark.parametrize("argv", [
    ["model.n_layer=3", "trainer=gpu", "strategy.sharded_data_parallel_degree=2"],  # nothing wrong
    ["+trainer.limit_val_batches=8"],  # a key added on purpose
    ["trainer.limit_val_batches=8"],  # no close key: Hydra's advice (append with +) is the right one
    ["model.n_layer=abc"],  # a wrong value: the schema answers it
    ["--config-dir", EXAMPLE, "model=regressor", "data=teacher", "model.width=64"],
])
def test_other_overrides_are_left_to_hydra(argv: List[str]) -> None:
    from lightning_mics.app.keys import check_keys
    from lightning_mics.app.train import CONF_MODULE

    assert check_keys(argv, CONF_MODULE) is None


# -- --help ---------------------------------------------------------------------------------------------------
def _described(help_text: str) -> Dict[str, List[str]]:
    """``group.key`` -> the defaults the help shows for it, for every key line that carries a description."""
    out: Dict[str, List[str]] = {}
    for line in help_text.splitlines():
        m = re.match(r"^  ([a-z_]+\.[a-z_.]+)=(\S.*?)\s{2,}(\S.*)$", line)
        if m and m.group(3) != "(no description)":
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def test_help_says_what_every_key_means(tmp_path: Path) -> None:
    """Every key of every option of the strategy, model, data and trainer groups, as Hydra composes them, appears
    in ``--help`` with a description, and each option's own defaults are the ones shown; ``trainer=gpu`` is
    offered with what it does."""
    from hydra import compose, initialize_config_module

    from lightning_mics.app.help import GROUPS, options
    from lightning_mics.app.train import CONF_MODULE

    proc = run_app(["--help"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    described = _described(proc.stdout)
    missing, wrong = [], []
    for group in GROUPS:
        for option in options(group):
            with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
                node = compose(config_name="config", overrides=[f"{group}={option}"])[group]
            own = OmegaConf.load(REPO / "conf" / group / f"{option}.yaml")
            for key in node:
                if key == "_target_":
                    continue
                shown = described.get(f"{group}.{key}")
                if not shown:
                    missing.append(f"{group}={option}: {key}")
                elif key in own and not OmegaConf.is_interpolation(own, key) and \
                        not any(OmegaConf.create(f"v: {s}").v == node[key] for s in shown):
                    wrong.append(f"{group}={option}: {key}={node[key]!r}, shown {shown}")
    assert not missing and not wrong, (missing, wrong)
    assert re.search(r"^  trainer=gpu +GPU: NCCL, one process per GPU, bf16 autocast", proc.stdout, re.M), proc.stdout
    assert "trainer: cpu, gpu" in proc.stdout and "strategy: ddp, mics" in proc.stdout  # Hydra's own list of choices
    assert "$" not in proc.stdout.replace("$HOME", "").replace("${model.block_size}", "")  # every $ substituted
