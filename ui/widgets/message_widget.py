"""One chat message: who said it, the reasoning block, the Markdown body, tool calls, and the answer's stats."""
from __future__ import annotations

import json
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from ui import theme
from ui.widgets.markdown_view import MarkdownView
from ui.widgets.thought_block import ThoughtBlock


def stats_text(stats: dict[str, Any]) -> str:
    """'TTFT 0.42 s · 17.5 tok/s · 21 prompt + 9 generated tokens · stopped'"""
    parts = []
    if stats.get("ttft_s") is not None:
        parts.append(f"TTFT {stats['ttft_s']:.2f} s")
    if stats.get("tokens_per_s") is not None:
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("prompt_tokens") is not None and stats.get("completion_tokens") is not None:
        parts.append(f"{stats['prompt_tokens']} prompt + {stats['completion_tokens']} generated tokens")
    reason = stats.get("finish_reason")
    if reason == "length":
        parts.append("stopped at the token limit")
    elif reason == "cancelled":
        parts.append("stopped by you")
    return " · ".join(parts)


def tool_call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", "")
    try:
        args = json.dumps(json.loads(args), ensure_ascii=False) if args else ""
    except (TypeError, json.JSONDecodeError):
        pass   # partial arguments while streaming: show them as they are
    return f"🔧 {fn.get('name') or 'tool'}({args})"


class MessageWidget(QFrame):
    """Signals carry the message id so the chat view can act on the stored message."""

    edit_requested = Signal(int)
    regenerate_requested = Signal(int)

    def __init__(self, message_id: int, role: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message_id = message_id
        self.role = role
        self.setObjectName("UserBubble" if role == "user" else "AssistantBubble")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        who = QLabel({"user": "You", "assistant": "Assistant", "system": "System"}.get(role, role.title()))
        who.setObjectName("SectionTitle")
        layout.addWidget(who)
        self.thought = ThoughtBlock()
        self.thought.hide()
        layout.addWidget(self.thought)
        self.body = MarkdownView()
        layout.addWidget(self.body)
        self.tools = QLabel()
        self.tools.setWordWrap(True)
        self.tools.setTextFormat(Qt.TextFormat.PlainText)
        self.tools.hide()
        layout.addWidget(self.tools)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setObjectName("Stats")
        self.error.hide()
        layout.addWidget(self.error)
        footer = QHBoxLayout()
        self.stats = QLabel()
        self.stats.setObjectName("Stats")
        footer.addWidget(self.stats, 1)
        self.copy_button = self._action("copy", "Copy", "Copy this message", self._copy)
        footer.addWidget(self.copy_button)
        if role == "user":
            self.edit_button = self._action("edit", "Edit", "Edit and resend this message",
                                            lambda: self.edit_requested.emit(self.message_id))
            footer.addWidget(self.edit_button)
        if role == "assistant":
            self.regenerate_button = self._action("regenerate", "Regenerate", "Regenerate this answer",
                                                  lambda: self.regenerate_requested.emit(self.message_id))
            footer.addWidget(self.regenerate_button)
        layout.addLayout(footer)
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []

    def _action(self, icon_name: str, text: str, accessible: str, slot) -> QPushButton:
        button = QPushButton(text)
        button.setIcon(theme.icon(icon_name))
        button.setProperty("flat", True)
        button.setAccessibleName(accessible)
        button.setToolTip(accessible)
        button.clicked.connect(slot)
        return button

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self.content)

    def set_busy(self, busy: bool) -> None:
        for name in ("edit_button", "regenerate_button"):
            if hasattr(self, name):
                getattr(self, name).setEnabled(not busy)

    def show_content(self, content: str, *, reasoning: str = "", tool_calls: list[dict[str, Any]] | None = None,
                     thought_s: float | None = None, thinking: bool = False) -> None:
        self.content = content
        self.body.set_markdown(content)
        self.reasoning = reasoning
        if reasoning:
            self.thought.set_text(reasoning)
            self.thought.set_seconds(None if thinking else thought_s)
            self.thought.show()
        self.tool_calls = list(tool_calls or [])
        self.tools.setText("\n".join(tool_call_text(c) for c in self.tool_calls))
        self.tools.setVisible(bool(self.tool_calls))

    def show_stats(self, stats: dict[str, Any]) -> None:
        self.stats.setText(stats_text(stats))
        self.stats.setAccessibleName("Answer statistics: " + self.stats.text())

    def show_error(self, text: str) -> None:
        self.error.setText(text)
        self.error.setVisible(bool(text))
