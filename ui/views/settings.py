"""Settings page, built from app.settings.SCHEMA: one editor per setting, grouped, validated by the schema.

Editors follow the setting's type (bool: check box, int/float: spin box with the schema's range,
choices: combo box, str: line edit). Two naming conventions add a little: keys ending in `_dir`
get a Browse button, keys ending in `_key` are masked with a Show toggle.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QLabel, QLineEdit, QPushButton, QScrollArea, QSpinBox, QVBoxLayout,
                               QWidget)

from app.settings import SCHEMA, Setting, Settings, SettingsError

INT_LIMIT = 2**31 - 1          # QSpinBox is 32-bit
FLOAT_LIMIT = 1e9
NUMBER_EDITOR_WIDTH = 220


def label_for(key: str) -> str:
    words = key.replace("_", " ").split()
    fixes = {"vram": "VRAM", "gib": "(GiB)", "mib": "(MiB/s)", "s": "", "hf": "Hugging Face", "api": "API",
             "cpu": "CPU", "dir": "folder"}
    text = " ".join(fixes.get(w, w) for w in words).replace("  ", " ").strip()
    return text[:1].upper() + text[1:]


class SettingEditor(QWidget):
    """One setting's editor; `value()` returns the typed value, `set_value` shows one."""

    changed = Signal()

    def __init__(self, setting: Setting, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setting = setting
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        s = setting
        if s.type is bool:
            self.editor = QCheckBox()
            self.editor.toggled.connect(self.changed)
        elif s.choices is not None:
            self.editor = QComboBox()
            self.editor.addItems([str(c) for c in s.choices])
            self.editor.currentIndexChanged.connect(self.changed)
        elif s.type is int:
            self.editor = QSpinBox()
            self.editor.setRange(int(s.minimum if s.minimum is not None else -INT_LIMIT),
                                 int(min(s.maximum if s.maximum is not None else INT_LIMIT, INT_LIMIT)))
            self.editor.valueChanged.connect(self.changed)
        elif s.type is float:
            self.editor = QDoubleSpinBox()
            self.editor.setDecimals(2)
            self.editor.setRange(s.minimum if s.minimum is not None else -FLOAT_LIMIT,
                                 s.maximum if s.maximum is not None else FLOAT_LIMIT)
            self.editor.valueChanged.connect(self.changed)
        else:
            self.editor = QLineEdit()
            self.editor.setPlaceholderText(s.description.split("(")[-1].rstrip(").") if "(" in s.description else "")
            self.editor.textChanged.connect(self.changed)
            if s.key.endswith("_key"):
                self.editor.setEchoMode(QLineEdit.EchoMode.Password)
        if isinstance(self.editor, (QSpinBox, QDoubleSpinBox, QComboBox)):
            self.editor.setMaximumWidth(NUMBER_EDITOR_WIDTH)
        self.editor.setAccessibleName(label_for(s.key))
        self.editor.setAccessibleDescription(s.description)
        self.editor.setToolTip(s.description)
        layout.addWidget(self.editor, 1 if isinstance(self.editor, QLineEdit) else 0)
        if not isinstance(self.editor, QLineEdit):
            layout.addStretch(1)
        if s.type is str and s.key.endswith("_dir"):
            browse = QPushButton("Browse…")
            browse.setAccessibleName(f"Choose the {label_for(s.key).lower()}")
            browse.clicked.connect(self._browse)
            layout.addWidget(browse)
        if s.type is str and s.key.endswith("_key"):
            show = QPushButton("Show")
            show.setCheckable(True)
            show.setAccessibleName(f"Show the {label_for(s.key)}")
            show.toggled.connect(lambda on: self.editor.setEchoMode(
                QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password))
            layout.addWidget(show)

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, label_for(self.setting.key), self.editor.text())
        if folder:
            self.editor.setText(folder)

    def value(self) -> Any:
        e, s = self.editor, self.setting
        if isinstance(e, QCheckBox):
            return e.isChecked()
        if isinstance(e, QComboBox):
            return s.choices[e.currentIndex()]
        if isinstance(e, (QSpinBox, QDoubleSpinBox)):
            return s.type(e.value())
        return e.text().strip()

    def set_value(self, value: Any) -> None:
        e, s = self.editor, self.setting
        if isinstance(e, QCheckBox):
            e.setChecked(bool(value))
        elif isinstance(e, QComboBox):
            e.setCurrentIndex(list(s.choices).index(value))
        elif isinstance(e, (QSpinBox, QDoubleSpinBox)):
            e.setValue(value)
        else:
            e.setText(str(value))


class SettingsView(QWidget):
    """Emits `saved(list of changed keys)` after the values were validated and written."""

    saved = Signal(list)

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.editors: dict[str, SettingEditor] = {}
        outer = QVBoxLayout(self)
        title = QLabel("Settings")
        title.setObjectName("PageTitle")
        outer.addWidget(title)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        body = QWidget()
        column = QVBoxLayout(body)
        groups: dict[str, QFormLayout] = {}
        for setting in SCHEMA:
            if setting.group not in groups:
                box = QGroupBox(setting.group)
                groups[setting.group] = QFormLayout(box)
                column.addWidget(box)
            editor = SettingEditor(setting)
            editor.changed.connect(self._on_edit)
            self.editors[setting.key] = editor
            help_text = setting.description + ("  (applies after the worker restarts)" if setting.restart else "")
            hint = QLabel(help_text)
            hint.setWordWrap(True)
            hint.setProperty("muted", True)
            cell = QVBoxLayout()
            cell.setSpacing(1)
            cell.addWidget(editor)
            cell.addWidget(hint)
            groups[setting.group].addRow(label_for(setting.key), cell)
        column.addStretch(1)
        scroll.setWidget(body)
        outer.addWidget(scroll, 1)
        self.error_label = QLabel()
        self.error_label.setObjectName("Stats")
        self.error_label.setWordWrap(True)
        buttons = QHBoxLayout()
        self.defaults_button = QPushButton("Restore defaults")
        self.defaults_button.setAccessibleName("Restore every setting to its default")
        self.defaults_button.clicked.connect(self.restore_defaults)
        self.revert_button = QPushButton("Revert")
        self.revert_button.setAccessibleName("Discard unsaved changes")
        self.revert_button.clicked.connect(self.load)
        self.save_button = QPushButton("Save")
        self.save_button.setProperty("primary", True)
        self.save_button.setAccessibleName("Save settings")
        self.save_button.clicked.connect(self.save)
        buttons.addWidget(self.error_label, 1)
        buttons.addWidget(self.defaults_button)
        buttons.addWidget(self.revert_button)
        buttons.addWidget(self.save_button)
        outer.addLayout(buttons)
        self.load()

    def load(self) -> None:
        for key, editor in self.editors.items():
            editor.blockSignals(True)
            editor.editor.blockSignals(True)
            editor.set_value(self.settings.get(key))
            editor.editor.blockSignals(False)
            editor.blockSignals(False)
        self.error_label.clear()
        self.save_button.setEnabled(False)

    def restore_defaults(self) -> None:
        for setting in SCHEMA:
            self.editors[setting.key].set_value(setting.default)

    def pending(self) -> dict[str, Any]:
        return {k: e.value() for k, e in self.editors.items() if e.value() != self.settings.get(k)}

    def _on_edit(self) -> None:
        self.save_button.setEnabled(bool(self.pending()))

    def save(self) -> list[str]:
        changes = self.pending()
        errors = []
        for key, value in changes.items():
            try:
                self.editors[key].setting.validate(value)
            except SettingsError as exc:
                errors.append(str(exc))
        if errors:   # nothing is written unless every value is valid
            self.error_label.setText("; ".join(errors))
            return []
        for key, value in changes.items():
            self.settings.set(key, value)
        try:
            self.settings.save()
        except OSError as exc:
            self.error_label.setText(f"could not write {self.settings.path}: {exc}")
            return []
        self.error_label.setText("Saved." + (" Some changes apply after the worker restarts."
                                             if any(self.editors[k].setting.restart for k in changes) else ""))
        self.save_button.setEnabled(False)
        self.saved.emit(sorted(changes))
        return sorted(changes)
