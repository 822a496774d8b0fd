"""Library: the curated catalog and local models, their fit on this PC and status, and every action
that takes a model from the hub to a chat — download, convert, load, unload, delete, show folder —
plus a detail sheet (the model card) and hub search.

The library reads the disk on every call, so rows are fetched off the UI thread and refreshed
(debounced) when a download, a conversion or the worker changes something.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from PySide6.QtCore import QObject, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QGridLayout, QHBoxLayout, QHeaderView, QLabel, QLineEdit,
                               QProgressBar, QPushButton, QScrollArea, QSplitter, QTableView, QTableWidget,
                               QTableWidgetItem, QTabWidget, QVBoxLayout, QWidget)

from app.jobs import ProcessJob, conversion_job
from app.library import CONVERTING, DOWNLOADING, NEEDS_CONVERSION, NOT_DOWNLOADED, READY, Library, LibraryError
from ui.background import run_in_thread
from ui.models.library import GIB, KEY_ROLE, LOADED, LOADING, FitBadge, LibraryModel, context_text, params_text
from ui.session import load_options
from ui.views.console import plan_lines
from ui.widgets.conversion_panel import ConversionPanel

log = logging.getLogger(__name__)

REFRESH_DEBOUNCE_MS = 300
DELETE_CONFIRM_MS = 5000
LOAD_STEPS = 1000
FIT_DELAY_MS = 1500


class FitEstimator(QObject):
    """Fit badges for the catalog from app.fit, the engine's own planner, through `freetoken models --json`.

    It runs as a child process: the estimate probes the machine and measures CPU bandwidth with torch,
    and importing torch in the window's process would stall its event loop for a second. Results are
    kept per context length; `updated(dict key -> FitBadge)` follows each run."""

    TONES = {"gpu": "good", "hybrid": "info", "cpu": "warn", "does_not_fit": "bad"}
    updated = Signal(dict)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._badges: dict[int, dict[str, FitBadge]] = {}
        self._job: ProcessJob | None = None
        self.error = ""

    def badges(self, context_length: int) -> dict[str, FitBadge]:
        return self._badges.get(context_length, {})

    def request(self, context_length: int) -> None:
        if context_length in self._badges or (self._job is not None and self._job.running):
            return
        job = ProcessJob.freetoken("models", "list", "--json", "--context", str(context_length),
                                   title="fit estimates", parent=self)
        job.finished.connect(lambda outcome, n=context_length, j=job: self._on_finished(j, outcome, n))
        self._job = job
        job.start()

    def _on_finished(self, job: ProcessJob, outcome, context_length: int) -> None:
        if not outcome.ok:
            self.error = f"fit estimates failed: {outcome.message}"
            log.warning(self.error)
            return
        try:
            rows = json.loads("\n".join(job.stdout))["models"]
        except (ValueError, KeyError, TypeError) as exc:
            self.error = f"fit estimates: unreadable output ({exc})"
            log.warning(self.error)
            return
        badges = {row["key"]: self.badge(row["fit"], row.get("speed", "")) for row in rows if row.get("fit")}
        self._badges[context_length] = badges
        self.updated.emit(badges)

    @classmethod
    def badge(cls, fit: dict, speed: str) -> FitBadge:
        """A short cell ("Hybrid · 40% cached · ~12–20 tok/s"); the planner's full words go in the detail."""
        verdict = fit.get("verdict")
        if verdict == "gpu":
            short = "Fits on the GPU"
        elif verdict == "hybrid":
            short = f"Hybrid · {fit.get('experts_cached_pct', 0):.0f}% cached"
        elif verdict == "cpu":
            short = "CPU only"
        elif verdict == "does_not_fit":
            short = f"Does not fit: +{fit.get('shortfall_bytes', 0) / 1e9:.1f} GB " \
                    f"{(fit.get('short_of') or 'memory').upper()}"
        else:
            short = "Unknown"
        if fit.get("decode_tok_s"):
            lo, hi = fit["decode_tok_s"]
            short += f" · ~{lo:.1f}–{hi:.1f} tok/s"
        lines = [fit.get("badge", "")] + ([speed] if speed else []) + list(fit.get("notes") or [])
        return FitBadge(text=short, tone=cls.TONES.get(verdict, "info"), detail="\n".join(l for l in lines if l))


class LibraryView(QWidget):
    downloads_requested = Signal()          # "see Downloads": the window switches page
    _download_completed = Signal(str)       # from the download manager's thread to ours

    def __init__(self, services, parent: QWidget | None = None, *, estimate_fits: bool = True) -> None:
        super().__init__(parent)
        self.services = services
        self.estimate_fits = estimate_fits
        self.settings = services.settings
        self.session = services.session
        self.library = Library(services.paths.models, downloads=services.downloads)
        self.fits = FitEstimator(self)
        self.conversions: dict[str, ConversionPanel] = {}
        self._refreshing = False
        self._refresh_again = False
        self._delete_armed: str | None = None
        self._fits_wanted = False

        title = QLabel("Library")
        title.setObjectName("PageTitle")
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setAccessibleName("Refresh the library")
        self.refresh_button.clicked.connect(self.refresh)
        header = QHBoxLayout()
        header.addWidget(title, 1)
        header.addWidget(self.refresh_button)

        # -- models table + detail sheet ------------------------------------------------------
        self.model = LibraryModel(self)
        self.fits.updated.connect(lambda badges: (self.model.set_fits(badges), self.show_details()))
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().hide()
        self.table.setAccessibleName("Models")
        self.table.verticalHeader().setDefaultSectionSize(30)
        heading = self.table.horizontalHeader()
        heading.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        heading.setStretchLastSection(True)
        self.table.setWordWrap(False)
        self.table.selectionModel().currentRowChanged.connect(lambda *_: self.show_details())
        self.table.doubleClicked.connect(lambda *_: self.primary_action())
        self.sheet = self._build_sheet()
        self.conversion_area = QVBoxLayout()
        models_page = QWidget()
        page_layout = QVBoxLayout(models_page)
        page_layout.setContentsMargins(0, 0, 0, 0)
        splitter = QSplitter()
        splitter.addWidget(self.table)
        splitter.addWidget(self.sheet)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([780, 300])
        page_layout.addWidget(splitter, 1)
        page_layout.addLayout(self.conversion_area)

        # -- hub search ------------------------------------------------------------------------
        self.tabs = QTabWidget()
        self.tabs.addTab(models_page, "Models")
        self.tabs.addTab(self._build_search(), "Search the hub")
        self.tabs.setAccessibleName("Library sections")
        layout = QVBoxLayout(self)
        layout.addLayout(header)
        layout.addWidget(self.tabs, 1)

        self._refresh_timer = QTimer(self)
        self._refresh_timer.setSingleShot(True)
        self._refresh_timer.setInterval(REFRESH_DEBOUNCE_MS)
        self._refresh_timer.timeout.connect(self.refresh)
        self.session.model_changed.connect(self._on_model_changed)
        self.session.state_changed.connect(lambda _s: self._on_model_changed())
        self.session.load_progress.connect(self._on_load_progress)
        self.session.load_failed.connect(self._on_load_failed)
        if services.downloads is not None:
            from ui.models.downloads import DownloadEvents

            self._download_events = DownloadEvents(self)
            self._download_events.event.connect(
                lambda e: e.kind != "progress" and self._refresh_timer.start())
            services.downloads.add_listener(self._download_events.forward)
            self._download_completed.connect(self._on_download_completed)
            services.downloads.on_complete(lambda job: self._download_completed.emit(job.dest))
        self.refresh()

    # -- building blocks -----------------------------------------------------------------------
    def _build_sheet(self) -> QWidget:
        sheet = QFrame()
        sheet.setObjectName("Card")
        column = QVBoxLayout(sheet)
        self.sheet_title = QLabel("Pick a model")
        self.sheet_title.setObjectName("SectionTitle")
        self.sheet_title.setWordWrap(True)
        self.sheet_facts = QLabel()
        self.sheet_facts.setWordWrap(True)
        self.sheet_facts.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.sheet_facts.setTextFormat(Qt.TextFormat.PlainText)
        self.sheet_status = QLabel()
        self.sheet_status.setWordWrap(True)
        self.sheet_status.setProperty("muted", True)
        self.buttons: dict[str, QPushButton] = {}
        grid = QGridLayout()
        for i, (name, text, accessible) in enumerate((
                ("download", "Download", "Download this model"), ("convert", "Convert", "Convert this model"),
                ("load", "Load", "Load this model"), ("unload", "Unload", "Unload the model"),
                ("delete", "Delete", "Delete this model's files"), ("folder", "Show folder", "Show the folder"))):
            button = QPushButton(text)
            button.setAccessibleName(accessible)
            button.clicked.connect(getattr(self, name))
            if name in ("download", "load"):
                button.setProperty("primary", True)
            grid.addWidget(button, i // 3, i % 3)
            self.buttons[name] = button
        self.load_bar = QProgressBar()
        self.load_bar.setRange(0, LOAD_STEPS)
        self.load_bar.setAccessibleName("Model loading progress")
        self.load_bar.hide()
        self.load_label = QLabel()
        self.load_label.setWordWrap(True)
        self.load_label.setProperty("muted", True)
        self.plan_label = QLabel()
        self.plan_label.setWordWrap(True)
        self.plan_label.setAccessibleName("Memory plan of the loaded model")
        self.message = QLabel()
        self.message.setWordWrap(True)
        body = QWidget()
        inner = QVBoxLayout(body)
        inner.setContentsMargins(0, 0, 0, 0)
        for widget in (self.sheet_title, self.sheet_facts, self.sheet_status):
            inner.addWidget(widget)
        inner.addLayout(grid)
        for widget in (self.message, self.load_bar, self.load_label, self.plan_label):
            inner.addWidget(widget)
        inner.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(body)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        column.addWidget(scroll)
        return sheet

    def _build_search(self) -> QWidget:
        page = QWidget()
        column = QVBoxLayout(page)
        row = QHBoxLayout()
        self.search_field = QLineEdit()
        self.search_field.setPlaceholderText("Search Mixture-of-Experts models on the hub (e.g. qwen3 moe)")
        self.search_field.setAccessibleName("Hub search")
        self.search_field.returnPressed.connect(self.search)
        self.search_button = QPushButton("Search")
        self.search_button.setAccessibleName("Search the hub")
        self.search_button.clicked.connect(self.search)
        row.addWidget(self.search_field, 1)
        row.addWidget(self.search_button)
        self.results = QTableWidget(0, 5)
        self.results.setHorizontalHeaderLabels(["Repository", "Architecture", "Quantization", "Parameters",
                                                "Supported"])
        self.results.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.results.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.results.verticalHeader().hide()
        self.results.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.results.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.results.setAccessibleName("Hub search results")
        self.search_message = QLabel()
        self.search_message.setWordWrap(True)
        self.search_message.setProperty("muted", True)
        self.hub_download = QPushButton("Download selected")
        self.hub_download.setAccessibleName("Download the selected hub model")
        self.hub_download.clicked.connect(self.download_search_result)
        bottom = QHBoxLayout()
        bottom.addWidget(self.search_message, 1)
        bottom.addWidget(self.hub_download)
        column.addLayout(row)
        column.addWidget(self.results, 1)
        column.addLayout(bottom)
        self._hits: list = []
        return page

    # -- rows ----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Fetch the library off the UI thread; a refresh asked for meanwhile runs right after."""
        if self._refreshing:
            self._refresh_again = True
            return
        self._refreshing = True

        if self._fits_wanted:
            self.request_fits()
        run_in_thread(self.library.models, on_done=self._on_rows, on_error=self._on_rows_failed,
                      name="library-scan")

    def request_fits(self) -> None:
        """Ask for fit estimates at the current context length (a child process; cached per length)."""
        self._fits_wanted = True
        context_length = self.settings.get("context_length")
        self.fits.request(context_length)
        self.model.set_fits(self.fits.badges(context_length))

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self.estimate_fits and not self._fits_wanted:
            # estimating costs a second of CPU: not before anyone looks, nor in the middle of startup
            QTimer.singleShot(FIT_DELAY_MS, self, self.request_fits)

    def _on_rows(self, models) -> None:
        key = self.selected_key()
        self.model.set_rows(models)
        self._finish_refresh(key)

    def _on_rows_failed(self, exc: BaseException) -> None:
        self.message.setText(f"Could not read the models folder {self.library.models_dir}: {exc}")
        self._finish_refresh(self.selected_key())

    def _finish_refresh(self, key: str | None) -> None:
        self._refreshing = False
        if key is not None:
            self.select(key)
        elif self.model.rowCount() and not self.table.selectionModel().hasSelection():
            self.table.selectRow(0)
        self.show_details()
        if self._refresh_again:
            self._refresh_again = False
            self.refresh()

    def select(self, key: str) -> None:
        row = self.model.row_of(key)
        if row >= 0:
            self.table.selectRow(row)

    def selected_key(self) -> str | None:
        index = self.table.currentIndex()
        return index.data(KEY_ROLE) if index.isValid() else None

    def selected(self):
        index = self.table.currentIndex()
        return self.model.model_at(index.row()) if index.isValid() else None

    # -- the detail sheet ----------------------------------------------------------------------
    def show_details(self) -> None:
        m = self.selected()
        if m is None:
            self.sheet_title.setText("Pick a model")
            self.sheet_facts.clear()
            for button in self.buttons.values():
                button.setEnabled(False)
            return
        entry = m.catalog
        status = self.model.status_of(m)
        facts = []
        if entry is not None:
            self.sheet_title.setText(entry.name)
            facts += [entry.description, "", f"Repository: {entry.repo}",
                      f"Parameters: {params_text(entry.total_params, entry.active_params)}",
                      f"Format: {entry.format} (converted to {entry.codec})",
                      f"Download: {entry.download_bytes / GIB:.1f} GiB",
                      f"Context: {context_text(entry.context_length)} tokens", f"Licence: {entry.licence}",
                      f"Files: {', '.join(entry.allow_patterns)}"]
        else:
            self.sheet_title.setText(m.key)
        if m.package_dirs:
            facts.append(f"Package: {m.package_dirs[0]}")
        if m.source_dir is not None:
            facts.append(f"Checkpoint: {m.source_dir}")
        if m.bytes_on_disk:
            facts.append(f"On disk: {m.bytes_on_disk / GIB:.2f} GiB")
        fit = self.model.fits.get(m.key)
        if fit is not None:
            facts += ["", f"Fit on this PC (estimate): {fit.text}"] + ([fit.detail] if fit.detail else [])
        self.sheet_facts.setText("\n".join(facts))
        self.sheet_status.setText(f"Status: {status}" + (f" — {m.detail}" if m.detail else ""))
        converting = m.key in self.conversions and self.conversions[m.key].job.running
        busy = self.session.state in ("loading", "starting")
        self.buttons["download"].setEnabled(status == NOT_DOWNLOADED and m.repo is not None
                                            and self.services.downloads is not None)
        self.buttons["convert"].setEnabled(status in (NEEDS_CONVERSION, CONVERTING) and not converting
                                           and m.source_dir is not None)
        self.buttons["load"].setEnabled(status == READY and not busy)
        self.buttons["unload"].setEnabled(status in (LOADED, LOADING))
        self.buttons["delete"].setEnabled(status not in (NOT_DOWNLOADED, LOADED, LOADING) and not converting)
        self.buttons["folder"].setEnabled(self._folder(m) is not None)
        if self._delete_armed != m.key:
            self.buttons["delete"].setText("Delete")

    def primary_action(self) -> None:
        for name in ("load", "convert", "download"):
            if self.buttons[name].isEnabled():
                getattr(self, name)()
                return

    # -- actions -------------------------------------------------------------------------------
    def download(self) -> None:
        m = self.selected()
        if m is None or m.repo is None or self.services.downloads is None:
            return
        patterns = list(m.catalog.allow_patterns) if m.catalog else None
        self._queue_download(m.repo, patterns)

    def _queue_download(self, repo: str, patterns: list[str] | None) -> None:
        self.message.setText(f"Asking the hub about {repo}…")

        def done(job) -> None:
            self.message.setText(f"Downloading {job.repo}: {job.total_bytes / GIB:.2f} GiB in {len(job.files)} "
                                 "files. Progress is on the Downloads page.")
            self.refresh()
            self.downloads_requested.emit()

        run_in_thread(lambda: self.services.downloads.add(repo, allow_patterns=patterns), on_done=done,
                      on_error=lambda exc: self.message.setText(f"Could not download {repo}: {exc}"),
                      name="library-download")

    def convert(self, source: Path | None = None) -> ProcessJob | None:
        m = self.selected() if source is None else self._model_for_source(source)
        src = source or (m.source_dir if m else None)
        if src is None:
            return None
        key = m.key if m else Path(src).name
        if key in self.conversions and self.conversions[key].job.running:
            return self.conversions[key].job
        codec = m.catalog.codec if m is not None and m.catalog is not None else "auto"
        # no --out: the converter names the package and puts it in the models folder (same settings as ours)
        job = conversion_job(src, codec=codec, parent=self)
        old = self.conversions.pop(key, None)
        if old is not None:
            old.deleteLater()
        panel = ConversionPanel(job, name=m.catalog.name if m is not None and m.catalog else key)
        panel.load_requested.connect(self.load_package)
        panel.dismissed.connect(lambda k=key: self._dismiss_conversion(k))
        self.conversions[key] = panel
        self.conversion_area.addWidget(panel)
        job.finished.connect(lambda _outcome: self.refresh())
        job.start()
        self.refresh()
        return job

    def _dismiss_conversion(self, key: str) -> None:
        panel = self.conversions.pop(key, None)
        if panel is not None:
            self.conversion_area.removeWidget(panel)
            panel.deleteLater()

    def _model_for_source(self, source: Path):
        for row in range(self.model.rowCount()):
            m = self.model.model_at(row)
            if m.source_dir is not None and Path(m.source_dir).resolve() == Path(source).resolve():
                return m
        return None

    def _on_download_completed(self, dest: str) -> None:
        if self.settings.get("auto_convert"):
            self.convert(Path(dest))
        else:
            self.message.setText(f"Download complete: {dest}. Convert it to load it.")
        self.refresh()

    def load(self) -> None:
        m = self.selected()
        if m is not None and m.package_dir is not None:
            self.load_package(str(m.package_dir))

    def load_package(self, path: str) -> None:
        from ui.session import SessionError

        try:
            self.session.load(path, load_options(self.settings))
        except SessionError as exc:
            self.message.setText(str(exc))
            return
        self.message.clear()
        self.plan_label.clear()
        self.load_bar.setValue(0)
        self.load_bar.show()
        self.load_label.setText(f"Loading {Path(path).name}…")
        self._on_model_changed()

    def unload(self) -> None:
        self.session.unload()

    def delete(self) -> None:
        m = self.selected()
        if m is None:
            return
        if self._delete_armed != m.key:   # two clicks: the first arms, the second deletes
            self._delete_armed = m.key
            self.buttons["delete"].setText("Click again to delete")
            QTimer.singleShot(DELETE_CONFIRM_MS, self, self._disarm_delete)   # the context object cancels it with us
            return
        self._delete_armed = None
        self.buttons["delete"].setText("Delete")
        key = m.key
        self.message.setText(f"Deleting {key}…")

        def done(freed: int) -> None:
            self.message.setText(f"Deleted {key}: {freed / GIB:.2f} GiB freed.")
            self.refresh()

        run_in_thread(lambda: self.library.delete(key), on_done=done,
                      on_error=lambda exc: self.message.setText(f"Could not delete {key}: {exc}"),
                      name="library-delete")

    def _disarm_delete(self) -> None:
        self._delete_armed = None
        self.buttons["delete"].setText("Delete")

    @staticmethod
    def _folder(m) -> Path | None:
        for path in (m.package_dir, m.source_dir):
            if path is not None and Path(path).exists():
                return Path(path)
        return None

    def folder(self) -> None:
        m = self.selected()
        path = self._folder(m) if m else None
        if path is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))

    # -- the worker's side of loading ----------------------------------------------------------
    def _on_load_progress(self, done: float, total: float, stage: str) -> None:
        self.load_bar.show()
        self.load_bar.setValue(int(LOAD_STEPS * done / total) if total else 0)
        self.load_label.setText(f"Loading: {stage}" + (f" ({done / total:.0%})" if total else ""))

    def _on_load_failed(self, reason: str) -> None:
        self.load_bar.hide()
        self.load_label.setText(f"The model did not load: {reason}")
        self._on_model_changed()

    def _on_model_changed(self) -> None:
        session = self.session
        loading = session.state == "loading"
        # after a crash the session keeps the path (Restart loads it again), but nothing is loaded
        self.model.set_loaded(session.model_path if session.state in ("ready", "loading") else "", loading=loading)
        if session.state == "ready":
            self.load_bar.hide()
            self.load_label.setText(f"Loaded {session.model_id}. Memory plan:")
            self.plan_label.setText("\n".join(plan_lines(session.plan)) or "(the worker sent no plan)")
        elif not loading:
            self.load_bar.hide()
            self.plan_label.clear()
            if session.state == "idle":
                self.load_label.clear()
        self.show_details()

    # -- hub search ----------------------------------------------------------------------------
    def search(self) -> None:
        from ui.services import optional_module

        hub, reason = optional_module("app.hub")
        if hub is None:
            self.search_message.setText(f"Hub search is not available yet: {reason}.")
            return
        query = self.search_field.text().strip()
        self.search_button.setEnabled(False)
        self.search_message.setText("Searching…")
        endpoint = self.settings.get("hf_endpoint") or None
        run_in_thread(lambda: hub.HubBrowser(endpoint=endpoint).search(query), on_done=self._on_hits,
                      on_error=self._on_search_failed, name="hub-search")

    def _on_hits(self, hits: list) -> None:
        self.search_button.setEnabled(True)
        self._hits = list(hits)
        self.results.setRowCount(len(hits))
        for row, hit in enumerate(hits):
            cells = (hit.repo, hit.model_type, hit.quantization, f"{hit.params / 1e9:.1f}B" if hit.params else "—",
                     "yes" if hit.supported else f"no: {hit.reason}")
            for column, text in enumerate(cells):
                self.results.setItem(row, column, QTableWidgetItem(text))
        self.search_message.setText(f"{len(hits)} Mixture-of-Experts models found." if hits else
                                    "No Mixture-of-Experts model matches.")

    def _on_search_failed(self, exc: BaseException) -> None:
        self.search_button.setEnabled(True)
        self.search_message.setText(str(exc))

    def download_search_result(self) -> None:
        row = self.results.currentRow()
        if not 0 <= row < len(self._hits):
            return
        hit = self._hits[row]
        if not hit.supported:
            self.search_message.setText(f"{hit.repo} cannot run in FreeToken: {hit.reason}")
            return
        self._queue_download(hit.repo, None)
        self.tabs.setCurrentIndex(0)
