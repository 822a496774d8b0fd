"""Draws a progress bar in a table cell: the fraction from PROGRESS_ROLE, the caption from DisplayRole."""
from __future__ import annotations

from PySide6.QtCore import QModelIndex, Qt
from PySide6.QtWidgets import QApplication, QStyle, QStyledItemDelegate, QStyleOptionProgressBar, QStyleOptionViewItem

PROGRESS_ROLE = Qt.ItemDataRole.UserRole + 100   # float 0..1, or None for "no bar" (queued, failed, ...)
BAR_STEPS = 1000


class ProgressDelegate(QStyledItemDelegate):
    def paint(self, painter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        fraction = index.data(PROGRESS_ROLE)
        if fraction is None:
            super().paint(painter, option, index)
            return
        bar = QStyleOptionProgressBar()
        bar.rect = option.rect.adjusted(3, 4, -3, -4)
        bar.minimum, bar.maximum = 0, BAR_STEPS
        bar.progress = int(max(0.0, min(1.0, float(fraction))) * BAR_STEPS)
        bar.text = str(index.data(Qt.ItemDataRole.DisplayRole) or f"{fraction:.0%}")
        bar.textVisible = True
        # Without State_Horizontal, Qt 6 draws the bar vertically (filling from the bottom).
        bar.state = option.state | QStyle.StateFlag.State_Horizontal
        bar.palette = option.palette
        style = option.widget.style() if option.widget else QApplication.style()
        style.drawControl(QStyle.ControlElement.CE_ProgressBar, bar, painter, option.widget)
