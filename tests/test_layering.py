"""The layers import one way: ui -> app -> runtime. These tests read the source, so they run anywhere."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The only runtime modules allowed to touch Qt: the worker's transport (QLocalSocket).
RUNTIME_QT_ALLOWED = {"runtime/worker_transport.py", "runtime/ipc_transport.py"}


def imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from PySide6 import QtWidgets` names the submodule too
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def layering_violations(root: Path) -> list[str]:
    """Every import that breaks the layering, as 'file: module'."""
    problems = []
    for path in sorted(root.glob("runtime/**/*.py")):
        rel = path.relative_to(root).as_posix()
        for mod in imported_modules(path.read_text(encoding="utf-8")):
            top = mod.split(".")[0]
            if top in ("app", "ui"):
                problems.append(f"{rel}: {mod}")
            elif top in ("PySide6", "PyQt5", "PyQt6", "pyqtgraph") and rel not in RUNTIME_QT_ALLOWED:
                problems.append(f"{rel}: {mod}")
    for path in sorted(root.glob("app/**/*.py")):
        rel = path.relative_to(root).as_posix()
        for mod in imported_modules(path.read_text(encoding="utf-8")):
            if mod.split(".")[0] == "ui" or "QtWidgets" in mod or "QtGui" in mod or mod.startswith("pyqtgraph"):
                problems.append(f"{rel}: {mod}")
    return problems


def test_project_respects_layers():
    assert layering_violations(ROOT) == []


def test_planted_bad_imports_are_caught(tmp_path):
    # A copy of the layout with one bad import of each kind planted in it.
    (tmp_path / "runtime" / "models").mkdir(parents=True)
    (tmp_path / "app").mkdir()
    (tmp_path / "runtime" / "models" / "bad.py").write_text("from PySide6.QtCore import QObject\nimport app.paths\n")
    (tmp_path / "runtime" / "worker_transport.py").write_text("from PySide6.QtNetwork import QLocalSocket\n")
    (tmp_path / "app" / "bad.py").write_text("from PySide6 import QtWidgets\nfrom ui.main_window import MainWindow\n")
    found = layering_violations(tmp_path)
    assert sorted(found) == sorted([
        "runtime/models/bad.py: PySide6.QtCore.QObject",
        "runtime/models/bad.py: app.paths",
        "app/bad.py: PySide6.QtWidgets",
        "app/bad.py: ui.main_window.MainWindow",
    ])
