"""Start the desktop app."""
from __future__ import annotations

import os
import sys


def run_gui(argv: list[str]) -> int:
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtWidgets import QApplication

    from app.logs import setup_logging
    from app.paths import user_paths
    from app.settings import Settings
    from ui.main_window import MainWindow
    from ui.theme import Theme

    setup_logging(user_paths().logs, name="app")
    # Fractional scale factors (125 %, 150 %) render crisp instead of rounding to whole pixels.
    QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
    qapp = QApplication.instance() or QApplication([sys.argv[0], *argv])
    qapp.setApplicationName("FreeToken")
    qapp.setOrganizationName("FreeToken")
    qapp.setDesktopFileName("freetoken")
    theme = Theme()
    theme.apply(qapp, Settings().get("theme"))
    theme.follow_os(qapp)
    window = MainWindow(app_theme=theme)
    window.show()
    # the CPU expert kernels compiled now, not inside the first large model's load (app/kernel_warmup.py)
    from app.cli import package_version
    from app.kernel_warmup import start_in_background

    window.kernel_warmup = start_in_background(user_paths().cache, package_version(), parent=window)
    quit_after_ms = os.environ.get("FREETOKEN_QUIT_AFTER_MS")
    if quit_after_ms:
        # The bundle's smoke test: close through the window (saves state, stops the worker), then quit.
        from PySide6.QtCore import QTimer

        QTimer.singleShot(int(quit_after_ms), window.close)
        QTimer.singleShot(int(quit_after_ms), qapp.quit)
    return qapp.exec()
