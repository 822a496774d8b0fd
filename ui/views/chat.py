"""Chat: conversations on the left, the selected one on the right, streamed from the worker.

The view keeps no conversation state of its own: app.chats.ChatStore holds the history, the
engine session streams answers. One answer streams at a time; its deltas are coalesced and
drawn at most every STREAM_REDRAW_MS so a fast model cannot flood the event loop.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from PySide6.QtCore import QItemSelectionModel, Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QDoubleSpinBox, QFormLayout, QFrame, QHBoxLayout, QLabel, QListView, QPlainTextEdit,
                               QPushButton, QScrollArea, QSizePolicy, QSpinBox, QSplitter, QVBoxLayout, QWidget)

from app.chats import ChatSampling, ChatStore, ChatStoreError, Message
from ui import theme
from ui.models.conversations import ID_ROLE, ConversationListModel
from ui.session import EngineSession, SessionError
from ui.widgets.banner import Banner
from ui.widgets.message_widget import MessageWidget

STREAM_REDRAW_MS = 40


class StreamingAnswer:
    """What has arrived so far for one assistant message."""

    def __init__(self, request_id: str, message_id: int) -> None:
        self.request_id = request_id
        self.message_id = message_id
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.reasoning_started: float | None = None
        self.thought_s: float | None = None

    def add(self, delta: dict[str, Any]) -> None:
        kind = delta.get("kind")
        now = time.monotonic()
        if kind == "reasoning":
            if self.reasoning_started is None:
                self.reasoning_started = now
            self.reasoning += delta.get("text", "")
            return
        if self.reasoning_started is not None and self.thought_s is None:
            self.thought_s = now - self.reasoning_started
        if kind == "text":
            self.text += delta.get("text", "")
        elif kind == "tool_call":
            index = int(delta.get("index", 0))
            while len(self.tool_calls) <= index:
                self.tool_calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call = self.tool_calls[index]
            if delta.get("call_id"):
                call["id"] = delta["call_id"]
            if delta.get("name"):
                call["function"]["name"] = delta["name"]
            call["function"]["arguments"] += delta.get("arguments", "")

    @property
    def thinking(self) -> bool:
        return self.reasoning_started is not None and self.thought_s is None


class SamplingPanel(QFrame):
    """System prompt and sampling settings of the open conversation."""

    apply = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("Card")
        form = QFormLayout(self)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("You are a helpful assistant.")
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setFixedHeight(80)
        self.temperature = self._spin(QDoubleSpinBox(), 0.0, 5.0, "Temperature", step=0.05)
        self.top_p = self._spin(QDoubleSpinBox(), 0.01, 1.0, "Top p", step=0.01)
        self.top_k = self._spin(QSpinBox(), 0, 1000, "Top k")
        self.max_tokens = self._spin(QSpinBox(), 1, 1_000_000, "Maximum new tokens")
        form.addRow("System prompt", self.system_prompt)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top p", self.top_p)
        form.addRow("Top k (0: off)", self.top_k)
        form.addRow("Max new tokens", self.max_tokens)
        save = QPushButton("Apply to this chat")
        save.setAccessibleName("Apply system prompt and sampling to this chat")
        save.clicked.connect(self.apply)
        form.addRow(save)

    @staticmethod
    def _spin(box, low, high, name, step=None):
        box.setRange(low, high)
        if step:
            box.setSingleStep(step)
        box.setAccessibleName(name)
        return box

    def show_settings(self, system_prompt: str, sampling: ChatSampling) -> None:
        self.system_prompt.setPlainText(system_prompt)
        self.temperature.setValue(sampling.temperature)
        self.top_p.setValue(sampling.top_p)
        self.top_k.setValue(sampling.top_k)
        self.max_tokens.setValue(sampling.max_tokens)

    def sampling(self, base: ChatSampling) -> ChatSampling:
        return ChatSampling(**{**asdict(base), "temperature": self.temperature.value(), "top_p": self.top_p.value(),
                               "top_k": self.top_k.value(), "max_tokens": self.max_tokens.value()})


class ChatView(QWidget):
    answer_finished = Signal(int, dict)   # assistant message id, its stats

    def __init__(self, store: ChatStore, session: EngineSession, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.session = session
        self.conversation_id: int | None = None
        self.widgets: dict[int, MessageWidget] = {}
        self.streaming: StreamingAnswer | None = None
        self._editing: int | None = None
        self._redraw = QTimer(self)
        self._redraw.setSingleShot(True)
        self._redraw.setInterval(STREAM_REDRAW_MS)
        self._redraw.timeout.connect(self._draw_stream)

        # left: conversations
        self.model = ConversationListModel(store, self)
        self.list = QListView()
        self.list.setModel(self.model)
        self.list.setAccessibleName("Conversations")
        self.list.selectionModel().currentChanged.connect(
            lambda current, _prev: self.open(current.data(ID_ROLE)) if current.isValid() else None)
        self.new_button = QPushButton("New chat")
        self.new_button.setIcon(theme.icon("new"))
        self.new_button.setAccessibleName("New chat")
        self.new_button.clicked.connect(self.new_chat)
        self.delete_button = QPushButton("Delete")
        self.delete_button.setIcon(theme.icon("delete"))
        self.delete_button.setAccessibleName("Delete this conversation")
        self.delete_button.clicked.connect(self.delete_current)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(self.new_button, 1)
        row.addWidget(self.delete_button)
        left_layout.addLayout(row)
        left_layout.addWidget(self.list, 1)

        # right: header, messages, input
        self.title = QLabel("New chat")
        self.title.setObjectName("PageTitle")
        # a long title is clipped instead of widening the page
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.model_label = QLabel()
        self.model_label.setProperty("muted", True)
        self.settings_button = QPushButton("Chat settings")
        self.settings_button.setCheckable(True)
        self.settings_button.setAccessibleName("Show system prompt and sampling settings")
        self.panel = SamplingPanel()
        self.panel.hide()
        self.panel.apply.connect(self.apply_settings)
        self.settings_button.toggled.connect(self.panel.setVisible)
        self.banner = Banner(action_text="")
        self.column = QVBoxLayout()
        self.column.setSpacing(10)
        self.column.addStretch(1)
        holder = QWidget()
        holder.setLayout(self.column)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setWidget(holder)
        self.scroll.setAccessibleName("Messages")
        self.scroll.verticalScrollBar().rangeChanged.connect(self._follow_stream)
        self.empty = QLabel("Load a model in the Library, then ask anything. Ctrl+Enter sends, Esc stops.")
        self.empty.setProperty("muted", True)
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.column.insertWidget(0, self.empty)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message the model…  (Ctrl+Enter to send)")
        self.input.setAccessibleName("Message")
        self.input.setFixedHeight(90)
        self.send_button = QPushButton("Send")
        self.send_button.setIcon(theme.icon("send"))
        self.send_button.setProperty("primary", True)
        self.send_button.setAccessibleName("Send message")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setIcon(theme.icon("stop"))
        self.stop_button.setAccessibleName("Stop generating")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        input_row = QHBoxLayout()
        input_row.addWidget(self.input, 1)
        input_row.addLayout(buttons)
        header = QHBoxLayout()
        header.addWidget(self.title, 1)
        header.addWidget(self.model_label)
        header.addWidget(self.settings_button)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 0, 0, 0)
        right_layout.addLayout(header)
        right_layout.addWidget(self.banner)
        right_layout.addWidget(self.panel)
        right_layout.addWidget(self.scroll, 1)
        right_layout.addLayout(input_row)
        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([230, 800])
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

        # Ctrl+Enter sends from anywhere in the view; Esc stops the answer.
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self, activated=self.send, context=Qt.ShortcutContext.WidgetWithChildrenShortcut)
        QShortcut(QKeySequence("Esc"), self, activated=self.stop, context=Qt.ShortcutContext.WidgetWithChildrenShortcut)

        session.delta.connect(self._on_delta)
        session.finished.connect(self._on_finished)
        session.failed.connect(self._on_failed)
        session.model_changed.connect(self._on_model_changed)
        self._on_model_changed()
        first = self.model.conversation_id(0)
        if first is not None:
            self.select(first)

    # -- conversations -------------------------------------------------------------------
    def new_chat(self) -> int:
        if self.conversation_id is not None and not self.store.messages(self.conversation_id):
            return self.conversation_id   # an empty chat is already open: reuse it
        conv = self.store.create()
        self.select(conv.id)
        self.input.setFocus()
        return conv.id

    def select(self, conversation_id: int) -> None:
        row = self.model.row_of(conversation_id)
        if row >= 0:
            self.list.selectionModel().setCurrentIndex(self.model.index(row),
                                                       QItemSelectionModel.SelectionFlag.ClearAndSelect)
        self.open(conversation_id)

    def delete_current(self) -> None:
        if self.conversation_id is None:
            return
        if self.streaming:
            self.stop()
        doomed = self.conversation_id
        self.conversation_id = None
        self.store.delete(doomed)
        first = self.model.conversation_id(0)
        if first is not None:
            self.select(first)
        else:
            self._clear()
            self.title.setText("New chat")

    def open(self, conversation_id: int | None) -> None:
        if conversation_id is None or conversation_id == self.conversation_id:
            return
        self.conversation_id = conversation_id
        conv = self.store.get(conversation_id)
        self.title.setText(conv.title)
        self.panel.show_settings(conv.system_prompt, conv.sampling)
        self._clear()
        for message in self.store.messages(conversation_id):
            self._add_widget(message)
        self._refresh_buttons()

    def apply_settings(self) -> None:
        if self.conversation_id is None:
            self.new_chat()
        conv = self.store.get(self.conversation_id)
        try:
            self.store.update(conv.id, system_prompt=self.panel.system_prompt.toPlainText(),
                              sampling=self.panel.sampling(conv.sampling))
        except ValueError as exc:
            self.banner.show_message(f"Chat settings not saved: {exc}", action_text="")

    def _clear(self) -> None:
        for widget in self.widgets.values():
            self.column.removeWidget(widget)
            widget.deleteLater()
        self.widgets.clear()
        self.empty.show()

    def _add_widget(self, message: Message) -> MessageWidget:
        widget = MessageWidget(message.id, message.role)
        widget.show_content(message.content, reasoning=message.reasoning, tool_calls=message.tool_calls,
                            thought_s=message.stats.get("thought_s"))
        if message.stats:
            widget.show_stats(message.stats)
        if message.stats.get("error"):
            widget.show_error(message.stats["error"])
        widget.edit_requested.connect(self.edit)
        widget.regenerate_requested.connect(self.regenerate)
        self.column.insertWidget(self.column.count() - 1, widget)
        self.widgets[message.id] = widget
        self.empty.hide()
        return widget

    # -- sending -------------------------------------------------------------------------
    def send(self) -> bool:
        text = self.input.toPlainText().strip()
        if not text or self.streaming is not None:
            return False
        if not self.session.model_ready:
            self.banner.show_message(self.session.not_ready_reason(), action_text="")
            return False
        if self.conversation_id is None:
            self.new_chat()
        if self._editing is not None:
            self._remove_from(self._editing)
            self._editing = None
        message = self.store.add_message(self.conversation_id, "user", text)
        self._add_widget(message)
        self.input.clear()
        self.title.setText(self.store.get(self.conversation_id).title)
        return self._answer()

    def _answer(self) -> bool:
        """Ask the model for an assistant message after the current history."""
        conv = self.store.get(self.conversation_id)
        history = self.store.api_messages(conv.id)
        sampling = {k: v for k, v in asdict(conv.sampling).items() if v is not None}
        try:
            request_id = self.session.generate(messages=history, sampling=sampling)
        except SessionError as exc:
            self.banner.show_message(str(exc), action_text="")
            return False
        self.banner.hide()
        answer = self.store.add_message(conv.id, "assistant", "")
        self.streaming = StreamingAnswer(request_id, answer.id)
        widget = self._add_widget(answer)
        widget.show_stats({})
        widget.stats.setText("waiting for the first token…")
        self._refresh_buttons()
        return True

    def stop(self) -> None:
        if self.streaming is not None:
            self.session.cancel(self.streaming.request_id)

    def regenerate(self, message_id: int) -> None:
        if self.streaming is not None:
            return
        self._remove_from(message_id)
        self._answer()

    def edit(self, message_id: int) -> None:
        if self.streaming is not None:
            return
        self.input.setPlainText(self.store.message(message_id).content)
        self.input.setFocus()
        self._editing = message_id   # sending replaces this message and everything after it

    def _remove_from(self, message_id: int) -> None:
        for mid in [m for m in self.widgets if m >= message_id]:
            widget = self.widgets.pop(mid)
            self.column.removeWidget(widget)
            widget.deleteLater()
        self.store.truncate_from(message_id)

    def _refresh_buttons(self) -> None:
        busy = self.streaming is not None
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        for widget in self.widgets.values():
            widget.set_busy(busy)

    # -- streaming -----------------------------------------------------------------------
    def _on_delta(self, request_id: str, delta: dict) -> None:
        if self.streaming is None or request_id != self.streaming.request_id:
            return
        self.streaming.add(delta)
        if not self._redraw.isActive():
            self._redraw.start()

    def _draw_stream(self) -> None:
        s = self.streaming
        if s is None or s.message_id not in self.widgets:
            return
        widget = self.widgets[s.message_id]
        widget.show_content(s.text, reasoning=s.reasoning, tool_calls=s.tool_calls, thought_s=s.thought_s,
                            thinking=s.thinking)
        widget.stats.setText("thinking…" if s.thinking else "generating…")

    def _follow_stream(self, _low: int, high: int) -> None:
        if self.streaming is not None:
            self.scroll.verticalScrollBar().setValue(high)

    def _on_finished(self, request_id: str, done: dict) -> None:
        s = self.streaming
        if s is None or request_id != s.request_id:
            return
        self._redraw.stop()
        timings, usage = done.get("timings", {}), done.get("usage", {})
        stats = {"ttft_s": timings.get("ttft_s"), "tokens_per_s": timings.get("decode_tps"),
                 "prefill_tps": timings.get("prefill_tps"), "total_s": timings.get("total_s"),
                 "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
                 "finish_reason": done.get("finish_reason"), "thought_s": s.thought_s}
        self._end_stream(stats)

    def _on_failed(self, request_id: str, code: str, message: str) -> None:
        s = self.streaming
        if s is None or (request_id and request_id != s.request_id):
            return
        self._redraw.stop()
        self._end_stream({"error": f"The answer stopped: {message}", "error_code": code, "thought_s": s.thought_s})

    def _end_stream(self, stats: dict[str, Any]) -> None:
        s = self.streaming
        self.streaming = None
        stats = {k: v for k, v in stats.items() if v is not None}
        if s.thought_s is None and s.reasoning_started is not None:
            stats["thought_s"] = time.monotonic() - s.reasoning_started
        try:   # persisted even when another conversation is open now
            self.store.update_message(s.message_id, content=s.text, reasoning=s.reasoning, tool_calls=s.tool_calls,
                                      stats=stats)
        except ChatStoreError:
            pass   # the conversation was deleted while it streamed
        if s.message_id in self.widgets:
            widget = self.widgets[s.message_id]
            widget.show_content(s.text, reasoning=s.reasoning, tool_calls=s.tool_calls,
                                thought_s=stats.get("thought_s"))
            widget.show_stats(stats)
            widget.show_error(stats.get("error", ""))
        self._refresh_buttons()
        self.answer_finished.emit(s.message_id, stats)

    def _on_model_changed(self) -> None:
        self.model_label.setText(self.session.model_id or "no model loaded")
