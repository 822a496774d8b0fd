"""Start the desktop app."""
from __future__ import annotations

import sys


def run_gui(argv: list[str]) -> int:
    from PySide6.QtWidgets import QApplication

    from app.logs import setup_logging
    from app.paths import user_paths
    from ui.main_window import MainWindow

    setup_logging(user_paths().logs, name="app")
    qapp = QApplication.instance() or QApplication([sys.argv[0], *argv])
    qapp.setApplicationName("FreeToken")
    qapp.setOrganizationName("FreeToken")
    window = MainWindow()
    window.show()
    return qapp.exec()
