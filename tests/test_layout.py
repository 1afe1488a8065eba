"""The package layout: every import points down the stages, and no file grows past ~300 lines
without saying why.

cli -> gate -> run -> reports -> targets -> engine / probes / analysis -> trace -> files /
conversation / options -> errors / version / exports. Packages of one rank do not import each other; a module may import
its own package freely. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvdiff"

RANKS = {
    "errors": 0, "version": 0, "exports": 0,
    "files": 1, "conversation": 1, "options": 1,
    "trace": 2,
    "engine": 3, "probes": 3, "analysis": 3,
    "targets": 4,
    "reports": 5,
    "run": 6,
    "gate": 7,
    "cli": 8,
    "__init__": 9, "__main__": 9,
}
MAX_LINES = 300


def _unit(module: str) -> str:
    """'kvdiff.trace.writer' -> 'trace'; 'kvdiff' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1 and parts[-2] != "kvdiff":
        parts.pop()
    return ".".join(parts) if parts != ["kvdiff", "__init__"] else "kvdiff"


def kvdiff_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every kvdiff module `path` imports, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvdiff"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "kvdiff":
                found += [(node.lineno, node.module if node.module != "kvdiff" else f"kvdiff.{a.name}")
                          for a in node.names]
    return found


def layering_violations() -> list[str]:
    """Every import whose target ranks as high as or higher than its importer's unit."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(_module_of(path))
        assert unit in RANKS, f"{path}: add its unit {unit!r} to RANKS"
        for line, target in kvdiff_imports(path):
            other = _unit(target)
            if other == unit:
                continue
            if other not in RANKS:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}, not in RANKS")
            elif RANKS[other] >= RANKS[unit]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} {unit} imports {target} "
                           f"({other} is not below {unit})")
    return bad


def test_every_import_points_down():
    assert layering_violations() == []


def test_the_check_sees_an_import_pointing_up(tmp_path, monkeypatch):
    """A negative control: a trace module importing the engine is reported."""
    fake = tmp_path / "kvdiff"
    (fake / "trace").mkdir(parents=True)
    (fake / "trace" / "bad.py").write_text("def f():\n    from kvdiff.engine import Engine\n")
    (fake / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert layering_violations() == ["kvdiff/trace/bad.py:2 trace imports kvdiff.engine (engine is not below trace)"]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_over_300_lines_without_a_reason(path):
    lines = path.read_text().count("\n")
    if lines > MAX_LINES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "Longer than" in doc, f"{path.name} has {lines} lines: split it, or say why in its docstring " \
                                     f"('Longer than ~300 lines because ...')"
