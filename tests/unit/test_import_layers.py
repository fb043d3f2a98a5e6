"""The direction of imports inside m6 (../shared/STYLE.md), held by walking every module's AST:
every import statement counts, inside functions and ``if __name__ == "__main__"`` blocks too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "m6"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from pkg import sub`` counts ``pkg.sub``
    when that is a module of m6)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}
RAW = {name: _imports(path) for name, path in MODULES.items()}


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{src} imports {dst}" for src, dsts in RAW.items() if _in(src, importer)
                  for dst in dsts if any(_in(dst, f) for f in forbidden))


def test_the_walk_sees_the_package():
    assert "m6.train.loop" in MODULES and "m6.memory.recompute" in GRAPH["m6.memory.recompute_plan"]


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])
    assert not cycles, cycles


@pytest.mark.parametrize("importer,forbidden", [
    ("m6.config", ("m6.model", "m6.moe", "m6.data", "m6.parallel", "m6.memory", "m6.train", "m6.inspect", "m6.plan")),
    ("m6.batch_format", ("m6",)),
    ("m6.data", ("m6.model", "m6.moe", "m6.parallel", "m6.memory", "m6.train", "m6.inspect")),
    ("m6.moe", ("m6.model", "m6.data", "m6.parallel", "m6.memory", "m6.train", "m6.inspect")),
    ("m6.model", ("torch.distributed", "m6.data", "m6.parallel", "m6.memory", "m6.train", "m6.inspect")),
    ("m6.parallel", ("m6.memory", "m6.data", "m6.train", "m6.inspect")),
    ("m6.memory", ("m6.parallel", "m6.data", "m6.train", "m6.inspect")),
    ("m6.plan", ("m6.data", "m6.train", "m6.inspect")),
    # State on disk: the training loop hands in what to save and calls in; the loop is no tool.
    ("m6.checkpoint", ("m6.train", "m6.data", "m6.inspect", "m6.plan", "m6.report")),
    ("m6.train", ("m6.inspect", "m6.plan", "m6.report", "torch.distributed.checkpoint")),
    # The report reads a run dir's files only, so it draws on a machine without torch.
    ("m6.report", ("torch", "m6.train", "m6.model", "m6.moe", "m6.parallel", "m6.memory", "m6.data", "m6.inspect")),
])
def test_imports_point_one_way(importer, forbidden):
    assert not _violations(importer, forbidden)


def test_nothing_imports_the_entry_script():
    assert not [src for src, dsts in RAW.items() if "train" in dsts]
