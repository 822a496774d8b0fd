"""The download queue as a table: glue over app.downloads.DownloadManager.

The manager calls its listeners on its worker threads; `DownloadEvents` re-emits each event as a
Qt signal, which Qt queues to the UI thread, where the model updates its snapshot rows.
"""
from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, QPersistentModelIndex, Qt, Signal

from app.downloads import (CANCELLED, DONE, DOWNLOADING, FAILED, PAUSED, QUEUED, DownloadError, DownloadEvent,
                           DownloadJob)
from ui.widgets.progress_delegate import PROGRESS_ROLE

GIB = 1024**3
MIB = 1024**2
JOB_ID_ROLE = Qt.ItemDataRole.UserRole + 1
STATE_ROLE = Qt.ItemDataRole.UserRole + 2
COLUMNS = ("Model", "Progress", "Speed", "Time left", "Status")
STATE_WORDS = {QUEUED: "Waiting", DOWNLOADING: "Downloading", PAUSED: "Paused", DONE: "Complete",
               FAILED: "Failed", CANCELLED: "Cancelled"}


def size_text(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB"


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class DownloadEvents(QObject):
    """Thread bridge: `add_listener(bridge.forward)` on the manager, connect to `event` on the UI side."""

    event = Signal(object)

    def forward(self, event: DownloadEvent) -> None:
        self.event.emit(event)


class DownloadsModel(QAbstractTableModel):
    def __init__(self, manager, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.manager = manager
        self._rows: list[DownloadJob] = manager.jobs()
        self.bridge = DownloadEvents(self)
        self.bridge.event.connect(self._on_event)
        manager.add_listener(self.bridge.forward)

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal \
                and 0 <= section < len(COLUMNS):
            return COLUMNS[section]
        return None

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole):
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        job = self._rows[index.row()]
        column = index.column()
        if role == JOB_ID_ROLE:
            return job.id
        if role == STATE_ROLE:
            return job.state
        total = job.total_bytes
        fraction = job.done_bytes / total if total else 1.0
        if role == PROGRESS_ROLE:
            return fraction if column == 1 and job.state != CANCELLED else None
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.AccessibleTextRole):
            if column == 0:
                return job.repo
            if column == 1:
                return f"{fraction:.0%} · {size_text(job.done_bytes)} of {size_text(total)}"
            if column == 2:
                return f"{size_text(job.rate)}/s" if job.state == DOWNLOADING and job.rate else "—"
            if column == 3:
                return duration_text(job.eta_s) if job.state == DOWNLOADING else "—"
            if column == 4:
                words = STATE_WORDS.get(job.state, job.state)
                return f"{words}: {job.error}" if job.error else words
        if role == Qt.ItemDataRole.ToolTipRole:
            return job.error or f"{job.repo} → {job.dest}"
        return None

    def job_at(self, row: int) -> DownloadJob | None:
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def row_of(self, job_id: str) -> int:
        return next((i for i, j in enumerate(self._rows) if j.id == job_id), -1)

    def _on_event(self, event: DownloadEvent) -> None:
        # Events from several worker threads may arrive out of order: show the manager's state now.
        try:
            job = self.manager.job(event.job.id)
        except DownloadError:   # cancelled and forgotten
            job = event.job
            job.state = CANCELLED
        row = self.row_of(job.id)
        gone = job.state == CANCELLED
        if row < 0:
            if gone:
                return
            self.beginInsertRows(QModelIndex(), len(self._rows), len(self._rows))
            self._rows.append(job)
            self.endInsertRows()
        elif gone:   # the manager forgets a cancelled job: so does the table
            self.beginRemoveRows(QModelIndex(), row, row)
            del self._rows[row]
            self.endRemoveRows()
        else:
            self._rows[row] = job
            self.dataChanged.emit(self.index(row, 0), self.index(row, len(COLUMNS) - 1))
