"""``lightning-mics-train --help``: every key of the job's config with what it means, generated from the configs.

[Note: help from the configs]
``conf/config.yaml`` sets Hydra's help template to ``${app_help:}``, a resolver this module registers, so the text
is written when ``--help`` asks for it, from the YAML files the job composes (the package's ``conf/``): each
config group's options (``strategy=mics``, ``trainer=gpu``, ...) with the first sentences of their file's header
comment, then every key of every option with its default and its comment (a key's trailing comment and the comment
lines that continue it, or the comment block just above it). A key without a comment takes its description from
the group's default option (``trainer=gpu`` repeats ``cpu``'s keys) and, for the MiCS strategy, from the option's
own field description (``lightning_mics.options.DESCRIPTIONS``), so every key of every option of the strategy,
model, data and trainer groups has a description. Hydra's own parts of the template stay: ``$APP_CONFIG_GROUPS``
(the groups' choices); any other ``$`` in the text is escaped for ``string.Template``.
"""

from __future__ import annotations

import importlib.resources
import re
import textwrap
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

CONF_MODULE = "lightning_mics.app.conf"
GROUPS = ("strategy", "model", "data", "trainer")  # in the order the help lists them
WIDTH = 118

_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")


@dataclass
class Key:
    name: str  # dotted, inside the file
    value: str  # as written in the YAML ("" for a mapping)
    about: str


def _split_comment(rest: str) -> Tuple[str, str]:
    """``' 4   # text'`` -> ``('4', 'text')``; a '#' inside quotes is part of the value."""
    quote = None
    for i, c in enumerate(rest):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), ""


def parse(text: str) -> Tuple[str, List[Key]]:
    """(the file's header comment, its keys with their values and comments) of one config file."""
    lines = text.splitlines()
    header: List[str] = []
    i = 0
    while i < len(lines) and lines[i].startswith("#"):
        header.append(lines[i].lstrip("#").strip())
        i += 1
    keys: List[Key] = []
    stack: List[Tuple[int, str]] = []  # (indent, name) of the mappings the line is in
    above: List[str] = []  # the comment block right above the next key
    last: Optional[Key] = None  # the key whose trailing comment a comment-only line may continue
    for line in lines[i:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            if last is not None and line.startswith(" ") and last.about:
                last.about += " " + stripped.lstrip("#").strip()
            else:
                above.append(stripped.lstrip("#").strip())
                last = None
            continue
        m = _KEY.match(line)
        if not m:  # blank lines, list items
            above, last = [], None
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, comment = _split_comment(m.group(3))
        name = ".".join([s for _, s in stack] + [m.group(2)])
        key = Key(name, value, comment or " ".join(above))
        keys.append(key)
        above, last = [], (key if comment else None)
        if not value:
            stack.append((indent, m.group(2)))
    return " ".join(header), keys


def _sentences(header: str) -> str:
    """A config file's header without the sentences about its schema (how it is typed, not what it does)."""
    parts = re.split(r"(?<=[.:])\s+(?=[A-Z])", header)
    return " ".join(p for p in parts if "schema" not in p and not p.startswith("Typed by"))


def _read(path: str) -> str:
    return importlib.resources.files(CONF_MODULE).joinpath(path).read_text()


def _defaults() -> Dict[str, str]:
    """Each group's default option, from conf/config.yaml's defaults list."""
    listed = OmegaConf.create(_read("config.yaml")).defaults
    return {k: v for entry in listed if isinstance(entry, DictConfig) for k, v in entry.items()}


DEFAULTS = _defaults()


def options(group: str) -> List[str]:
    folder = importlib.resources.files(CONF_MODULE).joinpath(group)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def described_keys(group: str, option: str) -> Dict[str, Tuple[str, str]]:
    """``{key: (default as written, description)}`` of one option's own top-level keys (``_target_`` and the
    defaults list left out); see [Note: help from the configs]."""
    _, keys = parse(_read(f"{group}/{option}.yaml"))
    out = {k.name: (k.value, k.about) for k in keys if "." not in k.name and k.name not in ("defaults", "_target_")}
    fallback: Dict[str, str] = {}
    if option != DEFAULTS[group]:
        fallback = {k: about for k, (_, about) in described_keys(group, DEFAULTS[group]).items()}
    if group == "strategy":
        from lightning_mics.options import DESCRIPTIONS

        fallback = {**DESCRIPTIONS, **fallback}
    return {k: (v, about or fallback.get(k, "")) for k, (v, about) in out.items()}


def _rows(rows: List[Tuple[str, str]], indent: int = 2) -> List[str]:
    """``key=value`` then its description, wrapped under a column."""
    column = min(max((len(left) for left, _ in rows), default=0), 44) + indent + 2
    out = []
    for left, about in rows:
        first = " " * indent + left
        lead = first.ljust(column) if len(first) < column else first + "\n" + " " * column
        out.append(textwrap.fill(about or "(no description)", WIDTH, initial_indent=lead,
                                 subsequent_indent=" " * column).replace("\n" + " " * column + "\n", "\n"))
    return out


def _group_options() -> List[str]:
    rows = []
    for group in GROUPS:
        for option in options(group):
            header, _ = parse(_read(f"{group}/{option}.yaml"))
            default = " (default)" if option == DEFAULTS[group] else ""
            rows.append((f"{group}={option}{default}", _sentences(header)))
    return _rows(rows)


def _group_keys(group: str, option: str) -> List[str]:
    keys = described_keys(group, option)
    if option == DEFAULTS[group]:
        title = f"{group} (the default, {group}={option}):"
    else:
        base = described_keys(group, DEFAULTS[group])
        same = [k for k in keys if k in base]
        title = (f"{group}={option}: {DEFAULTS[group]}'s keys, with these defaults:" if len(same) == len(keys)
                 else f"{group}={option}:")
    return [title, *_rows([(f"{group}.{k}={v}", about) for k, (v, about) in keys.items()])]


def _top_keys() -> List[str]:
    """The top-level config's own keys that carry a comment (seed, report, ckpt_path, the checkpoint's)."""
    _, keys = parse(_read("config.yaml"))
    rows = [(f"{k.name}={k.value}", k.about) for k in keys
            if k.about and k.value and not k.name.startswith(("hydra", "defaults")) and not k.name.endswith("_target_")]
    return ["the job itself (conf/config.yaml):", *_rows(rows)]


INTRO = """\
lightning-mics-train: the main job of lightning-mics (= python -m lightning_mics.app.train, a Hydra app). It trains
a small GPT on bytes of text with MiCS sharded data parallelism, by default on 2 CPU processes in a few minutes,
and writes train.log, checkpoints/last.ckpt, csv/metrics.csv, report.md, report.json and loss.png into a new
folder, outputs/<date>/<time>/.

  lightning-mics-train [group=option ...] [group.key=value ...]
  lightning-mics-train trainer=gpu model.n_layer=12 model.n_embd=768     # on every GPU of this machine
  lightning-mics-train data.path=$HOME/texts                             # any text file or folder
  lightning-mics-train ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt   # continue a run
  lightning-mics-train -m strategy=mics,ddp                              # a sweep, compared in sweep.md
  lightning-mics-train --cfg job [overrides]                             # print the composed config, run nothing
  lightning-mics-train --hydra-help                                      # Hydra's own flags"""


def help_text() -> str:
    """The whole help, as Hydra's ``string.Template`` takes it."""
    body = ["", "== Configuration groups ==", "Compose your configuration from those groups (group=option)", "",
            "@APP_CONFIG_GROUPS@", "", *_group_options(), "",
            "== Keys ==",
            "Override any of them with group.key=value (the default follows '='). A key not listed here is added with",
            "+group.key=value, such as +trainer.limit_val_batches=8 (any argument of lightning.pytorch.Trainer).", ""]
    for group in GROUPS:
        for option in [DEFAULTS[group], *[o for o in options(group) if o != DEFAULTS[group]]]:
            body += [*_group_keys(group, option), ""]
    body += [*_top_keys(), "", "== Config ==",
             "The composed config, with your overrides: lightning-mics-train --cfg job [overrides]"]
    text = (INTRO + "\n" + "\n".join(body)).replace("$", "$$")
    return text.replace("@APP_CONFIG_GROUPS@", "$APP_CONFIG_GROUPS") + "\n"


def register() -> None:
    """The ``app_help`` resolver that ``hydra.help.template`` in conf/config.yaml names."""
    OmegaConf.register_new_resolver("app_help", help_text, replace=True)
