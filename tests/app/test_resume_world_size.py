"""The main job resumed on another number of ranks continues the stream of samples where it stopped.

Real runs of the app (Lightning's launcher, gloo) on a corpus of numbered 32-byte cells
(tests/app/many_hosts_record.py): each rank records the numbers of the samples it trained on, read from the bytes
the model got. The reference is one uninterrupted run of 12 optimizer steps on 2 ranks x 8. A run stopped after 6
steps and resumed on 4 ranks x 4 (and one on 4 x 4 resumed on 2 x 8) must train, step by step, on the reference's
global batches: no sample twice, none skipped, and it says where it resumed. A resume with another global batch
is refused before any rank starts, naming the data.batch_size that fits.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import pytest

from tests.helpers.app import MICS_TINY, run_app_forked
from tests.app.many_hosts_record import numbered_corpus

pytestmark = pytest.mark.distributed

CELLS = 4000  # 128,000 bytes; pieces of 16 cells, every 10th to validation: 3,600 training cells, 3,599 blocks
ARGS = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.warmup_steps=2",
        "data.piece_bytes=512", "data.max_val_blocks=16", "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=2", "callbacks.progress_bar.refresh_rate=0",
        "callbacks.checkpoint.every_n_train_steps=6", "report=false", *MICS_TINY]


def _run(tmp: Path, name: str, ranks: int, batch: int, steps: int, corpus: Path, *extra: str) -> Path:
    out = tmp / name
    proc = run_app_forked([*ARGS, f"data.path={corpus}", f"trainer.devices={ranks}", f"data.batch_size={batch}",
                           f"trainer.max_steps={steps}", f"hydra.run.dir={out}",
                           "+callbacks.record._target_=tests.app.many_hosts_record.RecordSamples",
                           f"+callbacks.record.path={out}/samples", *extra], cwd=tmp, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def _by_step(*runs: Path) -> Dict[int, List[int]]:
    """global step -> the numbers of every sample trained on in that step, over all ranks and runs (sorted)."""
    steps: Dict[int, List[int]] = defaultdict(list)
    for run in runs:
        for f in sorted((run / "samples").glob("samples_rank*.json")):
            for step, numbers in json.loads(f.read_text()):
                steps[step].extend(numbers)
    return {k: sorted(v) for k, v in sorted(steps.items())}


def _per_rank(run: Path) -> List[Dict[int, List[int]]]:
    """rank -> global step -> the numbers that rank trained on in that step, in batch order."""
    files = sorted((run / "samples").glob("samples_rank*.json"), key=lambda f: int(f.stem.split("rank")[1]))
    return [{step: numbers for step, numbers in json.loads(f.read_text())} for f in files]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "numbered.txt"
    numbered_corpus(path, CELLS)
    return path


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, corpus) -> Path:
    return _run(tmp_path_factory.mktemp("reference"), "whole", 2, 8, 12, corpus)


@pytest.mark.parametrize("before, after", [((2, 8), (4, 4)), ((4, 4), (2, 8))])
def test_resume_on_other_ranks_continues_the_stream(tmp_path: Path, corpus: Path, reference_run: Path, before,
                                                    after) -> None:
    first = _run(tmp_path, "first", *before, 6, corpus)
    last = first / "checkpoints" / "last.ckpt"
    resumed = _run(tmp_path, "resumed", *after, 12, corpus, f"ckpt_path={last}")
    reference = _by_step(reference_run)

    assert sorted(reference) == list(range(12)) and all(len(v) == 16 for v in reference.values())
    whole = [n for v in reference.values() for n in v]
    assert len(set(whole)) == len(whole)  # the reference itself takes no sample twice
    got = _by_step(first, resumed)
    assert got == reference  # step by step the same global batches: nothing twice, nothing skipped
    # and each rank its stride of each global batch: on 2 x 8 rank r holds positions r, r + 2, ... of it, on 4 x 4
    # positions r, r + 4, ...: rank r of 4 holds every other sample of the reference's rank r % 2, from r // 2
    ref = _per_rank(reference_run)
    for run in (first, resumed):
        ranks = _per_rank(run)
        for r, steps in enumerate(ranks):
            for step, numbers in steps.items():
                want = ref[r][step] if len(ranks) == 2 else ref[r % 2][step][r // 2 :: 2]
                assert numbers == want, (run.name, r, step)
    lines = [line for line in (resumed / "stdout.txt").read_text().splitlines() if line.startswith("[data] resumed")]
    assert lines == [f"[data] resumed in epoch 0 after 6 global batches of 16 samples ({before[0]} ranks x "
                     f"{before[1]}): continuing at sample 96 of the epoch's 3,584, on {after[0]} ranks x "
                     f"data.batch_size={after[1]}"], lines


def test_resume_with_another_global_batch_is_refused(tmp_path: Path, corpus: Path, reference_run: Path) -> None:
    """The reference run's checkpoint (2 ranks x 8, step 12), resumed on 4 ranks x 8 to step 16."""
    last = reference_run / "checkpoints" / "last.ckpt"
    proc = run_app_forked([*ARGS, f"data.path={corpus}", "trainer.devices=4", "data.batch_size=8",
                           "trainer.max_steps=16", f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'again'}"],
                          cwd=tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert (f"ckpt_path='{last}': its run trained on global batches of 16 samples (2 ranks x data.batch_size=8), "
            "this one would take 32 (4 ranks x data.batch_size=8). A resumed run continues the checkpoint's stream "
            "of samples only with global batches of 16: give data.batch_size=4.") in out, out[-4000:]
    assert not (tmp_path / "again" / "checkpoints").exists()  # stopped before any rank trained
