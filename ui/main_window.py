"""The main window: a sidebar of pages, a banner for worker trouble, and a status bar.

Pages: Library, Downloads, Chat, Console, Apps, Settings (Ctrl+1..6). The status bar shows the
loaded model, tokens/s and VRAM/RAM at a glance. Geometry and the last page are remembered in
`window.ini` in the config folder. If the worker dies, a banner says why with a Restart button and
every page keeps working.
"""
from __future__ import annotations

from PySide6.QtCore import QSettings, QSize, Qt
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QApplication, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QMainWindow,
                               QStackedWidget, QVBoxLayout, QWidget)

from app.telemetry import Sample
from ui import theme
from ui.services import Services, optional_module
from ui.views.apps import AppsView
from ui.views.chat import ChatView
from ui.views.console import ConsoleView, engine_figures, gib
from ui.views.settings import SettingsView
from ui.views.unavailable import UnavailableView
from ui.widgets.banner import Banner

PAGES = ("library", "downloads", "chat", "console", "apps", "settings")
TITLES = {"library": "Library", "downloads": "Downloads", "chat": "Chat", "console": "Console", "apps": "Apps",
          "settings": "Settings"}
DEFAULT_SIZE = QSize(1180, 760)


class MainWindow(QMainWindow):
    def __init__(self, services: Services | None = None, *, app_theme: theme.Theme | None = None) -> None:
        super().__init__()
        self.services = services or Services.create(parent=self)
        self.theme = app_theme or theme.Theme()   # the one that follows the OS (ui/app_main.py)
        s = self.services
        self.setWindowTitle("FreeToken")
        self.setWindowIcon(theme.icon("logo"))
        self.setObjectName("MainWindow")

        self.views: dict[str, QWidget] = {
            "library": self._library_view(),
            "downloads": self._downloads_view(),
            "chat": ChatView(s.chats, s.session),
            "console": ConsoleView(s.telemetry, s.session),
            "apps": AppsView(s.settings, s.session, s.agent_setup),
            "settings": SettingsView(s.settings),
        }
        self.stack = QStackedWidget()
        self.sidebar = QListWidget()
        self.sidebar.setObjectName("SidebarList")
        self.sidebar.setAccessibleName("Pages")
        self.sidebar.setIconSize(QSize(20, 20))
        for i, name in enumerate(PAGES):
            item = QListWidgetItem(theme.icon(name), TITLES[name])
            item.setToolTip(f"{TITLES[name]} (Ctrl+{i + 1})")
            item.setData(Qt.ItemDataRole.AccessibleTextRole, TITLES[name])
            self.sidebar.addItem(item)
            self.stack.addWidget(self.views[name])
        self.sidebar.currentRowChanged.connect(self.stack.setCurrentIndex)
        side = QWidget()
        side.setObjectName("Sidebar")
        side.setFixedWidth(190)
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 8)
        app_title = QLabel("FreeToken")
        app_title.setObjectName("AppTitle")
        side_layout.addWidget(app_title)
        side_layout.addWidget(self.sidebar, 1)

        self.banner = Banner(action_text="Restart")
        self.banner.setAccessibleName("Worker problem")
        self.banner.action.connect(self.restart_worker)
        self._crash_shown = False
        main = QWidget()
        main_layout = QVBoxLayout(main)
        main_layout.setContentsMargins(12, 8, 12, 4)
        main_layout.addWidget(self.banner)
        main_layout.addWidget(self.stack, 1)
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(side)
        row.addWidget(main, 1)
        self.setCentralWidget(central)

        self.model_status = QLabel()
        self.speed_status = QLabel()
        self.memory_status = QLabel()
        for label, name in ((self.model_status, "Loaded model"), (self.speed_status, "Tokens per second"),
                            (self.memory_status, "VRAM and RAM")):
            label.setAccessibleName(name)
        self.statusBar().addWidget(self.model_status, 1)
        self.statusBar().addPermanentWidget(self.speed_status)
        self.statusBar().addPermanentWidget(self.memory_status)

        for i, name in enumerate(PAGES):
            QShortcut(QKeySequence(f"Ctrl+{i + 1}"), self, activated=lambda n=name: self.show_page(n))
        QShortcut(QKeySequence("Ctrl+N"), self, activated=self.new_chat)

        s.session.state_changed.connect(self._on_session_state)
        s.session.model_changed.connect(self._update_model_status)
        s.session.stats.connect(self._update_speed)
        s.session.crashed.connect(self._on_crash)
        s.session.worker_started.connect(self.apply_server_settings)
        s.session.load_failed.connect(lambda why: self.banner.show_message(f"The model did not load: {why}",
                                                                           action_text=""))
        s.telemetry.sampled.connect(self._update_memory)
        self.views["settings"].saved.connect(self._on_settings_saved)

        self._window_settings = QSettings(str(s.paths.config / "window.ini"), QSettings.Format.IniFormat)
        self._restore_geometry()
        self._update_model_status()
        self._update_speed({})
        s.telemetry.start()

    # -- pages -----------------------------------------------------------------------------
    def _library_view(self) -> QWidget:
        module, reason = optional_module("app.library")
        if module is None:
            return UnavailableView("Library", reason)
        from ui.views.library import LibraryView

        return LibraryView(self.services, parent=self)

    def _downloads_view(self) -> QWidget:
        module, reason = optional_module("app.downloads")
        if module is None:
            return UnavailableView("Downloads", reason)
        from ui.views.downloads import DownloadsView

        return DownloadsView(self.services, parent=self)

    def show_page(self, name: str) -> None:
        self.sidebar.setCurrentRow(PAGES.index(name))

    @property
    def current_page(self) -> str:
        return PAGES[self.stack.currentIndex()]

    def new_chat(self) -> None:
        self.show_page("chat")
        self.views["chat"].new_chat()

    # -- worker ----------------------------------------------------------------------------
    def restart_worker(self) -> None:
        self.banner.hide()
        self.services.session.restart()

    def apply_server_settings(self) -> None:
        """Each new worker serves the API as the settings say (it answers 503 until a model is loaded)."""
        settings = self.services.settings
        if settings.get("server_enabled"):
            self.services.session.set_server(enable=True, host=settings.get("server_host"),
                                             port=settings.get("server_port"), api_key=settings.get("api_key"))

    def _on_crash(self, reason: str) -> None:
        self._crash_shown = True
        self.banner.show_message(f"The FreeToken worker stopped: {reason}. Your chats are safe.",
                                 action_text="Restart")

    def _on_session_state(self, state: str) -> None:
        if state in ("ready", "loading", "idle") and self._crash_shown:
            self._crash_shown = False
            self.banner.hide()
        self._update_model_status()

    def _update_model_status(self) -> None:
        session = self.services.session
        if session.state == "ready":
            text = f"Model: {session.model_id}"
        elif session.state == "loading":
            text = f"Loading {session.model_path}…"
        elif session.state == "crashed":
            text = "Worker stopped"
        else:
            text = "No model loaded"
        self.model_status.setText(text)

    def _update_speed(self, stats: dict) -> None:
        self.speed_status.setText(engine_figures(stats or {})["tokens_per_s"].replace("not available", "— tok/s"))

    def _update_memory(self, sample: Sample) -> None:
        vram = "VRAM n/a" if sample.vram_total is None else f"VRAM {gib(sample.vram_used)} / {gib(sample.vram_total)}"
        ram = "RAM n/a" if sample.ram_total is None else f"RAM {gib(sample.ram_used)} / {gib(sample.ram_total)}"
        self.memory_status.setText(f"{vram} · {ram}")

    def _on_settings_saved(self, keys: list) -> None:
        settings = self.services.settings
        if "theme" in keys:
            app = QApplication.instance()
            if app is not None:
                self.theme.apply(app, settings.get("theme"))
        self.views["apps"].load()
        from app.settings import BY_KEY

        if any(BY_KEY[k].restart for k in keys) and self.services.session.state in ("ready", "idle", "loading"):
            self.banner.show_message("Some settings apply after the worker restarts.", action_text="Restart now")

    # -- window state ----------------------------------------------------------------------
    def _restore_geometry(self) -> None:
        geometry = self._window_settings.value("geometry")
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(DEFAULT_SIZE)
        page = self._window_settings.value("page", "library")
        self.show_page(page if page in PAGES else "library")

    def save_window_state(self) -> None:
        self._window_settings.setValue("geometry", self.saveGeometry())
        self._window_settings.setValue("page", self.current_page)
        self._window_settings.sync()

    def closeEvent(self, event) -> None:
        self.save_window_state()
        self.services.close()
        super().closeEvent(event)
