"""The page shown in place of a view whose service is not in this build: says which, and why."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget


class UnavailableView(QWidget):
    def __init__(self, title: str, reason: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.reason = reason
        heading = QLabel(title)
        heading.setObjectName("PageTitle")
        self.message = QLabel(f"{title} is not available yet: {reason}.")
        self.message.setProperty("muted", True)
        self.message.setWordWrap(True)
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.message.setAccessibleName(self.message.text())
        layout = QVBoxLayout(self)
        layout.addWidget(heading)
        layout.addStretch(1)
        layout.addWidget(self.message)
        layout.addStretch(2)
