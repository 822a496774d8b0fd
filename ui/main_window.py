"""The main window (the desktop-app issue fills in the views)."""
from __future__ import annotations

from PySide6.QtWidgets import QLabel, QMainWindow


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle("FreeToken")
        self.setCentralWidget(QLabel("FreeToken"))
        self.resize(1100, 720)
