"""A test module's launches of one script that runs case after case (``tests/helpers/trainer_cases.py``'s ``main``): each
(strategy, world) is launched once, on first use, and its cases' results read back; ``launch_together`` runs several
(script, strategy) pairs of one world in one launch instead (``tests/helpers/chain.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

from tests.helpers.chain import run_chain
from tests.helpers.launch import run_ranks


class CaseRuns:
    """``runs.load(kind, world, case)``: rank 0's result of ``case`` under strategy ``kind`` on ``world`` ranks, the
    launch made the first time ``(kind, world)`` is asked for (``cases(kind)``: the cases it runs)."""

    def __init__(self, script: Path, tmp_path_factory: Any, cases: Callable[[str], List[str]]) -> None:
        self.script, self.factory, self.cases = script, tmp_path_factory, cases
        self.done: Dict[Tuple[str, int], Tuple[Path, Dict[str, str]]] = {}

    def load(self, kind: str, world: int, case: str) -> Dict[str, Any]:
        if (kind, world) not in self.done:
            d = self.factory.mktemp(f"{kind}{world}")
            res = run_ranks(self.script, world, ["--strategy", kind, "--cases", ",".join(self.cases(kind))], d)
            self.done[(kind, world)] = (d, {c: e for r in res for c, e in r["errors"].items()})
        d, errors = self.done[(kind, world)]
        assert case not in errors, f"{kind} on {world} ranks, case {case}:\n{errors[case]}"
        return torch.load(d / f"{case}.pt", weights_only=False)


def launch_together(world: int, pairs: List[Tuple["CaseRuns", str]], tmp_path_factory: Any) -> None:
    """Each ``(runs, kind)`` of ``pairs`` run in one launch of ``world`` ranks, one after another in the same
    processes, in the order given (put the controls first: they then run before any MiCS strategy existed in the
    process, as in a launch of their own); ``runs.load(kind, world, case)`` then reads them without a launch."""
    d = tmp_path_factory.mktemp(f"together{world}")
    res = run_chain(world, [(cr.script, ["--strategy", kind, "--cases", ",".join(cr.cases(kind))])
                            for cr, kind in pairs], d)
    for k, ((cr, kind), ranks) in enumerate(zip(pairs, res)):
        cr.done[(kind, world)] = (d / str(k), {c: e for r in ranks for c, e in r["errors"].items()})


def max_diff(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over tensors of the same names (the names must be the same)."""
    assert sorted(got) == sorted(ref)
    return max((got[n].float() - ref[n].float()).abs().max().item() for n in ref)
