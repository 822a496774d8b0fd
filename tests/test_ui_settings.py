"""The settings page is generated from SCHEMA and writes through app.settings' validation."""
from __future__ import annotations

import json

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QLineEdit, QSpinBox

from app.settings import SCHEMA, Settings
from ui.views.settings import SettingsView, label_for


def test_every_setting_has_a_typed_editor(qtbot):
    view = SettingsView(Settings())
    qtbot.addWidget(view)
    assert list(view.editors) == [s.key for s in SCHEMA]
    expected = {bool: QCheckBox, int: QSpinBox, float: QDoubleSpinBox, str: QLineEdit}
    for s in SCHEMA:
        editor = view.editors[s.key].editor
        assert isinstance(editor, QComboBox if s.choices else expected[s.type]), s.key
        assert editor.accessibleName() == label_for(s.key) and editor.toolTip() == s.description
        assert view.editors[s.key].value() == s.default
    port = view.editors["server_port"].editor
    assert (port.minimum(), port.maximum()) == (1, 65535)   # the schema's range
    assert view.editors["api_key"].editor.echoMode() == QLineEdit.EchoMode.Password
    assert label_for("vram_budget_gib") == "VRAM budget (GiB)"


def test_edit_save_and_reload(qtbot, freetoken_home):
    settings = Settings()
    view = SettingsView(settings)
    qtbot.addWidget(view)
    assert not view.save_button.isEnabled()
    view.editors["server_port"].editor.setValue(8080)
    view.editors["theme"].editor.setCurrentIndex(2)           # dark
    view.editors["hf_endpoint"].editor.setText("  https://mirror.example  ")
    assert view.save_button.isEnabled()
    with qtbot.waitSignal(view.saved) as sig:
        qtbot.mouseClick(view.save_button, Qt.MouseButton.LeftButton)
    assert sig.args == [["hf_endpoint", "server_port", "theme"]]
    assert "after the worker restarts" in view.error_label.text()   # server_port needs a restart
    on_disk = json.loads(settings.path.read_text())
    assert on_disk == {"server_port": 8080, "theme": "dark", "hf_endpoint": "https://mirror.example"}
    assert not view.save_button.isEnabled()
    # revert discards unsaved edits; defaults restore the schema's values
    view.editors["context_length"].editor.setValue(4096)
    view.revert_button.click()
    assert view.editors["context_length"].value() == 32768
    view.restore_defaults()
    assert view.pending() == {"server_port": 1919, "theme": "system", "hf_endpoint": ""}


def test_invalid_values_are_not_written(qtbot, freetoken_home, monkeypatch):
    settings = Settings()
    view = SettingsView(settings)
    qtbot.addWidget(view)
    # An editor that could produce a bad value (a newer schema, a hand-edited file): nothing is written.
    monkeypatch.setattr(view.editors["device"], "value", lambda: "tpu")
    view.editors["server_port"].editor.setValue(8081)
    assert view.save() == []
    assert "device: 'tpu' is not one of auto, cpu, cuda" in view.error_label.text()
    assert not settings.path.exists() and Settings().get("server_port") == 1919
