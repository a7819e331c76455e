"""The documents stay true to the code: the README's options table is generated from ``MiCSConfig``, every Note
mention resolves to one Note block (in the file the mention names, the name on one line), every ``Class.method``
and file ARCHITECTURE.md names exists, the documents' links and paths resolve, and no file cites an issue number of
a tracker this repository does not have. Reads files only: nothing is started.

Fixing a failure: the options table is rewritten by ``python docs/options_table.py --write``; a Note block is a
line holding only the bracketed name (``# `` before it in a comment); a mention names it exactly, on one line.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "docs"))
import options_table  # noqa: E402  (docs/options_table.py)

TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini")
SKIP_DIRS = {".git", "__pycache__", "outputs", "multirun", "build", "dist", ".venv", ".pytest_cache", "out"}
DOCS = ["README.md", "ARCHITECTURE.md", "CONTRIBUTING.md", "benchmarks/README.md"]
PACKAGE_DIRS = ("lightning_mics", "triton_kernels")

# written so that this file holds no bracketed Note name of its own
_N = "Note"
NOTE_OPEN = re.compile(r"\[" + _N + r":?")
NOTE_MENTION = re.compile(r"\[" + _N + r": ([^\]\n]+)\]")
NOTE_BLOCK = re.compile(r"^\s*(?:#\s*)?\[" + _N + r": ([^\]\n]+)\]\s*$")
IN_FILE = re.compile(r"^`*\s*\)?,?\s*in\s+`*([\w./-]+\.(?:py|md|ya?ml))\b")
ISSUE = re.compile(r"\b(issues?)\s+#?\d+", re.IGNORECASE)
# another project's tracker, named: "Lightning issue #20550", "pytorch issue 134191"
OTHER_TRACKERS = ("lightning", "pytorch", "torch", "triton", "deepspeed", "nccl", "gloo", "hydra", "litgpt", "timm")


def _files() -> List[str]:
    """Text files of the repository, tracked or new (not ignored), relative to its root."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
               if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(REPO).parts)]
    keep = [f for f in out if f and (f.endswith(TEXT_SUFFIXES) or f == ".ci/run") and "egg-info" not in f]
    return sorted(f for f in keep if (REPO / f).is_file() and f != "tests/project/test_docs.py")


@lru_cache(maxsize=None)
def _lines(path: str) -> Tuple[str, ...]:
    try:
        return tuple((REPO / path).read_text(encoding="utf-8").splitlines())
    except UnicodeDecodeError:
        return ()


FILES = _files()


def _notes() -> Tuple[Dict[str, List[str]], List[Tuple[str, int, str, str]]]:
    """(name -> 'file:line' of each block, [(file, line, name, text after the mention)])."""
    blocks: Dict[str, List[str]] = defaultdict(list)
    mentions = []
    for f in FILES:
        for i, line in enumerate(_lines(f), 1):
            block = NOTE_BLOCK.match(line)
            if block:
                blocks[block.group(1)].append(f"{f}:{i}")
                continue
            for m in NOTE_MENTION.finditer(line):
                mentions.append((f, i, m.group(1), line[m.end():]))
    return blocks, mentions


BLOCKS, MENTIONS = _notes()


# -- the README ------------------------------------------------------------------------------------------------
def test_readme_options_table_is_generated_from_micsconfig():
    readme = (REPO / "README.md").read_text()
    assert options_table.current(readme) == options_table.block(), (
        "README.md's options table differs from MiCSConfig's fields and options.DESCRIPTIONS: "
        "run `python docs/options_table.py --write`")


def test_every_option_has_a_description():
    from lightning_mics.options import DESCRIPTIONS, MiCSConfig

    assert list(DESCRIPTIONS) == MiCSConfig.names(), "options.DESCRIPTIONS: one line per MiCSConfig field, in order"
    assert all(d and "\n" not in d for d in DESCRIPTIONS.values())


def test_readme_is_short_and_says_what_has_run_where_first():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    heading = [i for i, line in enumerate(lines, 1) if line.startswith("#") and "What has run where" in line]
    assert heading and heading[0] <= 60, "'What has run where' belongs on the README's first screen"


def test_readme_commands_are_the_ones_ci_runs():
    readme = (REPO / "README.md").read_text()
    test_command = 'pip install -c constraints-cpu.txt -e ".[dev]" && python -m pytest -q'
    assert test_command in (REPO / ".ci" / "run").read_text()
    assert test_command in readme
    assert "pip install -c constraints-cpu.txt -e . && lightning-mics-train" in readme


# -- Note blocks and their mentions ----------------------------------------------------------------------------
def test_note_names_are_on_one_line():
    split = [f"{f}:{i}: {line.strip()}" for f in FILES for i, line in enumerate(_lines(f), 1)
             for m in NOTE_OPEN.finditer(line) if "]" not in line[m.end():]]
    assert not split, "a Note name split over two lines (grep cannot find it):\n" + "\n".join(split)


def test_every_note_is_defined_once():
    twice = {name: where for name, where in BLOCKS.items() if len(where) > 1}
    assert not twice, f"Note blocks defined more than once: {twice}"


def test_every_note_mention_resolves():
    missing = [f"{f}:{i}: {name!r}" for f, i, name, _ in MENTIONS if name not in BLOCKS]
    assert not missing, "Note mentions without a Note block:\n" + "\n".join(missing)


def test_a_note_mention_names_the_file_that_defines_it():
    wrong = []
    for f, i, name, after in MENTIONS:
        m = IN_FILE.match(after)
        if not m or name not in BLOCKS:
            continue
        named = m.group(1)
        homes = [w.rsplit(":", 1)[0] for w in BLOCKS[name]]
        if not any(h == named or h.endswith("/" + named) for h in homes):
            wrong.append(f"{f}:{i}: {name!r} said to be in {named}, defined in {homes}")
    assert not wrong, "\n".join(wrong)


# -- ARCHITECTURE.md -------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _classes() -> Dict[str, List[set]]:
    """Class name -> for each class of that name in the package, the attributes it defines (methods, class-level
    names, ``self.x`` assignments)."""
    out: Dict[str, List[set]] = defaultdict(list)
    for folder in PACKAGE_DIRS:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                names = set()
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(sub.name)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        names.add(sub.id)
                out[node.name].append(names)
    return out


def _module_defines(module: str, name: str) -> bool:
    """Whether some package module named ``module``.py defines ``name`` at its top level."""
    for folder in PACKAGE_DIRS:
        for path in (REPO / folder).rglob(f"{module}.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                    return True
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in node.targets):
                    return True
    return False


def _code_spans(path: str) -> Iterator[str]:
    text = (REPO / path).read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for m in re.finditer(r"`([^`\n]+)`", text):
        yield m.group(1).strip()


def test_architecture_names_exist():
    missing = []
    for span in _code_spans("ARCHITECTURE.md"):
        if _is_path(span):
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)", span)
        if span.startswith("lightning_mics."):
            mod, _, attr = span.rpartition(".")
            if not hasattr(importlib.import_module(mod), attr):
                missing.append(span)
        elif m and m.group(1)[0].isupper():
            if not any(m.group(2) in names for names in _classes().get(m.group(1), [])):
                missing.append(span)
        elif m and any(True for d in PACKAGE_DIRS for _ in (REPO / d).rglob(f"{m.group(1)}.py")):
            if not _module_defines(m.group(1), m.group(2)):
                missing.append(span)
    assert not missing, f"ARCHITECTURE.md names what the code does not define: {missing}"


def _is_path(span: str) -> bool:
    return bool(re.fullmatch(r"[\w./-]+", span)) and (
        span.endswith("/") or re.search(r"\.(py|md|ya?ml|toml|txt|jsonl|png)$", span) is not None)


def _path_exists(span: str) -> bool:
    span = span.rstrip("/")
    if any((REPO / base / span).exists() for base in ("", *PACKAGE_DIRS)):
        return True
    return "/" not in span and any(True for d in PACKAGE_DIRS for _ in (REPO / d).rglob(span))


def test_architecture_paths_exist():
    missing = [s for s in _code_spans("ARCHITECTURE.md") if _is_path(s) and not _path_exists(s)]
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


# -- the documents' links and paths ----------------------------------------------------------------------------
def _docs() -> List[str]:
    return [d for d in DOCS if (REPO / d).exists()] + sorted(
        str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", _docs())
def test_doc_links_resolve(doc):
    text = re.sub(r"```.*?```", "", (REPO / doc).read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (REPO / doc).parent / file if file else REPO / doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{doc}: links that do not resolve: {broken}"


@pytest.mark.parametrize("doc", _docs())
def test_doc_paths_exist(doc):
    roots = ("lightning_mics/", "tests/", "benchmarks/", "triton_kernels/", "conf/", "examples/", "docs/", ".ci/")
    missing = []
    for span in _code_spans(doc):
        path = span.split("::")[0].split(" ")[0]
        if path.startswith(roots) and re.fullmatch(r"[\w./-]+", path) and not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{doc} names paths that do not exist: {missing}"


# -- issue numbers ---------------------------------------------------------------------------------------------
def test_no_issue_numbers():
    found = []
    for f in FILES:
        for i, line in enumerate(_lines(f), 1):
            for m in ISSUE.finditer(line):
                before = line[:m.start()].rstrip().rsplit(" ", 1)[-1].strip("(`'\"").lower()
                if before not in OTHER_TRACKERS:
                    found.append(f"{f}:{i}: {line.strip()}")
    assert not found, ("issue numbers of a tracker this repository does not have (say what the change is, or name "
                       "the other project's tracker):\n" + "\n".join(found))
