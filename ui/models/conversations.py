"""The conversation list: glue over app.chats.ChatStore, which owns the data and announces changes."""
from __future__ import annotations

import time

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, Qt

from app.chats import ChatStore, Conversation

ID_ROLE = Qt.ItemDataRole.UserRole + 1


def age_text(seconds: float) -> str:
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} d ago"


class ConversationListModel(QAbstractListModel):
    def __init__(self, store: ChatStore, parent=None) -> None:
        super().__init__(parent)
        self.store = store
        self._rows: list[Conversation] = store.conversations()
        store.subscribe(self._on_store)

    def close(self) -> None:
        self.store.unsubscribe(self._on_store)

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole):
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        conv = self._rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return conv.title
        if role == Qt.ItemDataRole.ToolTipRole:
            return f"{conv.title}\nlast active {age_text(time.time() - conv.updated)}"
        if role == Qt.ItemDataRole.AccessibleTextRole:
            return f"Conversation: {conv.title}"
        if role == ID_ROLE:
            return conv.id
        return None

    def row_of(self, conversation_id: int) -> int:
        for row, conv in enumerate(self._rows):
            if conv.id == conversation_id:
                return row
        return -1

    def conversation_id(self, row: int) -> int | None:
        return self._rows[row].id if 0 <= row < len(self._rows) else None

    # The store says what changed; the model turns that into the smallest row signals.
    def _on_store(self, event: str, conversation_id: int) -> None:
        row = self.row_of(conversation_id)
        if event == "added":
            conv = self.store.get(conversation_id)
            self.beginInsertRows(QModelIndex(), 0, 0)
            self._rows.insert(0, conv)
            self.endInsertRows()
        elif event == "removed" and row >= 0:
            self.beginRemoveRows(QModelIndex(), row, row)
            del self._rows[row]
            self.endRemoveRows()
        elif event in ("changed", "messages") and row >= 0:
            self._rows[row] = self.store.get(conversation_id)
            if row > 0 and event == "messages":   # the active conversation rises to the top
                self.beginMoveRows(QModelIndex(), row, row, QModelIndex(), 0)
                self._rows.insert(0, self._rows.pop(row))
                self.endMoveRows()
                row = 0
            index = self.index(row)
            self.dataChanged.emit(index, index)
