"""A misspelled key on the main job's command line is answered with the key meant, before Hydra's advice.

[Note: did you mean]
Hydra answers ``model.n_layr=3`` with "Could not override 'model.n_layr'. To append to your config use
+model.n_layr=3"; following that advice adds a key the model's class does not take, and the job fails a second
time, later, in ``LitGPT.__init__``. So before Hydra runs, :func:`check_keys` composes the config the command line
asks for (Hydra's compose API on the same configs, the same ``--config-dir`` and ``--config-name``, each sweep
override at its first value); when Hydra cannot override a key, it composes again without the keys it could not
override and looks, with ``difflib``, for the closest key of the same config node (``model`` for
``model.n_layr``; every key as deep, when the node itself is misspelled: ``modle.n_layer``). A close one ends the job
with one message: the override, what is missing and "did you mean model.n_layer=3?". Without a close match
(``+trainer.limit_val_batches=8`` spelled without its ``+``) Hydra answers as usual, since its advice is then the
right one. Ranks launched by Lightning (``LOCAL_RANK`` set) repeat rank 0's command line and are not checked again.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Dict, List, Optional, Tuple

_FAILED = re.compile(r"Could not override '([^']+)'")
_SKIP_FLAGS = ("hydra_help", "version", "shell_completion", "info", "config_path", "experimental_rerun")


def _single_job(overrides: List[str]) -> Optional[List[Tuple[str, str, str]]]:
    """``(key, override, as given)`` per override, each sweep at its first value; None when Hydra's grammar refuses
    one (Hydra answers that itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        out = []
        for o in parsed:
            line = o.input_line
            if o.is_sweep_override():
                line = f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
            out.append((o.key_or_group, line, o.input_line))
        return out
    except Exception:
        return None


def _flat(node: Any, prefix: str = "") -> List[str]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            name = f"{prefix}{k}"
            out.append(name)
            out += _flat(v, name + ".")
    return out


def suggestion(cfg: Dict[str, Any], key: str) -> Optional[str]:
    """The key of ``cfg`` (a plain container) closest to the unknown ``key``: among its node's keys, or among all
    keys as deep when the node is missing too."""
    parent, _, leaf = key.rpartition(".")
    node: Any = cfg
    for part in parent.split(".") if parent else []:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        close = difflib.get_close_matches(leaf, [str(k) for k in node], n=1, cutoff=0.6)
        return f"{parent}.{close[0]}" if close and parent else (close[0] if close else None)
    depth = key.count(".")
    close = difflib.get_close_matches(key, [k for k in _flat(cfg) if k.count(".") == depth], n=1, cutoff=0.75)
    return close[0] if close else None


def _compose(config_name: str, overrides: List[str]) -> Any:
    from hydra import compose
    from omegaconf import OmegaConf

    cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


def check_keys(argv: List[str], conf_module: str) -> None:
    """Raises SystemExit naming the key meant when an override's key does not exist and one close to it does
    ([Note: did you mean]). The schemas must be in Hydra's ConfigStore already (importing train.py stores them);
    without them nothing composes and nothing is said."""
    if "LOCAL_RANK" in os.environ:
        return
    from hydra import initialize_config_module
    from hydra._internal.utils import get_args_parser
    from hydra.errors import ConfigCompositionException

    args, _ = get_args_parser().parse_known_args(argv)
    if any(getattr(args, flag, None) for flag in _SKIP_FLAGS):
        return
    job = _single_job(args.overrides)
    if not job:
        return
    extra = [f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"] if args.config_dir else []
    config_name, failed, cfg = args.config_name or "config", [], None
    with initialize_config_module(config_module=conf_module, version_base="1.3"):
        for _ in range(len(job) + 1):
            try:
                cfg = _compose(config_name, [line for key, line, _ in job if key not in failed] + extra)
                break
            except ConfigCompositionException as e:
                m = _FAILED.match(str(e))
                if not m or m.group(1) in failed:
                    return  # another mistake: Hydra answers it
                failed.append(m.group(1))
            except Exception:
                return
    if cfg is None or not failed:
        return
    answers = []
    for key in failed:
        meant = suggestion(cfg, key)
        if meant is None:
            return  # not a misspelling that we can name: Hydra's own answer
        given = next(given for k, _, given in job if k == key)
        answers.append(f"{given}: the config has no key {key}; did you mean {meant}={given.split('=', 1)[1]}?")
    raise SystemExit("\n".join(answers) + "\n(lightning-mics-train --help lists every key with what it means.)")
