"""Grouped activation checkpointing, and CPU offload of the activations kept at checkpoint boundaries.

[Note: grouped checkpointing]
``activation_checkpointing`` names module classes; their instances that are consecutive siblings (children of one
module, a ModuleList's blocks) form groups of ``checkpoint_group_size``. A group is one segment of torch's
non-reentrant checkpoint, entered in its first module's pre-forward hook and left in its last's post-forward hook:
the user's loop over the blocks runs unchanged, and only the segment's inputs are kept for backward. The replay
calls each block through its module (a block that is a unit is gathered by its pre-forward hook and released by
its post-backward) and feeds it the previous block's output and the other arguments it got in forward, so a group
must be a sequential stack: a block whose first input is not the previous block's output is refused in forward,
and torch refuses a replay that saves different tensors. A group of k blocks keeps one input instead of k, at the
price of k blocks' gathered parameters alive while it replays.

[Note: activation offload]
With ``activation_offload`` the checkpoint keeps a host copy of each segment's inputs instead of the inputs (on
CUDA: pinned memory, copied on a side stream, the device tensor freed once the copy is done); the replay moves them
back. A hook on the group's output starts that copy back on the side stream when the output's gradient is ready,
which is when the blocks after the group have finished their backward: just before the replay needs it. The host
copies are held by that hook and the replay alone, not by the segment, so they go with the graph after backward
instead of staying pinned through the optimizer step, validation and saves until the next forward. The cost is one
copy each way per group and step (about 0.5 ms for 25 MB on an H200), under 1% of a step whose time the GPU
sets. On CPU the host copy is a plain copy: the same code path, no memory saved.

[Note: offload streams]
A tensor used on the side stream is allocated on the stream that frees it, or ``record_stream``ed to the side stream:
the copy out reads the input (allocated and freed by the compute stream, recorded to the side stream); the copy back's
buffer is allocated on the compute stream, which frees it after the replay, so the caching allocator keeps one pool
for both. Its block may have served a tensor whose last compute op is still queued: the side stream waits for the
compute stream before writing it (so the copy back starts after the compute work queued when the group's output
gradient is ready), and it is recorded to the side stream for a backward that drops it unread. The replay waits for
the copy's event on the compute stream.

[Note: offload and the RNG]
torch's checkpoint saves the RNG state of the CPU and of the devices of its inputs, restores it for the replay (the
forward's dropout masks again) and puts the current one back after (later draws unmoved). Given the host copies alone
it would save the CPU's only: on CUDA the replay would draw other masks and shift every later draw, silently. So the
checkpoint also gets an empty tensor on each device whose inputs were offloaded and no other input is on (one per
device, kept; the replay drops them), and saves that device's RNG state as without offload.

[Note: checkpointing under torch.compile]
A compiled forward saves for backward what its graphs save, not what the eager ops would; the replay must save
the same tensors, in the same order, or torch's recompute check fails. So the replay runs under the compile the
forward ran under: a pre-hook of the first block records dynamo's frame callback (None when nothing is compiled)
through a function dynamo skips without uninstalling the callback (``disable(recursive=False)``: a quiet graph
break), and the replay installs that callback, so each block's frames hit the graphs compiled in forward
(dynamo's cache: nothing recompiles) and the same compiled code saves the same tensors. A block compiled on its
own replays compiled anyway: in place (``block.compile()``) the capture is skipped, so its graph stays whole
under ``fullgraph=True``; a ``torch.compile(block)`` wrapper is the group's block itself, its hooks outside the
graph. The other hooks are registered ``torch.compiler.disable``d, as the engine's own
([Note: hooks under torch.compile] in hooks.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from lightning_mics.layout.sharding import compiled_wrapper, resolve_classes, unwrapped

_set_frame_callback = torch._C._dynamo.eval_frame.set_eval_frame


@torch.compiler.disable(recursive=False)  # dynamo runs this frame as it is, its callback still installed
def _frame_callback() -> Any:
    """Dynamo's frame callback when a compiled forward calls this, else None
    ([Note: checkpointing under torch.compile])."""
    return torch._C._dynamo.eval_frame.get_eval_frame_callback()


def _fail(option: str, value: Any, message: str) -> None:
    raise ValueError(f"MiCSStrategy option {option}={value!r} is invalid: {message}.")


def plan_groups(root: nn.Module, names: Sequence, group_size: int) -> List[List[nn.Module]]:
    """Groups of ``group_size`` consecutive sibling instances of the named classes, in module order; an instance
    compiled on its own is taken as its compiled wrapper (the hooks outside its graph, as for units)."""
    classes = resolve_classes(names, "activation_checkpointing")
    runs: List[List[nn.Module]] = []
    for parent in root.modules():
        run: List[nn.Module] = []
        for child in ([] if compiled_wrapper(parent) else parent.children()):
            if isinstance(unwrapped(child), classes) and not any(child is m for r in runs for m in r):
                run.append(child)
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
    if not runs:
        _fail("activation_checkpointing", list(names),
              f"the model ({type(root).__name__}) contains no instance of {[c.__name__ for c in classes]}")
    shortest = min(len(r) for r in runs)
    if group_size > shortest:
        _fail("checkpoint_group_size", group_size,
              f"at most {shortest}: the shortest run of consecutive {[c.__name__ for c in classes]} modules "
              f"has {shortest} (allowed: 1..{shortest})")
    _refuse_wrapped(root, runs, names)
    groups = []
    for run in runs:
        for i in range(0, len(run), group_size):
            groups.append(run[i:i + group_size])
    return groups


def _refuse_wrapped(root: nn.Module, runs: List[List[nn.Module]], names: Sequence) -> None:
    """A module to checkpoint that torch's ``checkpoint_wrapper`` already checkpoints (inside it, or holding one)
    is refused: Lightning's FSDP strategies warn and drop their option there, but this option would then be
    accepted and ignored, with its grouping and offload."""
    chosen = {id(b) for r in runs for b in r}
    inside = {id(m) for w in root.modules() if isinstance(w, CheckpointWrapper) for m in w.modules()}
    wrapped = [n for n, m in root.named_modules() if id(m) in chosen
               and (id(m) in inside or any(isinstance(x, CheckpointWrapper) for x in m.modules()))]
    if wrapped:
        _fail("activation_checkpointing", list(names),
              f"the model already checkpoints {wrapped} with torch's checkpoint_wrapper: checkpointing them again "
              "would recompute them twice in backward. Allowed: this option without the wrappers, or the wrappers "
              "with activation_checkpointing=None")


class _HostCopy:
    """A segment input kept in host memory ([Note: activation offload])."""

    def __init__(self, t: Tensor, stream: Optional[Any]) -> None:
        self.device, self.requires_grad = t.device, t.requires_grad
        self.event = self.back = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t.detach(), non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            t.record_stream(stream)  # the device tensor stays valid until the copy is done
        else:
            self.host = t.detach().clone()

    def prefetch(self, stream: Optional[Any]) -> None:
        """Starts the copy back ([Note: offload streams]): the buffer allocated on the compute stream, filled on
        the side stream once that has seen every compute op queued so far and the copy out is done."""
        if self.device.type == "cuda" and self.back is None:
            compute = torch.cuda.current_stream(self.device)
            self.back = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
            stream.wait_stream(compute)  # the block may have held a tensor the compute stream still uses
            with torch.cuda.stream(stream):
                stream.wait_event(self.event)
                self.back.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
            self.back.record_stream(stream)  # dropped unread (a failed backward): kept until the copy is done

    def restore(self, stream: Optional[Any]) -> Tensor:
        if self.device.type == "cuda":
            self.prefetch(stream)
            torch.cuda.current_stream(self.device).wait_event(self.event)
            t, self.back = self.back, None
        else:
            t = self.host
        return t.detach().requires_grad_(self.requires_grad)


class _Segment:
    """One group: the blocks, what each got in forward, and the open checkpoint while forward is inside it."""

    def __init__(self, blocks: List[nn.Module]) -> None:
        self.blocks = blocks
        self.calls: List[Tuple[tuple, dict]] = []  # each block's arguments but the first
        self.outputs: List[Any] = []
        self.gen = None
        self.host: List[_HostCopy] = []  # the host copies of the inputs, from entry to the end of the forward
        self.callback: Any = None  # dynamo's frame callback while forward entered the segment (compiled), or None


class ActivationCheckpointing:
    """Installs the segments' hooks on the blocks ([Note: grouped checkpointing])."""

    def __init__(self, groups: List[List[nn.Module]], offload: bool, log: Any) -> None:
        self.groups = groups
        self.offload, self.log = offload, log
        self.stream = None
        self._marker: Dict[torch.device, Tensor] = {}  # [Note: offload and the RNG]
        self._handles: List[Any] = []
        for blocks in self.groups:
            seg = _Segment(blocks)
            for j, block in enumerate(blocks):
                self._handles.append(block.register_forward_pre_hook(self._pre(seg, j), with_kwargs=True,
                                                                     prepend=True))
                if j == 0:  # runs before the pre-hook above
                    self._handles.append(block.register_forward_pre_hook(self._capture(seg), prepend=True))
                self._handles.append(block.register_forward_hook(self._post(seg, j), with_kwargs=True,
                                                                 always_call=True))

    @staticmethod
    def _replaying() -> bool:
        return torch._C._current_graph_task_id() != -1

    @staticmethod
    def _capture(seg: _Segment):
        def hook(module: nn.Module, args: tuple) -> None:  # [Note: checkpointing under torch.compile]
            if module._compiled_call_impl is None:  # (a block compiled itself replays compiled: nothing to do)
                seg.callback = _frame_callback()
        return hook

    def _pre(self, seg: _Segment, j: int):
        @torch.compiler.disable  # [Note: checkpointing under torch.compile]
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying() or not torch.is_grad_enabled():
                return
            if j == 0:
                seg.calls, seg.outputs = [], []
                self._enter(seg, args, kwargs)
            elif seg.gen is not None and not (args and args[0] is seg.outputs[-1]):
                seg.gen.close()
                seg.gen = None
                raise ValueError(
                    f"MiCSStrategy option checkpoint_group_size={max(map(len, self.groups))} is invalid for this "
                    f"model: allowed is 1 here. Grouped checkpointing replays a group block by block, feeding each "
                    f"block the previous one's output; {type(module).__name__} (block {j} of its group) got another "
                    f"first input.")
            # Not the first input: the replay feeds each block the previous one's output, and holding the
            # inputs here would keep every block's input alive until backward (so grouping and offload kept all)
            seg.calls.append((args[1:], kwargs))
        return hook

    def _post(self, seg: _Segment, j: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._replaying() or seg.gen is None:
                return
            seg.outputs.append(output)
            if output is None:  # the forward raised: leave the checkpoint's context
                seg.gen.close()
                seg.gen, seg.host = None, []
            elif j == len(seg.blocks) - 1:
                next(seg.gen, None)
                seg.gen = None
                seg.calls, seg.outputs = [], []  # the replay uses what it was given on entry
                if self.offload and isinstance(output, Tensor) and output.requires_grad:
                    output.register_hook(lambda g, copies=seg.host: self._prefetch(copies, g))
                seg.host = []  # held by the hook and the replay alone: gone with the graph, not kept to the next step
        return hook

    def _enter(self, seg: _Segment, args: tuple, kwargs: dict) -> None:
        calls, blocks = seg.calls, seg.blocks  # calls: filled by the blocks' pre-hooks as forward goes through
        host: List[Optional[_HostCopy]] = [None] * len(args)
        saved = list(args)
        if self.offload:  # [Note: activation offload]: the checkpoint keeps host copies of the inputs
            for i, a in enumerate(args):
                if isinstance(a, Tensor) and a.is_floating_point():
                    if a.is_cuda and self.stream is None:
                        self.stream = torch.cuda.Stream(a.device)
                    host[i] = _HostCopy(a, self.stream)
                    saved[i] = host[i].host.detach().requires_grad_(a.requires_grad)
                    self.log.offloaded(a.numel() * a.element_size())
        seg.host = [h for h in host if h is not None]
        markers = self._markers(args, saved)  # [Note: offload and the RNG]
        n = len(args)
        callback = seg.callback

        def replay(*inputs, **kw):
            inputs = tuple(h.restore(self.stream) if h is not None else x for h, x in zip(host, inputs[:n]))
            prior = _set_frame_callback(callback) if callback is not None else None
            try:  # under the forward's compile, if any: the same compiled code saves the same tensors
                out = blocks[0](*inputs, **kw)
                for block, (a, k) in zip(blocks[1:], calls[1:]):
                    out = block(out, *a, **k)
            finally:
                if callback is not None:
                    _set_frame_callback(prior)
            return out

        seg.gen = _checkpoint_without_reentrant_generator(
            replay, True, noop_context_fn, "default", False, True, *saved, *markers, **kwargs)
        next(seg.gen)

    def _markers(self, args: tuple, saved: list) -> List[Tensor]:
        """An empty tensor on each device whose inputs were offloaded and that no other saved input is on: what
        torch's checkpoint reads the devices to save the RNG state of from ([Note: offload and the RNG])."""
        kept = {x.device for x in saved if isinstance(x, Tensor) and x.device.type != "cpu"}
        gone = {a.device for a in args if isinstance(a, Tensor) and a.device.type != "cpu"} - kept
        for d in gone:
            if d not in self._marker:
                self._marker[d] = torch.empty(0, device=d)
        return [self._marker[d] for d in sorted(gone, key=str)]

    def _prefetch(self, copies: List[_HostCopy], grad: Tensor) -> Tensor:
        for h in copies:
            h.prefetch(self.stream)
        return grad

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
