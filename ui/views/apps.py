"""Apps: the local API (endpoints with copy buttons, on/off, port, API key) and one-click agent setup.

Server options are the same settings as the Settings page (app.settings); a change is saved and
sent to the worker. Agent setup goes through app.agents.setup.AgentSetup: the exact change is
shown first, applying writes a backup, and Undo restores the user's file.
"""
from __future__ import annotations

import secrets

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QFormLayout, QFrame, QGridLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from app.agents.base import AgentConfigError, Endpoint
from app.agents.setup import AgentSetup, Change
from app.agents.targets import AGENTS
from app.settings import Settings
from ui import theme
from ui.session import EngineSession
from ui.widgets.banner import Badge

API_KEY_BYTES = 24


def copy_button(text_source, what: str) -> QPushButton:
    button = QPushButton("Copy")
    button.setIcon(theme.icon("copy"))
    button.setAccessibleName(f"Copy {what}")
    button.clicked.connect(lambda: QGuiApplication.clipboard().setText(text_source()))
    return button


class AppsView(QWidget):
    def __init__(self, settings: Settings, session: EngineSession, agent_setup: AgentSetup,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.session = session
        self.agent_setup = agent_setup
        self.pending_change: Change | None = None
        title = QLabel("Apps")
        title.setObjectName("PageTitle")

        # -- the API server --------------------------------------------------------------
        server = QFrame()
        server.setObjectName("Card")
        form = QFormLayout(server)
        heading = QLabel("Local API")
        heading.setObjectName("SectionTitle")
        self.server_badge = Badge("stopped", "warn")
        head_row = QHBoxLayout()
        head_row.addWidget(heading)
        head_row.addWidget(self.server_badge)
        head_row.addStretch(1)
        form.addRow(head_row)
        self.enabled = QCheckBox("Serve the OpenAI and Anthropic API while a model is loaded")
        self.enabled.setAccessibleName("Serve the API")
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setAccessibleName("API port")
        self.port.setMaximumWidth(120)
        self.openai_url = QLineEdit()
        self.anthropic_url = QLineEdit()
        for field, name in ((self.openai_url, "OpenAI base URL"), (self.anthropic_url, "Anthropic base URL")):
            field.setReadOnly(True)
            field.setAccessibleName(name)
        self.api_key = QLineEdit()
        self.api_key.setReadOnly(True)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setAccessibleName("API key")
        self.api_key.setPlaceholderText("none: only this computer can connect")
        self.show_key = QPushButton("Show")
        self.show_key.setCheckable(True)
        self.show_key.setAccessibleName("Show the API key")
        self.show_key.toggled.connect(lambda on: self.api_key.setEchoMode(
            QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password))
        self.regenerate_key = QPushButton("New key")
        self.regenerate_key.setAccessibleName("Generate a new API key")
        self.regenerate_key.clicked.connect(self.new_api_key)
        self.clear_key = QPushButton("No key")
        self.clear_key.setAccessibleName("Remove the API key")
        self.clear_key.clicked.connect(lambda: self._save_server(api_key=""))
        form.addRow(self.enabled)
        form.addRow("Port", self.port)
        form.addRow("OpenAI", self._row(self.openai_url, copy_button(self.openai_url.text, "the OpenAI base URL")))
        form.addRow("Anthropic", self._row(self.anthropic_url,
                                           copy_button(self.anthropic_url.text, "the Anthropic base URL")))
        form.addRow("API key", self._row(self.api_key, self.show_key, self.regenerate_key, self.clear_key,
                                         copy_button(self.api_key.text, "the API key")))
        self.server_message = QLabel()
        self.server_message.setProperty("muted", True)
        self.server_message.setWordWrap(True)
        form.addRow(self.server_message)
        self.enabled.toggled.connect(lambda on: self._save_server(server_enabled=on))
        self.port.editingFinished.connect(lambda: self._save_server(server_port=self.port.value()))

        # -- coding agents ---------------------------------------------------------------
        agents = QFrame()
        agents.setObjectName("Card")
        grid = QGridLayout(agents)
        heading = QLabel("Coding agents")
        heading.setObjectName("SectionTitle")
        grid.addWidget(heading, 0, 0, 1, 4)
        self.agent_status: dict[str, QLabel] = {}
        self.agent_buttons: dict[str, tuple[QPushButton, QPushButton]] = {}
        for row, agent in enumerate(AGENTS, start=1):
            name = QLabel(agent.display)
            status = QLabel()
            status.setProperty("muted", True)
            setup = QPushButton("Set up…" if agent.writes_config else "How to")
            setup.setAccessibleName(f"Set up {agent.display}")
            setup.clicked.connect(lambda _=False, a=agent: self.preview(a.name))
            undo = QPushButton("Undo")
            undo.setAccessibleName(f"Undo the {agent.display} setup")
            undo.setVisible(agent.writes_config)
            undo.clicked.connect(lambda _=False, a=agent: self.undo(a.name))
            grid.addWidget(name, row, 0)
            grid.addWidget(status, row, 1)
            grid.addWidget(setup, row, 2)
            grid.addWidget(undo, row, 3)
            grid.setColumnStretch(1, 1)
            self.agent_status[agent.name] = status
            self.agent_buttons[agent.name] = (setup, undo)
        self.preview_text = QPlainTextEdit()
        self.preview_text.setReadOnly(True)
        self.preview_text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.preview_text.setAccessibleName("The change agent setup will make")
        self.preview_text.setMinimumHeight(140)
        self.apply_button = QPushButton("Apply this change")
        self.apply_button.setProperty("primary", True)
        self.apply_button.setAccessibleName("Apply the agent change")
        self.apply_button.clicked.connect(self.apply_pending)
        self.agent_message = QLabel()
        self.agent_message.setWordWrap(True)
        self.agent_message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        last = len(AGENTS) + 1
        grid.addWidget(self.preview_text, last, 0, 1, 4)
        grid.addWidget(self.agent_message, last + 1, 0, 1, 3)
        grid.addWidget(self.apply_button, last + 1, 3)
        self.preview_text.hide()
        self.apply_button.hide()

        body = QWidget()
        column = QVBoxLayout(body)
        column.addWidget(title)
        column.addWidget(server)
        column.addWidget(agents)
        column.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(scroll)

        session.server_state.connect(self.on_server_state)
        session.model_changed.connect(self.refresh_agents)
        self.load()

    @staticmethod
    def _row(*widgets) -> QWidget:
        holder = QWidget()
        row = QHBoxLayout(holder)
        row.setContentsMargins(0, 0, 0, 0)
        for i, widget in enumerate(widgets):
            row.addWidget(widget, 1 if i == 0 else 0)
        return holder

    # -- server ----------------------------------------------------------------------------
    def endpoint(self) -> Endpoint:
        host = self.settings.get("server_host")
        return Endpoint(host="127.0.0.1" if host in ("0.0.0.0", "::") else host, port=self.settings.get("server_port"),
                        api_key=self.settings.get("api_key"), model=self.session.model_id or "freetoken",
                        context_window=self.session.context_length or self.settings.get("context_length"))

    def load(self) -> None:
        for widget in (self.enabled, self.port):
            widget.blockSignals(True)
        self.enabled.setChecked(self.settings.get("server_enabled"))
        self.port.setValue(self.settings.get("server_port"))
        for widget in (self.enabled, self.port):
            widget.blockSignals(False)
        ep = self.endpoint()
        self.openai_url.setText(ep.openai_base)
        self.anthropic_url.setText(ep.origin)
        self.api_key.setText(self.settings.get("api_key"))
        self.refresh_agents()

    def new_api_key(self) -> str:
        key = "ft-" + secrets.token_urlsafe(API_KEY_BYTES)
        self._save_server(api_key=key)
        return key

    def _save_server(self, **values) -> None:
        for key, value in values.items():
            self.settings.set(key, value)
        self.settings.save()
        self.load()
        self.session.set_server(enable=self.settings.get("server_enabled"), host=self.settings.get("server_host"),
                                port=self.settings.get("server_port"), api_key=self.settings.get("api_key"))

    def on_server_state(self, state: dict) -> None:
        running = bool(state.get("running"))
        self.server_badge.set("running" if running else "stopped", "good" if running else "warn")
        self.server_message.setText(state.get("message") or (f"Serving at {state['url']}" if state.get("url") else ""))

    # -- agents ----------------------------------------------------------------------------
    def refresh_agents(self) -> None:
        for agent in AGENTS:
            label = self.agent_status[agent.name]
            if not agent.writes_config:
                label.setText("set up by hand (instructions)")
                continue
            model = self.agent_setup.configured_model(agent)
            if model is None:
                label.setText("not set up")
            elif self.session.model_id and model != self.session.model_id:
                label.setText(f"set up for {model} — set up again to use {self.session.model_id}")
            else:
                label.setText(f"set up for {model}")

    def preview(self, agent_name: str) -> None:
        agent = next(a for a in AGENTS if a.name == agent_name)
        self.preview_text.show()
        ep = self.endpoint()
        if not agent.writes_config:
            env = agent.env(ep)
            text = agent.instructions(ep)
            if env:
                text += "\n\n" + "\n".join(f"{k}={v}" for k, v in env.items())
            self.preview_text.setPlainText(text)
            self.pending_change = None
            self.apply_button.hide()
            self.agent_message.setText(f"{agent.display} is set up by hand; copy what it needs from above.")
            return
        try:
            change = self.agent_setup.plan(agent, ep)
        except AgentConfigError as exc:
            self.pending_change = None
            self.apply_button.hide()
            self.preview_text.setPlainText("")
            self.agent_message.setText(f"Cannot set up {agent.display}: {exc}")
            return
        self.pending_change = change
        self.preview_text.setPlainText(change.diff() if change.changed else "(already set up: nothing to change)")
        self.apply_button.setVisible(change.changed)
        self.agent_message.setText(f"{agent.display}: {change.path} — review the change, then apply it. "
                                   "A backup of the current file is kept.")

    def apply_pending(self) -> None:
        change, self.pending_change = self.pending_change, None
        if change is None:
            return
        try:
            backup = self.agent_setup.apply(change)
        except (OSError, AgentConfigError) as exc:
            self.agent_message.setText(f"Setup failed, nothing was changed: {exc}")
            return
        self.apply_button.hide()
        self.agent_message.setText(f"Wrote {change.path}" + (f" (backup: {backup})" if backup else ""))
        self.refresh_agents()

    def undo(self, agent_name: str) -> None:
        try:
            self.agent_message.setText(self.agent_setup.undo(agent_name))
        except (OSError, AgentConfigError) as exc:
            self.agent_message.setText(str(exc))
        self.refresh_agents()
