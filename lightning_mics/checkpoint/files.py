"""Checkpoints on disk: the layout, checks that run before any collective, safe readers, crash-safe publishing.

[Note: checkpoint layout]
``state_dict_type="full"``: one file, Lightning's usual ``torch.save`` dict, written by global rank 0.
``state_dict_type="sharded"``: one directory, written through ``torch.distributed.checkpoint`` (DCP)::

    .metadata            DCP's index: every tensor's global shape and dtype, its chunks, and where each chunk lies
    __<rank>_0.distcp    one file per writing rank: the chunks DCP assigned to it (each chunk once: see below)
    meta.pt              Lightning's own state (loops, callbacks, lr schedulers, precision plugin, hyperparameters)

Model and optimizer state go through DCP as ``{"state_dict": <module's keys>, "optimizer_<i>": {"state":
{fqn: {...}}, "param_groups": [...]}}``; sharded tensors are the DTensor shards themselves, so each chunk carries
its global offset. Replicas of a chunk (the same rows on every replica group, replicated parameters, buffers)
are written once: DCP's save planner keeps one copy of every duplicated item and spreads them over the ranks.
Both formats carry ``MARKER`` = ``{"format", "version", ...}`` (in ``meta.pt`` for a directory); a checkpoint
with another version, or a directory without it, is refused by name.

[Note: crash-safe save]
A save never writes into the path it publishes. All ranks write into ``.<name>.tmp-<token>`` beside it (the
token comes from rank 0); when the last byte is on disk (DCP's writer syncs every file, then rank 0 writes
``.metadata``, then ``meta.pt``, synced), rank 0 *publishes*: the temporary takes the path's place in one rename
(``renameat2(RENAME_EXCHANGE)`` where Linux has it, so the path always names a complete checkpoint; elsewhere
two renames: the old one to ``.<name>.old-<token>``, the new one in). A save killed at any point before that
leaves the path untouched; the next save to the path removes the dead temporaries. In the fallback's gap between
the two renames the previous checkpoint sits under ``.old-<token>``: loading the path then reads it (read only,
with a warning), and the next save moves it back before it starts.

[Note: checks before collectives]
Loading runs the checks of ``check_sharded`` / ``load_full`` on every rank, on files alone (existence, sizes,
marker, version, DCP's index read with an allow-list unpickler), then the strategy's ranks agree on the verdict
in one small collective every rank reaches. A truncated, foreign or wrong-version checkpoint therefore ends
with the same error, naming the path, on every rank, before DCP's own collectives could leave one waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a distributed checkpoint
DCP_METADATA = ".metadata"
MARKER = "lightning_mics"
VERSION = 1
FORMATS = ("full", "sharded")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: the message names its path and what is wrong."""


class MissingKeyError(CheckpointError, KeyError):
    """``fabric.load(path, state)`` under ``strict=True`` with a key of ``state`` the checkpoint lacks: a
    ``KeyError``, as every Lightning strategy raises it, and a ``CheckpointError``."""

    __str__ = RuntimeError.__str__  # the message as written, not KeyError's repr of it


def marker(fmt: str, **extra: Any) -> Dict[str, Any]:
    return {"format": fmt, "version": VERSION, **extra}


def check_marker(info: Any, path: Path, expected: Optional[str]) -> None:
    if not isinstance(info, dict) or info.get("format") not in FORMATS:
        raise CheckpointError(f"{path}: not a lightning_mics checkpoint (its {MARKER!r} entry is {info!r}).")
    if info.get("version") != VERSION:
        raise CheckpointError(f"{path}: lightning_mics checkpoint format version {info.get('version')!r}; this "
                              f"lightning_mics reads version {VERSION}.")
    if expected is not None and info["format"] != expected:
        raise CheckpointError(f"{path}: marked {info['format']!r}, laid out as {expected!r}.")


# -- temporaries and publishing ([Note: crash-safe save]) ----------------------------------------------------------
def temporary(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}.tmp-{token}"


def _moved_aside_name(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}.old-{token}"


def _leftovers(path: Path, kind: str):
    return sorted(path.parent.glob(f".{path.name}.{kind}-*"), key=lambda p: p.stat().st_mtime, reverse=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fsync_path(path: Path) -> None:
    """Flushes a file's data, or a directory's entries, to disk (best effort where the OS has no such call)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prepare(path: Path, token: str) -> None:
    """Rank 0, before a save writes anything: puts back a checkpoint that a publish interrupted between its two
    renames, then removes the temporaries of dead saves (not this one's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        for old in _leftovers(path, "old"):
            if is_complete(old):
                os.rename(old, path)
                break
    for kind in ("tmp", "old"):
        for p in _leftovers(path, kind):
            if p.name != temporary(path, token).name:
                _remove(p)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28 (the process's own libc)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unavailable."""
    fn = _renameat2()
    return fn is not None and fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def publish(tmp: Path, path: Path, token: str) -> None:
    """Rank 0, once ``tmp`` is complete and synced: ``tmp`` takes ``path``'s place; the old one is removed."""
    fsync_path(tmp)
    if not path.exists() and not path.is_symlink():
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove(tmp)  # now the previous checkpoint
    elif path.is_file() and tmp.is_file():
        os.replace(tmp, path)  # atomic for files everywhere
    else:
        old = _moved_aside_name(path, token)
        os.rename(path, old)
        os.rename(tmp, path)
        _remove(old)
    fsync_path(path.parent)


def remove(path: Path) -> None:
    """Removes a checkpoint (file or directory) and any temporaries of dead saves to it."""
    _remove(path)
    for kind in ("tmp", "old"):
        for p in _leftovers(path, kind):
            _remove(p)


def resolve(path: Path) -> Path:
    """The path to read: ``path``, or, if a publish was cut between its two renames, the previous checkpoint."""
    if path.exists():
        return path
    for old in _leftovers(path, "old"):
        if is_complete(old):
            warnings.warn(f"{path} was being replaced when a save stopped; reading the previous checkpoint at {old}",
                          stacklevel=3)
            return old
    raise CheckpointError(f"{path}: no checkpoint (neither a file nor a directory) at this path.")


def unreplaceable(path: Path) -> Optional[str]:
    """Why a save must not take ``path``'s place, or None: a directory holding anything but a checkpoint (a save
    replaces what is there, and would remove those files with it)."""
    if not path.is_dir() or (path / META_FILE).exists() or (path / DCP_METADATA).exists():
        return None
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return None
    return (f"{path} exists and is a directory that holds no checkpoint ({len(entries)} entries, e.g. "
            f"{entries[:3]}): a save there would replace it and remove them. Save to another path, or remove it.")


def is_complete(path: Path) -> bool:
    return path.is_file() or (path / META_FILE).is_file() and (path / DCP_METADATA).is_file()


# -- reading --------------------------------------------------------------------------------------------------------
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _IndexUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle; a checkpoint is untrusted input, so only DCP's own index types (and torch
    dtypes, sizes, paths) may be constructed while reading it."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_CLASSES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read by ``_IndexUnpickler`` (DCP's own uses ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / DCP_METADATA, "rb") as f:
            md = _IndexUnpickler(f).load()
        if not isinstance(md, Metadata):
            raise pickle.UnpicklingError(f"the index holds a {type(md).__name__}, not DCP Metadata")
        return md


def set_element(root: Dict[str, Any], where: Tuple, value: Any) -> None:
    """Puts ``value`` at the nested position ``where`` (str keys: dicts, int keys: lists), creating containers
    on the way, as DCP's ``planner_data`` paths describe them."""
    cur: Any = root
    for key, nxt in zip(where, where[1:]):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = empty
        else:
            cur.setdefault(key, empty)
        cur = cur[key]
    if isinstance(cur, list):
        cur.extend([None] * (where[-1] + 1 - len(cur)))
    cur[where[-1]] = value


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: Any, weights_only: bool) -> None:
    obj = torch.load(value, weights_only=weights_only)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner; non-tensor values (optimizer hyperparameters) are read with ``weights_only``."""

    def __init__(self, weights_only: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _load_bytes(self, read_item, value, self.weights_only)


def check_against_module(path: Path, key: str, saved: Dict[str, Any], target: Dict[str, Any], strict: bool) -> None:
    """The entries saved under ``key`` (name -> index entry) against the module's state (name -> tensor of its
    global shape): a size mismatch is refused as ``load_state_dict`` refuses it, strict or not; under ``strict``,
    missing or unexpected names. Every rank reads the same index, so all raise alike before DCP's collectives."""
    some = lambda keys: f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"  # noqa: E731
    sizes = [f"{k}: checkpoint {tuple(saved[k].size)}, module {tuple(v.shape)}" for k, v in target.items()
             if isinstance(saved.get(k), TensorStorageMetadata) and tuple(saved[k].size) != tuple(v.shape)]
    if sizes:
        raise CheckpointError(f"{path}: size mismatch for {some(sizes)}.")
    missing, unexpected = [k for k in target if k not in saved], sorted(set(saved) - set(target))
    if strict and (missing or unexpected):
        raise CheckpointError(f"{path}: does not match the module{'' if key == 'state_dict' else f' {key!r}'}: "
                              f"missing {some(missing)}, unexpected {some(unexpected)} (strict loading off: "
                              "LightningModule.strict_loading = False, fabric.load(..., strict=False), loads the "
                              "common keys).")


def empty_state(index: Metadata) -> Dict[str, Any]:
    """The whole saved state as the index describes it: full, empty tensors; placeholders for other values.
    ``dcp.load`` into it (no process group needed) reads everything: how a sharded checkpoint is consolidated."""
    state: Dict[str, Any] = {}
    for flat, md in index.state_dict_metadata.items():
        value = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        set_element(state, index.planner_data[flat], value)
    return state


def empty_entries_under(index: Metadata, prefix: Tuple, device: Any) -> Dict[str, Any]:
    """Empty tensors for the saved entries whose path starts with ``prefix``, nested from the path's third element
    on (``(key, name, f"rank{r}")``: one rank's own entries), on ``device``: what ``dcp.load`` reads them into."""
    target: Dict[str, Any] = {}
    for flat, md in index.state_dict_metadata.items():
        path = index.planner_data.get(flat)
        if path and tuple(path[:len(prefix)]) == tuple(prefix):
            set_element(target, tuple(path[2:]), torch.empty(tuple(md.size), dtype=md.properties.dtype,
                                                             device=device))
    return target


def _unreadable(path: Path, err: BaseException, weights_only: Optional[bool]) -> CheckpointError:
    if path.is_file() and not zipfile.is_zipfile(path):
        why = "not a complete torch.save file (no zip directory at its end: truncated, or not a checkpoint)"
    elif weights_only is not False and isinstance(err, pickle.UnpicklingError):
        why = "weights_only loading refuses an object in it; load with weights_only=False only if you trust it"
    else:
        why = "unreadable"
    return CheckpointError(f"{path}: {why}: {type(err).__name__}: {err}")


def _torch_load(path: Path, weights_only: Optional[bool]) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # truncated, not a torch file, or objects weights_only refuses
        raise _unreadable(path, err, weights_only) from err


def read_index(path: Path) -> Metadata:
    try:
        return SafeReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{path}: its DCP index {DCP_METADATA} cannot be read: "
                              f"{type(err).__name__}: {err}") from err


def check_sharded(path: Path, weights_only: Optional[bool] = True) -> Tuple[Dict[str, Any], Metadata]:
    """Everything about a sharded checkpoint that files alone can tell, without a collective: returns
    (Lightning's metadata, DCP's index) or raises ``CheckpointError`` naming the path."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory.")
    if not (path / META_FILE).is_file() or not (path / DCP_METADATA).is_file():
        present = sorted(p.name for p in path.iterdir())[:8]
        raise CheckpointError(f"{path}: not a complete sharded checkpoint: it needs {META_FILE} and {DCP_METADATA} "
                              f"(it holds {present}); a save into it may have been interrupted.")
    meta = _torch_load(path / META_FILE, weights_only)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / META_FILE}: holds a {type(meta).__name__}, not a checkpoint dict.")
    check_marker(meta.get(MARKER), path, "sharded")
    md = read_index(path)
    ends: Dict[str, int] = {}
    for info in md.storage_data.values():
        rel = info.relative_path
        if Path(rel).name != rel or rel in ("", ".", ".."):
            raise CheckpointError(f"{path}: its index points outside the directory ({rel!r}).")
        ends[rel] = max(ends.get(rel, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        f = path / rel
        size = f.stat().st_size if f.is_file() else -1
        if size < end:
            raise CheckpointError(f"{path}: shard file {rel} is {'missing' if size < 0 else f'{size} bytes'}, the "
                                  f"index needs {end} bytes: the checkpoint is truncated or incomplete.")
    return meta, md


def load_full(path: Path, weights_only: Optional[bool] = True, loader: Any = None,
              lightning: bool = True) -> Dict[str, Any]:
    """A full checkpoint file as a dict with a ``state_dict`` (``lightning=False``, as Fabric saves, or a file
    written by ``fabric.save``: any dict); ``loader(path)`` replaces ``torch.load``."""
    if loader is not None:
        try:
            ckpt = loader(path)
        except Exception as err:
            raise _unreadable(path, err, weights_only) from err
    else:
        ckpt = _torch_load(path, weights_only)
    info = ckpt.get(MARKER) if isinstance(ckpt, dict) else None
    lightning = lightning and not (isinstance(info, dict) and "fabric" in info)
    if not isinstance(ckpt, dict) or (lightning and not isinstance(ckpt.get("state_dict"), dict)):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no 'state_dict' dict in it).")
    if MARKER in ckpt:  # written by lightning_mics; Lightning checkpoints of other strategies carry none
        consolidated = isinstance(info, dict) and info.get("format") == "sharded" and "fabric" in info
        # ``consolidated``: a fabric.save directory made one file by DCP's own tools with its meta.pt merged in
        # (Lightning's ``consolidate_checkpoint``): each module's and optimizer's state under its key, as full
        check_marker(info, path, "sharded" if consolidated else "full")
    return ckpt
