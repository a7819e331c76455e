"""Several rank scripts one after another in the same processes: one launch instead of one per script.

    python chain.py --out DIR --runs '[["tests/engine/equiv.py", ["--steps", "2"]], ...]'

Each rank runs every script of ``--runs`` in turn as ``__main__`` (``runpy``, as ``tests/helpers/launch.py`` runs
one), with its own ``sys.argv``, ``--out DIR/<k>`` and the launch's environment; the process group the first one
makes (Lightning's) is the later ones'. A rank's start (the fork, the process group, the first fit's lazy imports
and warm-up) costs about 1.5 CPU-seconds per rank on the 2-core machine while a small fit costs a fraction of
that, so a test file's launches of the same world share one. A script that fails fails its rank, and ``run_ranks`` ends the launch with
every rank's log, as a launch of that script alone would. ``run_chain`` launches it and returns each script's
results (``run_ranks``'s list, one dict per rank), in the order of ``runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]


def run_chain(world: int, runs: Sequence[Tuple[Path, List[str]]], out_dir: Path, timeout: float = 900,
              **kwargs: Any) -> List[List[Dict[str, Any]]]:
    from tests.helpers.launch import run_ranks

    spec = json.dumps([[str(script), list(args)] for script, args in runs])
    run_ranks(Path(__file__), world, ["--runs", spec], out_dir, timeout=timeout, **kwargs)
    results = []
    for k in range(len(runs)):
        sub = out_dir / str(k)
        results.append([json.loads((sub / f"result{r}.json").read_text()) if (sub / f"result{r}.json").exists()
                        else {} for r in range(world)])
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", required=True)
    args = ap.parse_args()
    path, env = list(sys.path), dict(os.environ)
    for k, (script, argv) in enumerate(json.loads(args.runs)):
        os.environ.clear()  # the launch's environment (a fit's teardown drops WORLD_SIZE and the like)
        os.environ.update(env)
        out = Path(args.out) / str(k)
        out.mkdir(parents=True, exist_ok=True)
        sys.argv = [script, "--out", str(out), *argv]
        sys.path[:] = [str(Path(script).parent), *path]
        runpy.run_path(script, run_name="__main__")
    sys.path[:] = path


if __name__ == "__main__":
    main()
