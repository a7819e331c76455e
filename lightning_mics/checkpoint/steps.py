"""The collective steps of saving and loading a checkpoint, shared by both front ends.

A save: every rank agrees on the path and a token (rank 0's), then either every rank writes its shards into a
directory (``checkpoint.save_sharded``) or rank 0 writes one file under a temporary name and publishes it
([Note: crash-safe save] in checkpoint/files.py). A load: every rank checks the files, the ranks agree on the
verdict ([Note: checks before collectives]), then a full file is returned as read or a directory's index is handed
on for DCP to read. The front ends decide what goes into the checkpoint and where it is loaded to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.distributed import group as _group
from torch.distributed.checkpoint.metadata import Metadata

from lightning_mics.checkpoint import state as ckpt
from lightning_mics.checkpoint import files as files


def checkpoint_format(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """"full" | "sharded" for a checkpoint dict written by this package; None for another strategy's."""
    info = checkpoint.get(files.MARKER)
    return info.get("format") if isinstance(info, Mapping) else None


def broadcast(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def same_on_every_rank(obj: Any) -> bool:
    """Whether every rank holds an equal ``obj`` (a short, picklable value). Collective."""
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return True
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return all(o == every[0] for o in every)


def agree(error: Optional[str], kind: Type[files.CheckpointError] = files.CheckpointError) -> None:
    """Every rank raises the same ``kind`` of CheckpointError if any rank found one
    ([Note: checks before collectives])."""
    if _distributed_is_initialized() and dist.get_world_size() > 1:
        errors: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [r for r, e in enumerate(errors) if e]
        if failed:
            error = errors[failed[0]] + ("" if len(failed) == len(errors) else f" (found on rank(s) {failed})")
    if error:
        raise kind(error)


def path_and_token(path: Any) -> Tuple[str, str]:
    """Rank 0's path and a fresh token, on every rank, once rank 0 found the path one a save may replace (an
    ``IsADirectoryError`` on every rank otherwise). Collective."""
    path = str(path)
    zero = not _distributed_is_initialized() or dist.get_rank() == 0
    error = files.unreplaceable(Path(path)) if zero and "://" not in path else None
    path, token, error = broadcast((path, ckpt.new_token(), error))  # rank 0's verdict, in the same collective
    if error:
        raise IsADirectoryError(error)
    return path, token


def refuse_remote_sharded(path: str, storage_options: Any) -> None:
    if "://" in path or storage_options is not None:
        raise ValueError(f"MiCSStrategy(state_dict_type='sharded') writes a directory on a local or shared "
                         f"filesystem through torch.distributed.checkpoint, without storage_options; got "
                         f"{path!r}, storage_options={storage_options!r}. Use state_dict_type='full' for "
                         "a CheckpointIO plugin.")


def users_plugin(io: Any) -> bool:
    """Is ``io`` a CheckpointIO plugin of the user's, not Lightning's default ``TorchCheckpointIO``: the one
    decision behind refusing it with sharded checkpoints, handing it the user's path, and loading through it."""
    return io is not None and type(io) is not TorchCheckpointIO


def write_full(checkpoint: Dict[str, Any], path: str, token: str, io: Any, storage_options: Any,
               is_rank_zero: bool) -> None:
    """Rank 0 writes one file through ``io.save_checkpoint``: a local path under a temporary name, published by
    one rename; a remote one (``scheme://``) directly. So does a plugin of the user's (``users_plugin``): it gets
    the user's path, as under DDP, since it may write later (Lightning's ``AsyncCheckpointIO``) or elsewhere, and a
    rename cannot follow it; a checkpoint of either form at the path is removed first, and the write's crash
    safety is the plugin's."""
    if not is_rank_zero:
        return
    if "://" in path:
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        return
    target = Path(path)
    files.prepare(target, token)
    if users_plugin(io):
        files.remove(target)
        io.save_checkpoint(checkpoint, target, storage_options=storage_options)
        return
    tmp = files.temporary(target, token)
    io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
    files.publish(tmp, target, token)


def read_checked(checkpoint_path: Any, weights_only: Optional[bool], loader: Optional[Callable[[Path], Any]] = None,
                 check: Optional[Callable[[Path, Dict[str, Any]], Optional[str]]] = None, lightning: bool = True
                 ) -> Tuple[Path, Optional[Dict[str, Any]], Optional[Dict[str, Any]], Optional[Metadata]]:
    """(path, full checkpoint or None, sharded metadata or None, DCP index or None), the same verdict on every
    rank. ``check(path, meta)`` adds the front end's own check of a sharded checkpoint (an error message or None);
    ``lightning=False``: a full file need not be a Lightning checkpoint (Fabric's are any dict). Collective (rank 0's path; one small all-gather)."""
    path = Path(broadcast(str(checkpoint_path)))
    error, full, meta, index = None, None, None, None
    try:
        path = files.resolve(path)
        if path.is_dir():
            meta, index = files.check_sharded(path, weights_only)
            error = check(path, meta) if check is not None else None
        else:
            full = files.load_full(path, weights_only, loader=loader, lightning=lightning)
    except files.CheckpointError as err:
        error = str(err)
    agree(error)
    return path, full, meta, index
