"""The docs (README.md and docs/*.md) say only what is true of the tree.

- every dotted config key written in them (`model.moe.num_experts`, `data.sources.0.path=...`,
  `logging.wandb.{enabled, mode}`), every key of a ```yaml example and every key of the config
  reference table exists in the config tree, read from m6.config when the test runs (a key added
  there needs no edit here); the table names every key of the tree;
- every `python -m m6...` / `python -m bench...` module exists and runs as a script, and every
  `m6-*` console command named is one that pyproject.toml installs (or a config's name);
- every relative link resolves, anchors included; every repository path in backticks exists, and
  so does every file the README's "What is here" table names in a folder's row, and every other
  `name.py` in backticks somewhere in m6/, bench/ or tests/; every `m6.x.y` module or attribute
  named exists;
- the README's test command is the one .ci/run runs.

The checker runs on planted texts too, to show that each check reports what it should.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
import yaml

from m6.config import Config, ConfigError
from m6.config_loader import apply_overrides

ROOT = Path(__file__).resolve().parents[2]


def read_docs(root: Path = ROOT) -> dict[str, str]:
    """README.md and docs/*.md by their path relative to ``root``."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in paths}


# --- reading markdown -------------------------------------------------------------------------

FENCE = re.compile(r"^\s*```")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """(prose lines, fenced blocks): prose as (line number, line); blocks as (first line, lang, body)."""
    prose, blocks, block, lang, start = [], [], None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if block is None:
                block, lang, start = [], line.strip()[3:].strip(), n + 1
            else:
                blocks.append((start, lang, "\n".join(block)))
                block = None
        elif block is None:
            prose.append((n, line))
        else:
            block.append(line)
    return prose, blocks


INLINE_CODE = re.compile(r"`([^`\n]+)`")


def code_spans(text: str) -> list[tuple[int, str]]:
    """Every inline code span and every line of a fenced block, with its line number."""
    prose, blocks = split_fences(text)
    spans = [(n, m.group(1)) for n, line in prose for m in INLINE_CODE.finditer(line)]
    for start, _, body in blocks:
        spans += [(start + i, line) for i, line in enumerate(body.splitlines())]
    return spans


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (fenced lines are not headings)."""
    seen: dict[str, int] = {}
    for _, line in split_fences(text)[0]:
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            seen[base if not count else f"{base}-{count}"] = 1
    return set(seen)


# --- config keys ------------------------------------------------------------------------------

SECTIONS = [f.name for f in dataclasses.fields(Config)]
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "txt", "tar", "png", "html", "safetensors", "csv"}
KEY = re.compile(r"(?<![\w./\-$])(?:%s)(?:\.[A-Za-z_]\w*|\.\d+|\[\d+\])+" % "|".join(SECTIONS))


@functools.lru_cache(maxsize=None)
def key_problem(key: str) -> str | None:
    """Why ``key`` is not a key of the config tree, or None when it is (list indices count as 0)."""
    key = re.sub(r"\.\d+(?=\.|$)", ".0", re.sub(r"\[(\d+)\]", r".\1", key))
    try:
        apply_overrides({}, [f"{key}=null"], Config)  # the CLI's own check of an override's path
    except ConfigError as e:
        return str(e)
    return None


def expand_braces(head: str, rest: str) -> list[str]:
    """`head` plus the members of a `.{a, b: x|y}` group at the start of `rest` (or just `head`)."""
    m = re.match(r"\.\{([^}]*)\}", rest)
    if not m:
        return [head]
    return [f"{head}.{item.strip().split(':')[0].strip()}" for item in m.group(1).split(",") if item.strip()]


def keys_in_text(text: str) -> list[tuple[int, str]]:
    """Dotted config keys anywhere in the text (prose and code), with their line numbers."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in KEY.finditer(line):
            key, after = m.group(0), line[m.end():]
            if key.rsplit(".", 1)[-1] in FILE_SUFFIXES or after.startswith("("):
                continue  # a file name (train.py) or a call, not a key
            found += [(n, k) for k in expand_braces(key, after)]
    return found


def yaml_keys(node, path: str) -> list[str]:
    """The dotted keys of a parsed YAML config example (a list's elements count as index 0)."""
    keys = []
    if isinstance(node, dict):
        for k, v in node.items():
            keys.append(f"{path}.{k}" if path else str(k))
            keys += yaml_keys(v, keys[-1])
    elif isinstance(node, list):
        for item in node:
            keys += yaml_keys(item, f"{path}.0")
    return keys


def table_rows(text: str) -> list[tuple[int, str, list[str]]]:
    """Every markdown table row outside fences: (line, the header's first cell, the row's cells)."""
    rows, header = [], None
    for n, line in split_fences(text)[0]:
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = cells[0] if cells else ""
        elif not re.fullmatch(r"[-:| ]+", line.strip()):
            rows.append((n, header, cells))
    return rows


def reference_rows(text: str) -> list[tuple[int, str, list[str]]]:
    """Rows of a config reference table (its header's first cell: "section"): (line, section, the
    keys its cells name). In the cells after the section, each code span outside parentheses names
    a key (`name`, `name: a|b`, `name.{a, b}`, `name: [{a, b: x}]`)."""
    rows = []
    for n, header, cells in table_rows(text):
        if header != "section" or len(cells) < 2 or not re.fullmatch(r"`[\w.]+`", cells[0]):
            continue
        rest = " ".join(cells[1:])
        while re.search(r"\([^()]*\)", rest):  # remarks in parentheses hold values, not keys
            rest = re.sub(r"\([^()]*\)", "", rest)
        keys = []
        for span in INLINE_CODE.findall(rest):
            m = re.match(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(.*)", span)
            if not m:
                continue
            name, tail = m.groups()
            listed = re.match(r"\s*:\s*\[\{([^}]*)\}\]", tail)
            if listed:
                keys += [f"{name}.0.{item.strip().split(':')[0].strip()}" for item in listed.group(1).split(",")]
            else:
                keys += expand_braces(name, tail)
        rows.append((n, cells[0][1:-1], keys))
    return rows


def leaf_keys(tp=Config, path: str = "") -> list[str]:
    """Every key of the config tree that holds a value (lists of sections: index 0)."""
    keys = []
    for f in dataclasses.fields(tp):
        sub = typing.get_type_hints(tp)[f.name]
        key = f"{path}.{f.name}" if path else f.name
        item = typing.get_args(sub)[0] if typing.get_origin(sub) is list and typing.get_args(sub) else None
        if dataclasses.is_dataclass(sub):
            keys += leaf_keys(sub, key)
        elif dataclasses.is_dataclass(item):
            keys += leaf_keys(item, f"{key}.0")
        else:
            keys.append(key)
    return keys


# --- commands, paths, modules -----------------------------------------------------------------

def console_scripts(root: Path) -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command -> "module:function"."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.S | re.M)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section.group(1), re.M)) if section else {}


def module_file(root: Path, name: str) -> Path | None:
    """The file of a dotted module of the repository (a package's __init__.py), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def runnable_problem(root: Path, name: str) -> str | None:
    """Why `python -m name` would not run a script of the repository, or None."""
    path = module_file(root, name)
    if path is None:
        return f"`python -m {name}`: no module {name}"
    if path.name == "__init__.py":
        return None if (path.parent / "__main__.py").is_file() else f"`python -m {name}`: package without __main__.py"
    if not re.search(r"""^if __name__ == ["']__main__["']""", path.read_text(encoding="utf-8"), re.M):
        return f"`python -m {name}`: {path.relative_to(root)} has no `if __name__ == \"__main__\"` block"
    return None


def dotted_problem(root: Path, dotted: str) -> str | None:
    """Why `m6.a.b.name` is not a module of m6 or a name defined in its deepest module, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(root, ".".join(parts[:i]))
        if path is not None:
            break
    else:
        return f"`{dotted}`: no module {parts[0]}"
    if i == len(parts) or re.search(rf"\b{re.escape(parts[i])}\b", path.read_text(encoding="utf-8")):
        return None
    return f"`{dotted}`: {'.'.join(parts[:i])} has no {parts[i]}"


REPO_PATH = re.compile(r"(?<![\w/.$\-])((?:m6|bench|tests|configs|docs|data|\.ci)/[\w./\-*]*|train\.py|pyproject\.toml)")


def path_problem(root: Path, path: str) -> str | None:
    if "*" in path:
        return None if list(root.glob(path)) else f"`{path}`: matches no file"
    return None if (root / path).exists() else f"`{path}`: no such file or folder"


# --- the checker ------------------------------------------------------------------------------

Found = list[tuple[int, str]]  # (line number, what is wrong)


def key_problems(text: str, documented: set[str]) -> Found:
    """Config keys in the text, in YAML examples and in reference tables (adds the table's keys to
    ``documented``)."""
    found = [(n, why) for n, key in keys_in_text(text) if (why := key_problem(key))]
    for start, lang, body in split_fences(text)[1]:
        if lang in ("yaml", "yml"):
            try:
                example = yaml.safe_load(body)
            except yaml.YAMLError as e:
                found.append((start, f"the YAML example does not parse: {e}"))
                continue
            found += [(start, why) for why in map(key_problem, yaml_keys(example, "")) if why]
    for n, section, keys in reference_rows(text):
        for key in (f"{section}.{k}" for k in keys):
            why = key_problem(key)
            if why:
                found.append((n, why))
            else:
                documented.add(re.sub(r"\.\d+(?=\.|$)", ".0", key))
    return found


def command_problems(text: str, root: Path) -> Found:
    """`python -m` modules of the repository and `m6-*` console commands."""
    scripts = console_scripts(root)
    configs = {p.stem for p in (root / "configs").glob("*.yaml")}
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        found += [(n, why) for module in re.findall(r"\bpython3? -m ((?:m6|bench)(?:\.\w+)*)", line)
                  if (why := runnable_problem(root, module))]
    for n, span in code_spans(text):
        for command in re.findall(r"(?<![\w/.\-])(m6-[a-z][\w-]*)(?![\w.\-])", span):
            if command not in scripts and command not in configs:
                found.append((n, f"`{command}` is neither a command pyproject.toml installs "
                                  f"({', '.join(sorted(scripts))}) nor a config in configs/"))
    return found


@functools.lru_cache(maxsize=None)
def python_file_names(root: Path) -> frozenset[str]:
    return frozenset({f.name for top in ("m6", "bench", "tests") for f in (root / top).rglob("*.py")} |
                     {f.name for f in root.glob("*.py")})


def tree_problems(text: str, root: Path) -> Found:
    """Repository paths, file names and m6 modules named in code, and the files of layout tables."""
    py_files = python_file_names(root)
    found = []
    for n, span in code_spans(text):
        for m in REPO_PATH.finditer(span):
            if span[m.end():m.end() + 1] not in ("{", "<"):  # not a pattern: data/sample/sample-{0..2}.tar
                found += [(n, why)] if (why := path_problem(root, m.group(1).rstrip("."))) else []
        if re.fullmatch(r"\w+\.py", span.strip()) and span.strip() not in py_files:
            found.append((n, f"`{span.strip()}`: no file of that name in m6/, bench/ or tests/"))
        dotted = re.findall(r"(?<![\w./\-])(m6(?:\.[A-Za-z_]\w*)+)", span)
        for module, names in re.findall(r"\bfrom (m6(?:\.\w+)*) import ([\w, ]+)", span):
            dotted += [f"{module}.{name.strip()}" for name in names.split(",") if name.strip()]
        found += [(n, why) for d in dotted if (why := dotted_problem(root, d))]
    for n, _, cells in table_rows(text):  # a folder's row names files of that folder (or train.py)
        folder = re.fullmatch(r"`([\w./\-]+/)`", cells[0]) if cells else None
        if folder and (root / folder.group(1)).is_dir():
            for file in INLINE_CODE.findall(" ".join(cells[1:])):
                if re.fullmatch(r"\w+\.py", file) and not (root / folder.group(1) / file).is_file() \
                        and not (root / file).is_file():
                    found.append((n, f"`{file}` is not in {folder.group(1)}"))
    return found


def link_problems(name: str, docs: dict[str, str], root: Path) -> Found:
    """Relative links and images: the target exists in the repository, a markdown anchor is a heading."""
    found = []
    for n, line in split_fences(docs[name])[0]:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = ((root / name).parent / file).resolve() if file else (root / name).resolve()
            if not dest.exists() or root.resolve() not in (dest, *dest.parents):
                found.append((n, f"link to {target}: no such file in the repository"))
            elif anchor and dest.suffix == ".md":
                target_text = docs.get(dest.relative_to(root.resolve()).as_posix()) or dest.read_text(encoding="utf-8")
                if anchor not in anchors(target_text):
                    found.append((n, f"link to {target}: {file or name} has no heading #{anchor}"))
    return found


def check_docs(docs: dict[str, str], root: Path = ROOT) -> list[str]:
    """Every problem found in ``docs`` (relative path -> markdown text), one line each."""
    problems: list[str] = []
    documented: set[str] = set()
    for name, text in docs.items():
        found = key_problems(text, documented) + command_problems(text, root) + tree_problems(text, root) \
            + link_problems(name, docs, root)
        problems += [f"{name}:{n}: {why}" for n, why in sorted(found)]
    if not documented:
        return problems + ["no config reference table (header `section`, rows `section` | `key`, ...) in the docs"]
    return problems + [f"config key {key} (m6/config.py) is missing from the config reference table"
                       for key in leaf_keys() if key not in documented]


# --- tests ------------------------------------------------------------------------------------

def test_docs_match_the_tree():
    problems = check_docs(read_docs())
    assert not problems, "\n".join(problems)


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    fenced = [line for _, lang, body in split_fences((ROOT / "README.md").read_text())[1] if lang == "bash"
              for line in body.splitlines()]
    assert ci[-1] in fenced, f".ci/run runs {ci[-1]!r}, which is not the README's test command"


def test_readme_training_commands_run_in_the_order_shown():
    """checkpoint.resume=auto continues whatever the run dir holds: each training command of the
    README (the main job, another model, expert parallelism) trains in a run dir of its own, so
    none meets an earlier one's checkpoint (another shape, or a run already at its max_steps)."""
    from m6.config import load, run_dir

    fenced = [line for _, lang, body in split_fences((ROOT / "README.md").read_text())[1] if lang == "bash"
              for line in body.splitlines()]
    commands = [line.split("train.py --config ", 1)[1].split() for line in fenced if "train.py --config " in line]
    assert len(commands) >= 3, commands
    dirs = [run_dir(load(ROOT / config, [o for o in overrides if "=" in o])) for config, *overrides in commands]
    assert len(set(dirs)) == len(dirs), list(zip([" ".join(c) for c in commands], dirs))


def plant(docs: dict[str, str], name: str, old: str | None, new: str) -> dict[str, str]:
    """``docs`` with ``old`` replaced by ``new`` in doc ``name`` (``old`` None: ``new`` appended)."""
    if old is None:
        return {**docs, name: docs[name] + "\n" + new + "\n"}
    assert old in docs[name], (name, old)
    return {**docs, name: docs[name].replace(old, new, 1)}


YAML_EXAMPLE = "```yaml\nmodel:\n  moe:\n    num_expert: 4\n```"


def test_checker_reports_planted_mistakes():
    docs = read_docs()
    assert check_docs(docs) == []
    cases = [  # (doc, text there to replace or None to append, the planted text, what the report must say)
        ("docs/moe.md", None, "Set `model.moe.num_expert=64`.",
         "unknown config key 'model.moe.num_expert'; did you mean 'model.moe.num_experts'?"),
        ("README.md", None, "`python train.py --config configs/tiny.yaml train.max_step=50`", "'train.max_step'"),
        ("docs/data.md", None, "with data.sources.0.paths set", "'data.sources.0.paths'"),
        ("docs/data.md", None, YAML_EXAMPLE, "'model.moe.num_expert'"),
        ("docs/metrics.md", None, "`logging.tensorboard.{enabled, folder}`", "'logging.tensorboard.folder'"),
        ("docs/training.md", "`tensorboard.{enabled, dir}`", "`tensorboard.{enabled, folder}`", "'logging.tensorboard.folder'"),
        ("docs/training.md", "`eval_every`,", "`eval_every`, `eval_steps`,", "'train.eval_steps'"),
        ("docs/training.md", "`max_bad_steps`, ", "", "config key train.max_bad_steps (m6/config.py) is missing"),
        ("docs/checkpoints.md", None, "`python -m m6.train.checkpoint info PATH`", "no module m6.train.checkpoint"),
        ("docs/metrics.md", None, "`python -m m6.report.figure RUN_DIR`", "has no `if __name__"),
        ("docs/training.md", None, "`m6-inspector CONFIG`", "`m6-inspector` is neither a command"),
        ("docs/training.md", None, "`configs/tiny.yml`", "`configs/tiny.yml`: no such file"),
        ("docs/moe.md", None, "`m6/train/expert_gemm.py`", "`m6/train/expert_gemm.py`: no such"),
        ("docs/memory.md", None, "`activation_plan.py`", "`activation_plan.py`: no file of that name"),
        ("README.md", "`recompute_plan.py`", "`activation_plan.py`", "`activation_plan.py` is not in m6/memory/"),
        ("docs/moe.md", None, "`m6.moe.dispatch.host_floats`", "m6.moe.dispatch has no host_floats"),
        ("docs/moe.md", None, "```python\nfrom m6.moe import MoELayer, MoERouter\n```", "m6.moe has no MoERouter"),
        ("docs/bad-input.md", None, "[data](dat.md)", "link to dat.md: no such file"),
        ("README.md", None, "[the model](docs/planning.md#the-modle)", "has no heading #the-modle"),
        ("README.md", None, "![report](docs/report.png)", "link to docs/report.png"),
    ]
    for doc, old, new, expected in cases:
        problems = check_docs(plant(docs, doc, old, new))
        assert any(expected in p for p in problems), (doc, new, problems)
        assert all(p.startswith(doc) or p.startswith("config key") for p in problems), problems


@pytest.mark.parametrize("key", ["data.sources[0].path", "data.sources.0.format", "logging.wandb.mode",
                                 "data.tasks.caption", "model.moe"])
def test_keys_the_cli_accepts_are_keys(key):
    assert key_problem(key) is None
