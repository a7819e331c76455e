"""Full tensors from the shards and back: a unit's full values (parameters or optimizer state, gathered on one
rank or every rank), the module's full state dict, loading one, and making the module plain again after fit.

Everything here takes units and the topology, never the engine: these are the only paths that see a whole
parameter outside a unit's forward and backward, and they never go through param_dtype (the masters are read
and written bit-exact).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning_mics.comm import collectives
from lightning_mics.layout.placement import as_dtensor, local
from lightning_mics.layout.topology import Topology
from lightning_mics.engine.unit import AnyParam, Unit


class ReusedBuffers:
    """One reusable 1-D buffer per dtype and purpose (``key``: "send" or "recv"), grown to the largest request.

    ``units``: size the buffers for the largest of them at the first request, so a loop over the units never
    regrows one (gloo's thread may still hold the smaller predecessor's Work, and both would be live at once).
    """

    def __init__(self, units: Sequence[Unit] = ()) -> None:
        self._bufs: Dict[Tuple[torch.dtype, str], Tensor] = {}
        self._least = {"send": max((u.shard_flat.numel() for u in units), default=0),
                       "recv": max((u.s * u.shard_flat.numel() for u in units), default=0)}

    def get(self, n: int, dtype: torch.dtype, device: torch.device, key: str = "send") -> Tensor:
        buf = self._bufs.get((dtype, key))
        if buf is None or buf.numel() < n:
            self._bufs.pop((dtype, key), None)  # the old one goes before the larger one comes
            size = max(n, self._least.get(key, 0))
            buf = self._bufs[(dtype, key)] = torch.empty(size, dtype=dtype, device=device)
        return buf[:n]


def gather_rows(unit: Unit, locals_: Sequence[Optional[Tensor]], dtype: torch.dtype, dst: Optional[int],
                buffers: Optional[ReusedBuffers] = None) -> Optional[List[Optional[Tensor]]]:
    """Full tensors of ``unit``'s sharded parameters from per-parameter local rows, the shard group's chunks
    (``None``: no such tensor for that parameter).

    Collective over the shard group. ``dst`` = a global rank: only it gets the result (the others hold
    nothing more than their shard); ``dst=None``: every rank gets it. One unit's worth of memory at most;
    ``buffers`` lends the send and receive buffers, so a loop over units and state keys reuses them (and no
    receive buffer waits for gloo's thread to drop its Work before the next one is allocated).
    """
    buffers = buffers or ReusedBuffers()
    unit.settle_rows()  # [Note: rows between steps] in optimizer_rows.py
    if all(t is sp.local for sp, t in zip(unit.params, locals_)) and dtype == unit.dtype:
        flat = unit.shard_flat  # the master shard itself is the send buffer (padding rows are zero)
    else:
        flat = buffers.get(unit.shard_flat.numel(), dtype, unit.device)
        flat.zero_()
        for sp, t in zip(unit.params, locals_):
            if t is not None:
                flat[sp.offset:sp.offset + t.numel()].copy_(t.reshape(-1))
    n = unit.s * unit.shard_flat.numel()
    if dst is None:
        out = collectives.all_gather_flat(flat, unit.topo.shard_group, unit.s,
                                out=buffers.get(n, dtype, unit.device, "recv")).output \
            if unit.s > 1 else flat.view(1, -1)
    else:
        recv = buffers.get(n, dtype, unit.device, "recv") if dist.get_rank() == dst else None
        out = collectives.gather_flat(flat, unit.topo.shard_group, unit.s, dst, out=recv)
        if out is None:
            return None
    fulls = [torch.empty(sp.shape, dtype=dtype, device=unit.device) for sp in unit.params]
    collectives.copy_out(out, fulls, unit.s, "torch")
    return [f if t is not None else None for f, t in zip(fulls, locals_)]


def gather_master(unit: Unit, dst: Optional[int], buffers: Optional[ReusedBuffers] = None) -> Optional[List[Tensor]]:
    """The full parameters in the master dtype (never through param_dtype): bit-exact with the shards."""
    return gather_rows(unit, [sp.local for sp in unit.params], unit.dtype, dst, buffers)


def by_id(units: Sequence[Unit]) -> Dict[int, AnyParam]:
    """Every parameter of the units, under the id of its DTensor and of its full (plain) parameter."""
    out: Dict[int, AnyParam] = {}
    for u in units:
        for p in u.all_params():
            out[id(p.sharded)] = out[id(p.full)] = p
    return out


@torch.no_grad()
def full_state_dict(units: Sequence[Unit], topo: Topology, root: nn.Module,
                    dst: Optional[int] = 0) -> Dict[str, Tensor]:
    """The module's own state dict with full CPU tensors in the master dtype, gathered unit by unit onto
    global rank ``dst`` ({} elsewhere); ``dst=None``: on every rank. Collective; the units are released."""
    rank = dist.get_rank()
    keep = dst is None or rank == dst
    tp = topo.layout.tp_size > 1  # every rank takes part: tensor-parallel parts are gathered too
    full: Dict[int, Tensor] = {}
    buffers = ReusedBuffers(units)
    for unit in units:
        if not tp and dst is not None and rank not in topo.layout.shard_group_of(dst):
            continue  # only dst's shard group takes part
        values = gather_master(unit, None if tp else dst, buffers) if unit.params else []
        if values is not None:
            for sp, v in zip(unit.params, values):
                v = as_dtensor(v, sp.tp_spec).full_tensor() if sp.tp_spec is not None else v
                if keep:
                    full[id(sp.sharded)] = full[id(sp.full)] = v.cpu()
        for rp in unit.replicated:
            v = as_dtensor(rp.local, rp.tp_spec).full_tensor() if rp.tp_spec is not None else rp.local
            if keep:
                full[id(rp.sharded)] = full[id(rp.full)] = v.detach().cpu().clone()
    if not keep:
        return {}
    out = {}
    for name, t in root.state_dict(keep_vars=True).items():
        v = full.get(id(t))
        out[name] = v if v is not None else local(t).detach().cpu().clone()
    return out


@torch.no_grad()
def load_full_state_dict(units: Sequence[Unit], root: nn.Module, state: Dict[str, Tensor],
                         device: torch.device, strict: bool = True) -> None:
    """Copies this rank's rows of every full tensor into its shard; replicated ones and buffers whole. What goes
    where is what ``root.load_state_dict(state, strict)`` would put there ([Note: loading as torch loads])."""
    slots = by_id(units)
    for unit in units:
        unit.settle_rows()  # rows still on their way must not land on the loaded ones
    own = root.state_dict(keep_vars=True)
    landed = _as_torch_loads(root, state, strict)
    for name, t in own.items():
        if name not in landed:
            continue
        src = landed[name].to(device)
        slot = slots.get(id(t))
        if slot is not None:
            slot.copy_from_global(src)
        else:
            local(t).copy_(src)
    for unit in units:
        unit.rows_written()  # [Note: rows between steps] in optimizer_rows.py


def _as_torch_loads(root: nn.Module, state: Dict[str, Tensor], strict: bool) -> Dict[str, Tensor]:
    """The tensor ``root.load_state_dict(state, strict)`` would load at each of the root's state-dict names.

    [Note: loading as torch loads]
    The modules' own ``_load_from_state_dict`` and load pre-hooks act, so a module that renames or rebuilds entries of
    an older layout loads them (litgpt's LoRA GPT takes a base model's ``lm_head.weight`` as ``lm_head.linear.weight``;
    its attention reassembles legacy ``attn`` weights). torch's own load runs with ``assign=True``, which only places
    the given tensors (its shape checks and strict errors included); they are read back and every module's own
    parameters and buffers put back."""
    where = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attr in [*module._parameters, *module._buffers]:
            where[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    kept = {id(m): (m, dict(m._parameters), dict(m._buffers)) for m in root.modules()}
    landed: Dict[str, Tensor] = {}
    try:
        root.load_state_dict(state, strict=strict, assign=True)
        for name, (module, attr) in where.items():
            _, params, buffers = kept[id(module)]
            old = params[attr] if attr in params else buffers.get(attr)
            now = module._parameters[attr] if attr in module._parameters else module._buffers.get(attr)
            if now is not None and now is not old:
                landed[name] = now.detach()
    finally:
        for m, params, buffers in kept.values():
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
    return landed


@torch.no_grad()
def restore_module(units: Sequence[Unit]) -> Dict[int, nn.Parameter]:
    """Puts full, plain parameters (master dtype) back into the modules, unit by unit (the hooks already
    removed). Collective. Returns ``{id(DTensor parameter): plain parameter}``."""
    mapping: Dict[int, nn.Parameter] = {}
    buffers = ReusedBuffers(units)
    for unit in units:
        unit.release(force=True)  # teardown: whatever the schedule kept or pinned goes
        values = gather_master(unit, None, buffers) if unit.params else []
        for sp, v in zip(unit.params, values):
            p = nn.Parameter(v, requires_grad=sp.requires_grad)
            mapping[id(sp.sharded)] = p
            for ref in sp.refs:
                ref.module._parameters[ref.attr] = p
        for rp in unit.replicated:
            p = nn.Parameter(rp.local, requires_grad=rp.requires_grad)
            mapping[id(rp.sharded)] = p
            for ref in rp.refs:
                ref.module._parameters[ref.attr] = p
    return mapping
