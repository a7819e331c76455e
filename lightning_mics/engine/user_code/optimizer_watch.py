"""How the engine hears of the user's optimizers: their steps and their ``zero_grad``.

[Note: steps the engine hears of]
The engine hears of a step by wrapping ``step`` on the optimizer instance as a bound method (an LR scheduler built
after it wraps it again through ``__func__``), not through torch's step hooks, which an optimizer that skips
``Optimizer.__init__`` lacks (timm's ``Lookahead``). The optimizers an optimizer holds are watched too (SAM's
``base_optimizer``), since user code calls their steps alone. Only the outermost of nested steps is heard (Lookahead's
base step inside its own), so what stays gathered is refreshed once, after the last move. A step that raises is not
heard to end: the refresh after it is collective, and the other ranks may not have stepped.
"""

from __future__ import annotations

import types
from typing import Any, Callable, List, Optional

import torch


def held_optimizers(optimizer: torch.optim.Optimizer) -> List[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it holds as attributes (SAM's ``base_optimizer``, Lookahead's), and theirs,
    outermost first."""
    out: List[torch.optim.Optimizer] = []
    todo = [optimizer]
    while todo:
        opt = todo.pop(0)
        if any(o is opt for o in out):
            continue
        out.append(opt)
        todo.extend(v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer))
    return out


class MethodHook:
    """Runs ``before()`` and ``after()`` around ``obj.<name>(...)``, wrapped on the instance as a bound method
    ([Note: steps the engine hears of]); ``after`` is skipped when the call raises (``failed()`` runs instead).
    ``remove`` restores the class's method, or leaves the wrapper calling straight through when something wrapped
    it since (an LR scheduler). A deep copy of the object runs the class's method, unwatched."""

    def __init__(self, obj: Any, name: str, before: Optional[Callable[[], None]] = None,
                 after: Optional[Callable[[], None]] = None, failed: Optional[Callable[[], None]] = None) -> None:
        self.obj, self.name = obj, name
        self.before, self.after, self.failed = before, after, failed
        original = getattr(obj, name)
        hook = self  # what the wrapper holds: ``remove`` drops the callbacks (and the engine behind them)

        def wrapper(_self: Any, *args: Any, **kwargs: Any) -> Any:
            if _self is not hook.obj:  # a deep copy of the object (its __dict__ copied, this method rebound to it)
                return getattr(type(_self), name)(_self, *args, **kwargs)
            before, after, failed = hook.before, hook.after, hook.failed
            if before is not None:
                before()
            try:
                out = original(*args, **kwargs)
            except BaseException:
                if failed is not None:
                    failed()
                raise
            if after is not None:
                after()
            return out
        wrapper.__name__ = name
        self.bound = types.MethodType(wrapper, obj)
        setattr(obj, name, self.bound)

    def remove(self) -> None:
        self.before = self.after = self.failed = None
        if self.obj.__dict__.get(self.name) is self.bound:
            del self.obj.__dict__[self.name]


class StepWatch:
    """How many watched optimizers' steps are running, one inside another ([Note: steps the engine hears of]): the
    outermost step's start and end reach ``begins`` and ``ends``."""

    def __init__(self, begins: Callable[[], None], ends: Callable[[], None]) -> None:
        self.begins, self.ends = begins, ends
        self.running = 0

    def watch(self, optimizer: torch.optim.Optimizer) -> MethodHook:
        """Wraps the step of ``optimizer``; ``.remove()`` the returned hook at the end."""
        return MethodHook(optimizer, "step", self._begin, self._end, self._failed)

    def _begin(self) -> None:
        self.running += 1
        if self.running == 1:
            self.begins()

    def _end(self) -> None:
        self.running -= 1
        if self.running == 0:
            self.ends()

    def _failed(self) -> None:
        self.running -= 1
