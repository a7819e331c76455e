"""Hydra structured configs for the main job's config groups, and the checks their types cannot express.

[Note: config schemas]
Each group's YAML names a schema first in its defaults list (``- /trainer_schema@_here_``), so a misspelled key
or a value of the wrong type fails while Hydra composes the config, naming the key and the type, before any rank
starts. The schemas are stored at the top of Hydra's ConfigStore, not in the groups, so ``--help`` lists only real
choices (``strategy: ddp, mics``). ``mics_schema`` is :class:`lightning_mics.MiCSConfig` itself (every strategy
option) plus ``_target_``; ``trainer_schema``, ``gpt_schema`` and ``corpus_schema`` are built from the signature of
the class the group instantiates (``lightning.pytorch.Trainer`` for the keys the trainer YAMLs set, ``LitGPT`` and
``ByteCorpusDataModule`` whole), so their types are the classes' own annotations and cannot drift from them. An
annotation of one plain type (``int``, ``Optional[float]``, ``Sequence[float]``) becomes that type; a union of
several (``devices``) or a ``Literal`` (``precision``) has no OmegaConf type, so the field is ``Any`` and
:func:`check_config` checks the value against the annotation after composition, and ``trainer.devices``' value too
(any string passes its type). Keys a schema does not hold can still be added with ``+``, unchecked, as in Hydra.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from lightning_mics.options import MiCSConfig

_PLAIN = (bool, int, float, str)


class UsageError(CompactHydraException, ValueError):
    """A mistake in what the user asked for (a config value, a path), found before any rank starts. Hydra prints
    it as one message, without a traceback, and exits with status 1."""


@dataclass
class MiCSStrategyConf(MiCSConfig):
    """Schema of ``conf/strategy/mics.yaml``: every MiCSConfig option plus the class to instantiate."""

    _target_: str = "lightning_mics.MiCSStrategy"


def _accepts(annotation: Any) -> Tuple[List[Any], List[Any], bool]:
    """``(plain types, Literal values, None allowed)`` that a config value may take for ``annotation``.
    Objects (an ``Accelerator``, a ``timedelta``) cannot be written in a config and are left out; a sequence of a
    plain type counts as ``List[that type]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return [], [], True
    if origin is Union:
        types, literals, none_ok = [], [], False
        for arg in args:
            t, lit, n = _accepts(arg)
            types += [x for x in t if x not in types]
            literals += lit
            none_ok |= n
        return types, literals, none_ok
    if origin is Literal:
        return [], list(args), False
    if annotation in _PLAIN:
        return [annotation], [], False
    if origin in (list, tuple, collections.abc.Sequence) and args and args[0] in _PLAIN:
        return [List[args[0]]], [], False
    return [], [], False


def _config_type(annotation: Any) -> Any:
    types, literals, none_ok = _accepts(annotation)
    if len(types) == 1 and not literals:
        return Optional[types[0]] if none_ok else types[0]
    return Any


def _describe(annotation: Any) -> str:
    types, literals, none_ok = _accepts(annotation)
    if float in types and int in types:  # float takes ints too; and Union[int, float] is Union[float, int] when
        types = [t for t in types if t is not int]  # typing's cache made that first: the order is not ours
    names = [f"list of {typing.get_args(t)[0].__name__}" if typing.get_origin(t) is list else t.__name__
             for t in types]
    names += [repr(v) for v in literals] + (["null"] * none_ok)
    return ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]


def _matches(value: Any, annotation: Any) -> bool:
    types, literals, none_ok = _accepts(annotation)
    if value is None:
        return none_ok
    if value in literals and not isinstance(value, bool):
        return True
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t in (bool, str) and isinstance(value, t):
            return True
        if typing.get_origin(t) is list and isinstance(value, (list, tuple)):
            return all(_matches(v, typing.get_args(t)[0]) for v in value)
    return False


_DEVICES = re.compile(r"^\s*(auto|-1|\d+(\s*,\s*\d+)*\s*,?)\s*$")  # Lightning's string forms


def _check_devices(value: Any) -> Optional[str]:
    ok = (isinstance(value, int) and not isinstance(value, bool) and (value > 0 or value == -1)) or (
        isinstance(value, str) and _DEVICES.match(value)) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and v >= 0 for v in value))
    return None if ok else ("a number of devices (an int > 0, or -1 for all), 'auto', a list of device indices "
                            "such as [0,1], or a string such as '0,1'")


def signature_schema(name: str, target: Callable, keys: Optional[Sequence[str]] = None,
                     checks: Optional[Dict[str, Callable[[Any], Optional[str]]]] = None) -> type:
    """A dataclass with ``_target_`` and a field per parameter of ``target`` (or per name in ``keys``): the
    parameter's annotation as an OmegaConf type (``Any`` where it has none) and its default. The annotation
    and any value check go into the field's metadata for :func:`check_config`."""
    fn = target.__init__ if inspect.isclass(target) else target
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    specs = [("_target_", str, dataclasses.field(default=f"{target.__module__}.{target.__qualname__}"))]
    for key in keys or [k for k in params if k != "self"]:
        annotation, default = hints.get(key, Any), params[key].default
        value = list(default) if isinstance(default, tuple) else default
        meta = {"annotation": annotation, "check": (checks or {}).get(key)}
        f = (dataclasses.field(default_factory=lambda v=value: list(v), metadata=meta) if isinstance(value, list)
             else dataclasses.field(default=value, metadata=meta))
        specs.append((key, _config_type(annotation), f))
    return dataclasses.make_dataclass(name, specs)


def check_config(cfg: DictConfig) -> None:
    """Checks every group built from a :func:`signature_schema` schema for the values its OmegaConf types let
    through (see [Note: config schemas]); raises :class:`UsageError` naming the key, the value and what is
    allowed."""
    for group, node in cfg.items():
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if not dataclasses.is_dataclass(schema):
            continue
        values = OmegaConf.to_container(node, resolve=True)
        for f in dataclasses.fields(schema):
            annotation, check = f.metadata.get("annotation"), f.metadata.get("check")
            if annotation is None or f.name not in values:
                continue
            value = values[f.name]
            expected = None if _matches(value, annotation) else _describe(annotation)
            expected = expected or (check(value) if check else None)
            if expected:
                raise UsageError(f"{group}.{f.name}={value!r} is not valid: expected {expected}.")


_TRAINER_KEYS = ("accelerator", "devices", "num_nodes", "precision", "max_steps", "max_epochs", "val_check_interval",
                 "check_val_every_n_epoch", "num_sanity_val_steps", "accumulate_grad_batches", "gradient_clip_val",
                 "log_every_n_steps", "enable_model_summary", "deterministic")


def register() -> None:
    """Stores the schemas in Hydra's ConfigStore (before ``@hydra.main`` composes the config)."""
    import lightning.pytorch as pl

    from lightning_mics.app.data import ByteCorpusDataModule
    from lightning_mics.app.models.lit_gpt import LitGPT

    store = ConfigStore.instance()
    store.store(name="mics_schema", node=MiCSStrategyConf)
    store.store(name="trainer_schema", node=signature_schema(
        "TrainerConf", pl.Trainer, _TRAINER_KEYS, checks={"devices": _check_devices}))
    store.store(name="gpt_schema", node=signature_schema("LitGPTConf", LitGPT))
    store.store(name="corpus_schema", node=signature_schema("ByteCorpusConf", ByteCorpusDataModule))
