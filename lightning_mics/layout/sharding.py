"""Which parameters go to which gather/release unit, and which stay replicated.

[Note: units]
A unit is a module whose parameters are all-gathered together before its forward (and again before its backward)
and released after. By default every child of every ``nn.ModuleList`` is a unit (a transformer's blocks);
``shard_units`` names module classes instead. The root (the LightningModule) is always a unit and owns every
parameter no other unit owns. Units may nest: a parameter belongs to the innermost unit containing every module
that references it, so a weight tied between ``wte`` and ``lm_head`` lands in their common ancestor unit, and
``register_parameter(module, param)`` (a module using another module's weight in its forward) widens a
parameter's owner to include ``module``. A module of a named class compiled on its own (torchtitan's per-block
``torch.compile``) is a unit through its compiled wrapper: the hooks sit outside the compiled graph, which stays
whole (``fullgraph=True`` holds).

[Note: replicated parameters]
A parameter stays whole on every rank ("replicated": never gathered, reduced once per optimizer step over the
whole world) when it has fewer elements than ``param_persistence_threshold``, is 0-d or empty, or when s == 1. It
still belongs to the unit that owns it by [Note: units]: the unit swaps its plain form into the modules while it
runs and its DTensor form back afterwards ([Note: placement]).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

_EXTRA_REFS = "_mics_extra_param_refs"


def register_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Declares that ``module``'s forward uses ``param`` although ``param`` is registered elsewhere.

    The parameter is then gathered whenever ``module`` runs (SageMaker's ``smp.register_parameter``).
    """
    refs = module.__dict__.setdefault(_EXTRA_REFS, [])
    if not any(p is param for p in refs):
        refs.append(param)


@dataclass
class ParamRef:
    """One place that holds a parameter: ``module._parameters[attr]``; ``fqn`` is its name from the root."""

    module: nn.Module
    attr: str
    fqn: str


@dataclass
class ParamPlan:
    param: nn.Parameter
    refs: List[ParamRef]
    unit: Optional[str]  # owning unit path ("" = root)

    @property
    def fqn(self) -> str:
        return self.refs[0].fqn


@dataclass
class UnitPlan:
    path: str  # "" for the root
    module: nn.Module
    params: List[ParamPlan] = field(default_factory=list)  # sharded
    replicated: List[ParamPlan] = field(default_factory=list)  # whole on every rank

    @property
    def ref_modules(self) -> List[nn.Module]:
        """Every module holding one of this unit's parameters in its ``_parameters``."""
        seen, out = set(), []
        for pp in self.params + self.replicated:
            for ref in pp.refs:
                if id(ref.module) not in seen:
                    seen.add(id(ref.module))
                    out.append(ref.module)
        return out


@dataclass
class ShardingPlan:
    units: List[UnitPlan]  # root first, then in module (pre-)order

    @property
    def replicated(self) -> List[ParamPlan]:
        return [pp for u in self.units for pp in u.replicated]


def resolve_classes(names: Optional[Sequence], option: str) -> Optional[Tuple[Type[nn.Module], ...]]:
    """Dotted names (``"lightning_mics.app.models.gpt.Block"``) or classes -> classes; ValueError names the option."""
    if names is None:
        return None
    out = []
    for name in names:
        if isinstance(name, type):
            out.append(name)
            continue
        mod_name, _, cls_name = str(name).rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError, ValueError):
            raise ValueError(
                f"MiCSStrategy option {option}={list(names)!r} is invalid: {name!r} is not an importable "
                "module class; allowed is a list of nn.Module classes or their dotted names "
                "(e.g. 'torch.nn.TransformerEncoderLayer')."
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"MiCSStrategy option {option}={list(names)!r} is invalid: {name!r} is not an nn.Module "
                             "subclass; allowed is a list of nn.Module classes or their dotted names.")
        out.append(cls)
    return tuple(out)


def compiled_wrapper(module: nn.Module) -> bool:
    """A ``torch.compile(module)`` wrapper (an ``OptimizedModule``): it calls its ``_orig_mod`` compiled."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a compiled wrapper holds, or the module itself."""
    return module._orig_mod if compiled_wrapper(module) else module


def _unit_paths(root: nn.Module, unit_classes: Optional[Tuple[type, ...]]) -> List[str]:
    paths = [""]
    wrapped = {id(m._orig_mod) for m in root.modules() if compiled_wrapper(m)}
    for path, module in root.named_modules():
        if not path:
            continue
        if unit_classes is not None:
            if isinstance(unwrapped(module), unit_classes) and id(module) not in wrapped:
                paths.append(path)
        elif isinstance(module, nn.ModuleList):
            paths.extend(f"{path}.{name}" for name, _ in module.named_children())
    return paths


def _owner(module_path: str, unit_paths: Iterable[str]) -> str:
    """Innermost unit containing the module at ``module_path``."""
    best = ""
    for u in unit_paths:
        if u and (module_path == u or module_path.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _common_unit(paths: List[str], unit_paths: List[str]) -> str:
    owners = {_owner(p, unit_paths) for p in paths}
    if len(owners) == 1:
        return owners.pop()
    # Innermost unit that contains all owners.
    parts = [o.split(".") if o else [] for o in owners]
    prefix: List[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return _owner(".".join(prefix), unit_paths) if prefix else ""


def stays_replicated(shape: Tuple[int, ...], persistence_threshold: int, shard_size: int) -> bool:
    """A parameter of this shape stays whole on every rank ([Note: replicated parameters]); the planner uses the same rule."""
    numel = math.prod(shape)
    return shard_size == 1 or len(shape) == 0 or numel == 0 or numel < persistence_threshold


def plan_sharding(
    root: nn.Module,
    unit_classes: Optional[Tuple[type, ...]],
    persistence_threshold: int,
    shard_size: int,
) -> ShardingPlan:
    if unit_classes and not any(isinstance(m, unit_classes) for m in root.modules()):
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"MiCSStrategy option shard_units={[c.__name__ for c in unit_classes]!r} is invalid: the model "
            f"({type(root).__name__}) contains no instance of them; allowed is classes of modules in the model "
            f"(it holds {present[:12]}), or None: every child of every nn.ModuleList is a unit.")
    unit_paths = _unit_paths(root, unit_classes)
    modules = dict(root.named_modules(remove_duplicate=False))
    by_id: Dict[int, ParamPlan] = {}
    module_paths: Dict[int, List[str]] = {}
    for mpath, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{mpath}.{attr}" if mpath else attr
            plan = by_id.setdefault(id(param), ParamPlan(param, [], None))
            if not any(r.module is module and r.attr == attr for r in plan.refs):
                plan.refs.append(ParamRef(module, attr, fqn))
            module_paths.setdefault(id(param), []).append(mpath)
        for param in module.__dict__.get(_EXTRA_REFS, []):
            module_paths.setdefault(id(param), []).append(mpath)

    units = {p: UnitPlan(p, modules[p] if p else root) for p in unit_paths}
    for pid, plan in by_id.items():
        p = plan.param
        plan.unit = _common_unit(module_paths[pid], unit_paths)
        if stays_replicated(tuple(p.shape), persistence_threshold, shard_size):
            units[plan.unit].replicated.append(plan)
        else:
            units[plan.unit].params.append(plan)
    return ShardingPlan([units[p] for p in unit_paths if units[p].params or units[p].replicated or p == ""])
