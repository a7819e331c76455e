"""The options as both front ends' keywords ([Note: one option list] in options.py): an unknown name refused, the
fields shown in ``help()`` and ``inspect.signature``."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any, Callable, Dict

from lightning_mics.options import MiCSConfig


def config_from(options: Dict[str, Any], owner: str = "MiCSStrategy") -> MiCSConfig:
    """``MiCSConfig(**options)``, an unknown keyword refused as a ValueError naming it and the allowed names."""
    names = MiCSConfig.names()
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"{owner} option {unknown[0]}={options[unknown[0]]!r} is invalid: allowed is a keyword of "
                         f"{names}.")
    return MiCSConfig(**options)


def with_options_signature(init: Callable) -> Callable:
    """Shows MiCSConfig's fields as keyword-only parameters in place of ``**options`` (for ``help`` and
    ``inspect.signature``); the function itself still takes ``**options``."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in fields(MiCSConfig)]
    init.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return init
