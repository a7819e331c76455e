"""Whether an optimizer can step the sharded parameters, decided when it is set up, before any step.

[Note: optimizers over DTensors]
The optimizer steps the sharded parameters as DTensors on the (replicate, shard) mesh, as under FSDP2: each
operation runs on this rank's rows, and DTensor's rules say what one across rows needs (a norm's partial sums, a
matmul's redistribution). So an elementwise optimizer steps exactly what it steps under DDP, and one that mixes
rows is right where DTensor has the rule: torch.optim's ASGD, Adadelta, Adagrad, Adam, AdamW, Adamax, Muon, NAdam,
RAdam, RMSprop and SGD (Muon's bfloat16 Newton-Schulz up to the order of a matmul's partial sums). Where a rule is
missing the first step would fail with DTensor's sharding-propagation error; such an optimizer is refused at
setup instead, naming the optimizer, the operation, the parameter and what is allowed:
- a fused kernel without a rule (torch 2.13: ``SGD`` and ``Adagrad`` with ``fused=True``), from DTensor's tables;
- ``LBFGS`` flattens each gradient (``view(-1)``): not for rows that do not split evenly over the group;
- ``Rprop``'s single-tensor step masks in place (``sign[sign.gt(0)] = etaplus``), which DTensor does not do on
  sharded rows, and its foreach step (torch's default on GPUs) copies with ``_foreach_copy_``, which has no rule;
- ``Adafactor`` squares a norm across the sharded rows in place (its column statistics): not for a sharded
  parameter of two or more dimensions.

[Note: optimizer probes]
LBFGS, Rprop and Adafactor are probed: the very operation their step runs, on a detached parameter of each
distinct layout, so a refusal lifts by itself where torch gains the rule (an even model runs LBFGS). A probe runs
on this rank's own rows, and with ``shard_optimizer_state`` the replicas step rows of different sizes, so its
answer is per rank: the ranks agree first (one ``all_gather_object``, every rank probing the same optimizer at the
same point of setup) and all raise the first refusing rank's message, since a rank raising alone would leave the
others waiting in their first step's collectives. An optimizer of one's own is not probed: DTensor's error at its
first step names the operation.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_Probe = Callable[[torch.Tensor], object]


def _flatten(t: torch.Tensor) -> object:
    return t.view(-1)


def _masked_fill(t: torch.Tensor) -> object:
    sign = t.sign()
    sign[sign.gt(0)] = 1.2
    return sign


def _foreach_copy_then_mask(t: torch.Tensor) -> object:
    prev = t.clone()
    torch._foreach_copy_([prev], [t])
    return _masked_fill(prev)  # (the foreach path masks its signs in place too)


def _column_square(t: torch.Tensor) -> object:
    if t.dim() < 2:
        return None
    col = torch.norm(t, dim=-2, keepdim=True)
    return col.square_()


def _column_square_foreach(t: torch.Tensor) -> object:
    if t.dim() < 2:
        return None
    col = torch.norm(t, dim=-2, keepdim=True)
    torch._foreach_mul_([col], [col])
    return col


# What each probed optimizer's step runs that DTensor may lack a rule for, on its single-tensor path and on its
# foreach path (None: it has one path): what it does, and that operation on a detached parameter.
_Path = Tuple[str, _Probe]
_PROBES: Dict[str, Tuple[_Path, Optional[_Path]]] = {
    "LBFGS": (("flattens each gradient (view(-1))", _flatten), None),
    "Rprop": (("masks its step signs in place (sign[sign.gt(0)] = etaplus)", _masked_fill),
              ("copies its gradients with torch._foreach_copy_ and masks its step signs in place",
               _foreach_copy_then_mask)),
    "Adafactor": (("squares a norm across the rows in place (its column statistics)", _column_square),
                  ("squares a norm across the rows in place (its column statistics, torch._foreach_mul_)",
                   _column_square_foreach)),
}


def step_refusal(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why this optimizer cannot step the sharded parameters ([Note: optimizers over DTensors]), or None."""
    base = _torch_base(optimizer)
    if base is None:
        return None
    name = type(optimizer).__name__
    op = _fused_op_without_dtensor_rule(optimizer, base)
    if op is not None:
        return (f"MiCSStrategy: {name}(fused=True) cannot step the sharded parameters: they are DTensors, and torch "
                f"{torch.__version__} has no DTensor rule for its kernel {op} (it has them for fused Adam and "
                f"AdamW). Allowed: {name}(foreach=True) (one kernel per operation over all tensors, torch's default "
                "on GPUs) or fused=False.")
    probe = _PROBES.get(base.__name__)
    if probe is None:
        return None
    return _agreed(_probe_refusal(optimizer, name, probe))


def _probe_refusal(optimizer: torch.optim.Optimizer, name: str, probe: Tuple[_Path, Optional[_Path]]
                   ) -> Optional[str]:
    """This rank's refusal: the first parameter group whose step's operation fails on one of its parameters."""
    single, foreach_path = probe
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if isinstance(p, DTensor)]
        foreach = foreach_path is not None and _resolved_foreach(group, params)
        what, operation = foreach_path if foreach else single
        failure = _first_failure(params, operation)
        if failure is None:
            continue
        p, err = failure
        path = f"{name}(foreach=True)" if foreach else name
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (f"MiCSStrategy: {path} cannot step the sharded parameters: they are DTensors, and its step {what}, "
                f"which torch {torch.__version__} cannot run on a parameter of shape {tuple(p.shape)} placed "
                f"{tuple(p.placements)}: {first} Allowed: an optimizer DTensor can step (torch.optim's SGD, "
                "Adam, AdamW, Adagrad, RMSprop, ...), or these parameters kept whole (param_persistence_threshold "
                "above their size, or sharded_data_parallel_degree=1 without shard_optimizer_state).")
    return None


def _agreed(local: Optional[str]) -> Optional[str]:
    """The refusal every rank raises alike: the first refusing rank's. Each rank probed its own rows, of
    different sizes on different replicas under ``shard_optimizer_state``; a rank that raised alone would leave
    the others waiting in their first step's collectives."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    every: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    refusing = [r for r, m in enumerate(every) if m is not None]
    if not refusing:
        return None
    ranks = "" if len(refusing) == len(every) else f" (on rank(s) {refusing} of {len(every)})"
    return every[refusing[0]].replace(" Allowed: ", f"{ranks} Allowed: ", 1)


def _torch_base(optimizer: torch.optim.Optimizer) -> Optional[type]:
    """The torch.optim class an optimizer is (or derives from): its step is torch's."""
    return next((c for c in type(optimizer).__mro__ if c is not torch.optim.Optimizer
                 and (c.__module__ + ".").startswith("torch.optim.")), None)  # Adafactor's is "torch.optim"


def _resolved_foreach(group: dict, params: List[torch.Tensor]) -> bool:
    """Whether the step takes its foreach path: the group's choice, else torch's default for these tensors."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    if group.get("differentiable") or not params:
        return False
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # (private: if torch moves it, the single-tensor path is probed)
        return False
    return _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


def _first_failure(params: List[torch.Tensor], probe: _Probe) -> Optional[Tuple[torch.Tensor, Exception]]:
    """The first parameter (one per distinct layout) on which the probe's operation raises, with its error."""
    seen = set()
    with torch.no_grad():
        for p in params:
            key = (tuple(p.shape), tuple(p.placements), id(p.device_mesh), p.dtype)
            if key in seen:
                continue
            seen.add(key)
            try:
                probe(p.detach())
            except (RuntimeError, NotImplementedError) as err:
                return p, err
    return None


def _fused_op_without_dtensor_rule(optimizer: torch.optim.Optimizer, base: type) -> Optional[str]:
    """The fused kernel (``aten._fused_<name>_``, torch.optim's naming) of a fused torch optimizer for which
    DTensor has no sharding rule; None when not fused, when it has one, or when this torch cannot tell."""
    if not any(group.get("fused") for group in optimizer.param_groups):
        return None
    op = getattr(torch.ops.aten, f"_fused_{base.__name__.lower()}_", None)
    try:
        prop = DTensor._op_dispatcher.sharding_propagator  # (private: if torch moves it, nothing is refused)
        rules = [prop.op_to_rules, prop.op_strategy_funcs, getattr(prop, "op_single_dim_strategy_funcs", {})]
    except AttributeError:
        return None
    if op is None or any(o in r for o in (getattr(op, n) for n in op.overloads()) for r in rules):
        return None
    return f"aten.{op.__name__}"
