"""The library table: glue over app.library.Library's `models()` (catalog entries and local models).

The view asks the library for fresh rows off the UI thread (it reads the disk) and hands them to
`set_rows`, which turns the change into the smallest row signals, keyed by the model's key so the
selection survives a refresh. A fit estimate per row comes from `fits` (key -> FitBadge) when the
fit service is present.
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QColor

GIB = 1024**3
KEY_ROLE = Qt.ItemDataRole.UserRole + 1
STATUS_ROLE = Qt.ItemDataRole.UserRole + 2
TONE_ROLE = Qt.ItemDataRole.UserRole + 3
COLUMNS = ("Model", "Status", "Fit on this PC", "Parameters", "Format", "Download", "Context", "Licence")
TONE_COLORS = {"good": "#2e9d5b", "warn": "#c0841a", "bad": "#d64545"}   # read on light and dark alike
LOADED = "loaded"
LOADING = "loading"


@dataclass(frozen=True)
class FitBadge:
    text: str          # "runs on GPU", "hybrid · 40% of experts cached · ~18–25 tok/s", "does not fit"
    tone: str          # good | warn | bad | info
    detail: str = ""   # the planner's lines, for the tooltip and the detail sheet


def params_text(total: int | None, active: int | None) -> str:
    if not total:
        return "—"
    text = f"{total / 1e9:.1f}B"
    return f"{text} · {active / 1e9:.1f}B active" if active else text


def context_text(tokens: int | None) -> str:
    if not tokens:
        return "—"
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


class LibraryModel(QAbstractTableModel):
    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self._rows: list = []                 # app.library.LocalModel
        self.fits: dict[str, FitBadge] = {}
        self.loaded_path: str = ""            # the package the worker has loaded (or is loading)
        self.loading = False

    # -- what the view feeds in --------------------------------------------------------------
    def set_rows(self, rows: list) -> None:
        old_keys = [m.key for m in self._rows]
        new_keys = [m.key for m in rows]
        if old_keys == new_keys:
            self._rows = list(rows)
            if rows:
                self.dataChanged.emit(self.index(0, 0), self.index(len(rows) - 1, len(COLUMNS) - 1))
            return
        self.beginResetModel()
        self._rows = list(rows)
        self.endResetModel()

    def set_fits(self, fits: dict[str, FitBadge]) -> None:
        self.fits = dict(fits)
        if self._rows:
            column = COLUMNS.index("Fit on this PC")
            self.dataChanged.emit(self.index(0, column), self.index(len(self._rows) - 1, column))

    def set_loaded(self, path: str, *, loading: bool) -> None:
        self.loaded_path, self.loading = path, loading
        if self._rows:
            column = COLUMNS.index("Status")
            self.dataChanged.emit(self.index(0, column), self.index(len(self._rows) - 1, column))

    # -- lookups -----------------------------------------------------------------------------
    def model_at(self, row: int):
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def row_of(self, key: str) -> int:
        return next((i for i, m in enumerate(self._rows) if m.key == key), -1)

    def status_of(self, model) -> str:
        """The library's status, plus the two only the window knows: loading and loaded."""
        if self.loaded_path and any(str(p) == self.loaded_path for p in model.package_dirs):
            return LOADING if self.loading else LOADED
        return model.status

    # -- Qt ----------------------------------------------------------------------------------
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
        model = self._rows[index.row()]
        entry = model.catalog
        column = COLUMNS[index.column()]
        if role == KEY_ROLE:
            return model.key
        if role == STATUS_ROLE:
            return self.status_of(model)
        fit = self.fits.get(model.key)
        if role == TONE_ROLE:
            return fit.tone if fit and column == "Fit on this PC" else None
        if role == Qt.ItemDataRole.ForegroundRole:
            tone = fit.tone if fit and column == "Fit on this PC" else None
            return QColor(TONE_COLORS[tone]) if tone in TONE_COLORS else None
        if role == Qt.ItemDataRole.ToolTipRole:
            if column == "Fit on this PC" and fit:
                return fit.detail or fit.text
            if column == "Status":
                return model.detail or None
            return entry.description if entry else model.key
        if role not in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.AccessibleTextRole):
            return None
        if column == "Model":
            return entry.name if entry else model.key
        if column == "Parameters":
            return params_text(entry.total_params, entry.active_params) if entry else "—"
        if column == "Format":
            return entry.format if entry else "FTW"
        if column == "Download":
            return f"{entry.download_bytes / GIB:.1f} GiB" if entry else "—"
        if column == "Context":
            return context_text(entry.context_length) if entry else "—"
        if column == "Licence":
            return entry.licence if entry else "—"
        if column == "Fit on this PC":
            return fit.text if fit else "—"
        if column == "Status":
            return self.status_of(model)
        return None
