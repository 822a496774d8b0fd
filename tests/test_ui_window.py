"""The main window: pages and shortcuts, status bar, remembered geometry, themes, accessible controls."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QAbstractButton, QApplication, QLineEdit, QPlainTextEdit

from tests.ui_fixtures import make_window
from ui import theme
from ui.main_window import PAGES


def test_sidebar_and_shortcuts_switch_pages(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    with qtbot.waitActive(window):    # shortcuts go to the active window
        window.show()
        window.activateWindow()
    assert [window.sidebar.item(i).text() for i in range(window.sidebar.count())] == [
        "Library", "Downloads", "Chat", "Console", "Apps", "Settings"]
    for i, name in enumerate(PAGES):
        qtbot.keyClick(window, Qt.Key(Qt.Key.Key_1 + i), Qt.KeyboardModifier.ControlModifier)
        assert window.current_page == name and window.stack.currentWidget() is window.views[name]
    window.show_page("library")
    conversations = window.services.chats.conversations()
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert window.current_page == "chat"
    assert len(window.services.chats.conversations()) == len(conversations) + 1
    qtbot.keyClick(window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)   # an empty chat is reused
    assert len(window.services.chats.conversations()) == len(conversations) + 1


def test_status_bar_shows_model_speed_and_memory(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    qtbot.waitUntil(lambda: "RAM" in window.memory_status.text(), timeout=3000)
    assert window.model_status.text() == "No model loaded"
    assert "VRAM n/a" in window.memory_status.text()          # no NVIDIA GPU on this machine
    assert "GiB /" in window.memory_status.text()
    window.services.session.stats.emit({"engine": {"decode_tokens_per_s": 12.345}})
    assert window.speed_status.text() == "12.3 tok/s"


def test_geometry_and_page_are_remembered(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    window.show()
    window.resize(QSize(720, 520))   # inside the offscreen screen (800x600), so nothing clamps it
    window.show_page("console")
    qtbot.wait(20)
    window.close()
    assert (window.services.paths.config / "window.ini").exists()
    again = make_window(qtbot, tmp_path)
    again.show()
    assert again.current_page == "console"
    assert again.size() == QSize(720, 520)
    again.close()


def test_themes_follow_the_setting(qtbot):
    app = QApplication.instance()
    t = theme.Theme()
    assert t.apply(app, "dark") == "dark"
    assert app.palette().color(QPalette.ColorRole.Window).name() == theme.DARK.window
    assert theme.DARK.code_bg in app.styleSheet()
    assert t.apply(app, "light") == "light"
    assert app.palette().color(QPalette.ColorRole.Window).name() == theme.LIGHT.window
    assert theme.resolve("system") in ("light", "dark")     # whatever the OS says
    assert "@" not in theme.stylesheet(theme.LIGHT).replace("@name@", "")   # every colour token replaced
    icon = theme.icon("chat")
    assert not icon.isNull() and icon.availableSizes()


def test_theme_setting_applies_at_once(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    app = QApplication.instance()
    page = window.views["settings"]
    page.editors["theme"].editor.setCurrentIndex(2)          # dark
    assert page.save() == ["theme"]
    assert window.theme.choice == "dark" and window.theme.mode == "dark"
    assert app.palette().color(QPalette.ColorRole.Window).name() == theme.DARK.window
    window.theme.apply(app, "light")                          # leave the app as other tests expect it


def test_every_control_has_an_accessible_name(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    window.show()
    missing = []
    for name, view in window.views.items():
        for widget in view.findChildren(QAbstractButton) + view.findChildren(QLineEdit) + \
                view.findChildren(QPlainTextEdit):
            if widget.parent() is not None and widget.objectName().startswith("qt_"):
                continue   # Qt's own internals (spin box arrows, scroll area corners)
            if not (widget.accessibleName() or widget.text() if isinstance(widget, QAbstractButton)
                    else widget.accessibleName()):
                missing.append(f"{name}: {type(widget).__name__}")
    assert missing == []


def test_sending_without_a_model_says_what_to_do(qtbot, tmp_path):
    window = make_window(qtbot, tmp_path)
    window.show_page("chat")
    chat = window.views["chat"]
    chat.input.setPlainText("hello")
    assert chat.send() is False
    assert chat.banner.label.text() == "No model is loaded. Load one in the Library first."
    assert chat.input.toPlainText() == "hello"                      # nothing typed is lost
    assert all(not window.services.chats.messages(c.id) for c in window.services.chats.conversations())
    assert window.services.session.client is None                   # no worker was started for nothing


def test_emitting_signals_keeps_python_intact():
    """PySide6 6.12.0 on Python 3.11 drops a reference to True on every Python-side emit; after a few
    thousand token events the interpreter aborts. pyproject excludes it; this catches a build that has it."""
    import sys

    from PySide6.QtCore import QObject, Signal

    class Emitter(QObject):
        event = Signal(dict)

    emitter = Emitter()
    received = []
    emitter.event.connect(received.append)
    before = sys.getrefcount(True)
    for i in range(500):
        emitter.event.emit({"type": "delta", "i": i})
    assert len(received) == 500
    assert sys.getrefcount(True) - before > -50   # a leaking build loses 500
