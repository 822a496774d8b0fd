"""A strip across the top of a page: what went wrong in plain words, and the one action that fixes it."""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

from ui import theme


class Banner(QFrame):
    action = Signal()

    def __init__(self, *, action_text: str = "", error: bool = True, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Banner" if error else "InfoBanner")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 6, 6)
        icon = QLabel()
        icon.setPixmap(theme.icon("warning").pixmap(18, 18))
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.button = QPushButton(action_text)
        self.button.setVisible(bool(action_text))
        self.button.setAccessibleName(action_text or "Fix this")
        self.button.clicked.connect(self.action)
        self.close_button = QPushButton("Dismiss")
        self.close_button.setProperty("flat", True)
        self.close_button.setAccessibleName("Dismiss this message")
        self.close_button.clicked.connect(self.hide)
        layout.addWidget(icon)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.button)
        layout.addWidget(self.close_button)
        self.hide()

    def show_message(self, text: str, *, action_text: str | None = None) -> None:
        self.label.setText(text)
        self.setAccessibleName(text)
        if action_text is not None:
            self.button.setText(action_text)
            self.button.setAccessibleName(action_text or "Fix this")
            self.button.setVisible(bool(action_text))
        self.show()


class Badge(QLabel):
    """A small coloured pill: tone is good | warn | bad | info."""

    def __init__(self, text: str = "", tone: str = "info", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setObjectName("Badge")
        self.set(text, tone)

    def set(self, text: str, tone: str) -> None:
        self.setText(text)
        self.setProperty("tone", tone)
        self.style().unpolish(self)
        self.style().polish(self)
