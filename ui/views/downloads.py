"""Downloads: the queue with progress bars (bytes, rate, ETA), pause / resume / retry / cancel, errors in words."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QPushButton,
                               QTableView, QVBoxLayout, QWidget)

from app.downloads import DONE, DOWNLOADING, FAILED, PAUSED, QUEUED, DownloadError
from ui.background import run_in_thread
from ui.models.downloads import DownloadsModel, STATE_ROLE
from ui.widgets.progress_delegate import ProgressDelegate


class DownloadsView(QWidget):
    queued = Signal(str)          # job id, once the hub listed the repo's files

    def __init__(self, services, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.manager = services.downloads
        title = QLabel("Downloads")
        title.setObjectName("PageTitle")
        self.repo = QLineEdit()
        self.repo.setPlaceholderText("Hugging Face repo, e.g. Qwen/Qwen3-30B-A3B-Instruct-2507")
        self.repo.setAccessibleName("Repository to download")
        self.repo.returnPressed.connect(self.add_from_field)
        self.add_button = QPushButton("Download")
        self.add_button.setProperty("primary", True)
        self.add_button.setAccessibleName("Download this repository")
        self.add_button.clicked.connect(self.add_from_field)
        add_row = QHBoxLayout()
        add_row.addWidget(self.repo, 1)
        add_row.addWidget(self.add_button)
        self.model = DownloadsModel(self.manager, self)
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setItemDelegateForColumn(1, ProgressDelegate(self.table))
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.setAlternatingRowColors(True)
        self.table.setAccessibleName("Download queue")
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.ResizeToContents)
        self.table.verticalHeader().setDefaultSectionSize(32)
        self.pause_button = self._button("Pause", "Pause the selected download", self.pause)
        self.resume_button = self._button("Resume", "Resume or retry the selected download", self.resume)
        self.cancel_button = self._button("Cancel", "Cancel the selected download and delete its partial files",
                                          self.cancel)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setProperty("muted", True)
        actions = QHBoxLayout()
        actions.addWidget(self.message, 1)
        for button in (self.pause_button, self.resume_button, self.cancel_button):
            actions.addWidget(button)
        self.empty = QLabel("Nothing is downloading. Pick a model in the Library, or enter a repo above.")
        self.empty.setProperty("muted", True)
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        layout = QVBoxLayout(self)
        layout.addWidget(title)
        layout.addLayout(add_row)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.empty)
        layout.addLayout(actions)
        self.table.selectionModel().selectionChanged.connect(self._refresh_buttons)
        self.model.dataChanged.connect(self._refresh_buttons)
        self.model.rowsInserted.connect(self._refresh_buttons)
        self.model.rowsRemoved.connect(self._refresh_buttons)
        self._refresh_buttons()

    def _button(self, text: str, accessible: str, slot) -> QPushButton:
        button = QPushButton(text)
        button.setAccessibleName(accessible)
        button.setToolTip(accessible)
        button.clicked.connect(slot)
        return button

    # -- adding ----------------------------------------------------------------------------
    def add_from_field(self) -> None:
        repo = self.repo.text().strip()
        if repo:
            self.add(repo)

    def add(self, repo: str, *, allow_patterns: list[str] | None = None) -> None:
        """Queue a repo; listing its files talks to the hub, so it runs off the UI thread."""
        self.add_button.setEnabled(False)
        self.message.setText(f"Asking the hub about {repo}…")

        def done(job) -> None:
            self.add_button.setEnabled(True)
            self.repo.clear()
            self.message.setText(f"Queued {job.repo}: {len(job.files)} files.")
            self.select(job.id)
            self.queued.emit(job.id)

        def failed(exc: BaseException) -> None:
            self.add_button.setEnabled(True)
            self.message.setText(f"Could not download {repo}: {exc}" if not isinstance(exc, DownloadError)
                                 else str(exc))

        run_in_thread(lambda: self.manager.add(repo, allow_patterns=allow_patterns), on_done=done, on_error=failed,
                      name="download-add")

    # -- actions on the selected job -------------------------------------------------------
    def select(self, job_id: str) -> None:
        row = self.model.row_of(job_id)
        if row >= 0:
            self.table.selectRow(row)

    def selected_job_id(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        job = self.model.job_at(rows[0].row()) if rows else None
        return job.id if job else None

    def _act(self, action) -> None:
        job_id = self.selected_job_id()
        if job_id is None:
            return
        try:
            action(job_id)
        except (DownloadError, OSError) as exc:
            self.message.setText(str(exc))
        self._refresh_buttons()

    def pause(self) -> None:
        self._act(self.manager.pause)

    def resume(self) -> None:
        self._act(self.manager.resume)

    def cancel(self) -> None:
        # cancel waits for the file's worker to let go: run it off the UI thread
        job_id = self.selected_job_id()
        if job_id is None:
            return
        self.cancel_button.setEnabled(False)
        run_in_thread(lambda: self.manager.cancel(job_id), on_done=lambda _: self._refresh_buttons(),
                      on_error=lambda exc: self.message.setText(str(exc)), name="download-cancel")

    def _refresh_buttons(self, *_args) -> None:
        rows = self.table.selectionModel().selectedRows()
        state = rows[0].data(STATE_ROLE) if rows else None
        self.pause_button.setEnabled(state in (QUEUED, DOWNLOADING))
        self.resume_button.setEnabled(state in (PAUSED, FAILED))
        self.resume_button.setText("Retry" if state == FAILED else "Resume")
        self.cancel_button.setEnabled(state is not None and state != DONE)
        self.empty.setVisible(self.model.rowCount() == 0)
