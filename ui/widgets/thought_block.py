"""The model's reasoning, folded into one line: "Thinking…" while it streams, "Thought for N s" after."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QLabel, QToolButton, QVBoxLayout, QWidget


def thought_label(seconds: float | None) -> str:
    if seconds is None:
        return "Thinking…"
    if seconds < 1:
        return "Thought for less than a second"
    if seconds < 60:
        return f"Thought for {seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"Thought for {minutes} min {rest} s"


class ThoughtBlock(QFrame):
    """Collapsed by default; the header button toggles the reasoning text."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ThoughtBlock")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 0, 0, 0)
        layout.setSpacing(2)
        self.toggle = QToolButton()
        self.toggle.setCheckable(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.toggle.setAutoRaise(True)
        self.toggle.toggled.connect(self.set_expanded)
        self.body = QLabel()
        self.body.setWordWrap(True)
        self.body.setTextFormat(Qt.TextFormat.PlainText)
        self.body.setProperty("muted", True)
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.body.setVisible(False)
        layout.addWidget(self.toggle)
        layout.addWidget(self.body)
        self.seconds: float | None = None
        self.set_seconds(None)

    def set_text(self, reasoning: str) -> None:
        self.body.setText(reasoning.strip())

    def set_seconds(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.toggle.setText(thought_label(seconds))
        self.toggle.setAccessibleName(self.toggle.text() + " (show or hide the reasoning)")

    @property
    def expanded(self) -> bool:
        return self.toggle.isChecked()

    def set_expanded(self, expanded: bool) -> None:
        if self.toggle.isChecked() != expanded:
            self.toggle.setChecked(expanded)
            return
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if expanded else Qt.ArrowType.RightArrow)
        self.body.setVisible(expanded)
