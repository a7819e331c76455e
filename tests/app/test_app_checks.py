"""Mistakes a user makes on the main job's command line are answered before any rank starts, in one message
that names the key, what was found and the fix; the job exits non-zero and writes nothing but Hydra's folder.

Each case runs the entry point's module (``python -m lightning_mics.app.train``) with the tiny overrides of the
other app tests, so a mistake the checks missed would start two ranks and train (and fail these assertions). The
process is forked from the test launcher's server, which has imported torch, Lightning and Hydra
(``run_app_forked``): what is checked is the answer, not the interpreter's start, which cost 10 of each case's
12 s. Mistakes through a fresh interpreter are in ``test_bad_inputs.py`` (its ``app-*`` cases), and through the
installed script in ``test_wheel.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict

import pytest

from tests.helpers.app import TINY, run_app_forked


def _empty_file(d: Path) -> str:
    (d / "empty.txt").write_bytes(b"")
    return "empty.txt"


def _empty_folder(d: Path) -> str:
    (d / "texts").mkdir()
    return "texts"


def _binary_folder(d: Path) -> str:
    (d / "blobs").mkdir()
    (d / "blobs" / "a.bin").write_bytes(bytes(range(256)) * 40)
    (d / "blobs" / "b.pt").write_bytes(b"PK\x03\x04\x00\x00" + b"x" * 5000)
    return "blobs"


def _binary_file(d: Path) -> str:
    (d / "model.bin").write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)) * 400)  # a zip/torch.save archive's start
    return "model.bin"


def _small_file(d: Path) -> str:
    (d / "note.txt").write_text("a few words of text\n" * 50)  # 1000 bytes: less than 9 pieces + one block
    return "note.txt"


CORPUS: Dict[str, Callable[[Path], str]] = {"empty_file": _empty_file, "empty_folder": _empty_folder,
                                            "binary_folder": _binary_folder, "binary_file": _binary_file,
                                            "small_file": _small_file}

CASES = [
    # (override, what the message must say)
    ("data.path=no_such_dir", ["data.path='no_such_dir'", "no such file or folder"]),
    ("data.path={empty_file}", ["data.path='empty.txt'", "empty file", "Give a file with text"]),
    ("data.path={empty_folder}", ["data.path='texts'", "empty folder", "Put text files in it"]),
    ("data.path={binary_folder}", ["data.path='blobs'", "2 files", "all binary", "a.bin, b.pt"]),
    ("data.path={binary_file}", ["data.path='model.bin' is a binary file (a NUL byte in its first 8 KiB, 102406 "
                                 "bytes)", "point data.path at a text file, or at a folder of text files"]),
    ("data.path={small_file}", ["data.path='note.txt'", "1000 bytes", "too small to split", "data.piece_bytes=",
                                "needs at least 147489 bytes"]),
    ("data.path=~/my_texts", ["data.path=~/my_texts", "Write data.path=$HOME/my_texts"]),
    ("trainer.max_steps=abc", ["full_key: trainer.max_steps", "could not be converted to Integer"]),
    ("trainer.devices=two", ["trainer.devices='two'", "a number of devices"]),
    ("model.n_layer=1.5", ["full_key: model.n_layer", "could not be converted to Integer"]),
    ("ckpt_path=no_such.ckpt", ["ckpt_path='no_such.ckpt'", "no such checkpoint"]),
]


@pytest.mark.parametrize("override, expected", CASES, ids=[c[0].split("{")[-1].rstrip("}") for c in CASES])
def test_mistake_is_answered_before_any_rank_starts(tmp_path: Path, override: str, expected: list) -> None:
    names = {key: make(tmp_path) for key, make in CORPUS.items() if "{" + key + "}" in override}
    run_dir = tmp_path / "run"
    proc = run_app_forked([*TINY, override.format(**names), f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # one message, not a stack per rank
    # no rank was launched and nothing trained: Lightning logs every rank's start, the logger and checkpoint folders
    assert "Initializing distributed" not in out and "[rank: 1]" not in out, out[-3000:]
    assert not (run_dir / "csv").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("override, message", [
    ("trainer.precision=bf32", "trainer.precision='bf32' is not valid: expected 64, 32, 16, 'transformer-engine'"),
    ("trainer.devices=[0,x]", "trainer.devices=[0, 'x'] is not valid: expected list of int, str or int"),
    ("trainer.devices=0", "trainer.devices=0 is not valid: expected a number of devices"),
    ("trainer.gradient_clip_val=big", "trainer.gradient_clip_val='big' is not valid: expected float or null"),
    ("trainer.deterministic=maybe", "trainer.deterministic='maybe' is not valid: expected bool, 'warn' or null"),
])
def test_values_the_types_let_through_are_checked(override: str, message: str) -> None:
    """Trainer arguments whose annotation is a union or a Literal have no OmegaConf type; check_config checks
    them against the annotation (in-process: the same function the job calls before launching)."""
    from hydra import compose, initialize_config_module

    from lightning_mics.app import schema
    from lightning_mics.app.train import CONF_MODULE

    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[override])
    with pytest.raises(schema.UsageError) as err:
        schema.check_config(cfg)
    assert str(err.value).startswith(message), str(err.value)
    for good in ("trainer.devices=auto", "trainer.devices=-1", "trainer.devices=[0,1]", "trainer.devices='0,1'",
                 "trainer.precision=16", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=null",
                 "trainer.val_check_interval=0.5", "trainer.deterministic=warn"):
        with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
            schema.check_config(compose(config_name="config", overrides=[good]))


def test_corpus_checks_name_the_fix_that_works(tmp_path: Path) -> None:
    """The "too small" message proposes a data.piece_bytes; with it the same corpus passes the check."""
    from lightning_mics.app.data import CorpusError, check_split, find_corpus

    path = tmp_path / "notes.txt"
    path.write_text("some text\n" * 600)  # 6000 bytes
    corpus = find_corpus(str(path), None, 4_000_000)
    with pytest.raises(CorpusError, match=r"data.piece_bytes=(\d+) fits") as err:
        check_split(corpus, str(path), 128, 0.1, 16384, 4_000_000)
    fits = int(err.value.args[0].split("data.piece_bytes=")[-1].split(" ")[0])
    check_split(corpus, str(path), 128, 0.1, fits, 4_000_000)
    with pytest.raises(CorpusError, match="too small"):
        check_split(corpus, str(path), 128, 0.1, fits + 1, 4_000_000)
    # ~ in a path given through Hydra's quoting is expanded
    home = tmp_path / "home"
    (home / "t").mkdir(parents=True)
    (home / "t" / "a.txt").write_text("x" * 10)
    os.environ["HOME"], old = str(home), os.environ.get("HOME")
    try:
        assert find_corpus("~/t", None, 100).files == ((home / "t" / "a.txt"),)
    finally:
        os.environ["HOME"] = old or ""
