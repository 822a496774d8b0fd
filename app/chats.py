"""Conversations, persisted in SQLite in the user's data folder (`chats.sqlite3`).

A conversation has a title, its own system prompt and sampling settings; its messages are kept
in order with the assistant's reasoning, tool calls and the stats of each answer (TTFT, tokens/s,
token counts). `ChatStore` is a plain object: listeners registered with `subscribe` hear about
every change, so a Qt model can forward them without owning any state.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from app.paths import user_paths

SCHEMA_VERSION = 1
DB_NAME = "chats.sqlite3"
DEFAULT_TITLE = "New chat"
TITLE_CHARS = 60             # a title made from the first user message is cut here
ROLES = ("system", "user", "assistant", "tool")


class ChatStoreError(RuntimeError):
    """A database that cannot be opened or a request that names a missing conversation/message."""


@dataclass
class ChatSampling:
    """Per-conversation sampling; the names match runtime.engine.SamplingParams."""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 1024
    seed: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "ChatSampling":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (raw or {}).items() if k in known})

    def validate(self) -> "ChatSampling":
        if not 0.0 <= self.temperature <= 5.0:
            raise ValueError(f"temperature {self.temperature} is outside 0..5")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]")
        if self.top_k < 0 or self.max_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_tokens >= 1")
        return self


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    sampling: ChatSampling
    created: float
    updated: float


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)   # ttft_s, tokens_per_s, prompt/completion tokens, thought_s
    created: float = 0.0

    def as_api(self) -> dict[str, Any]:
        """The message as the worker's generate request takes it (OpenAI chat shape)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


_DDL = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    tool_calls TEXT NOT NULL DEFAULT '[]',
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""

Listener = Callable[[str, int], None]   # (event, conversation id); events below


class ChatStore:
    """Events sent to listeners: "added", "removed", "changed" (title/settings), "messages"."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path else user_paths().data / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA journal_mode = WAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ChatStoreError(f"{self.path} was written by a newer FreeToken (schema {version}); "
                                     "update FreeToken to open these chats")
            self._db.executescript(_DDL)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.commit()
        except sqlite3.DatabaseError as exc:
            raise ChatStoreError(f"cannot open the chats database {self.path}: {exc}") from exc
        self._listeners: list[Listener] = []

    def close(self) -> None:
        self._db.close()

    # -- listeners -----------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, event: str, conversation_id: int) -> None:
        for listener in list(self._listeners):
            listener(event, conversation_id)

    # -- conversations -------------------------------------------------------------------
    def create(self, *, title: str = DEFAULT_TITLE, system_prompt: str = "",
               sampling: ChatSampling | None = None) -> Conversation:
        now = time.time()
        sampling = (sampling or ChatSampling()).validate()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO conversations (title, system_prompt, sampling, created, updated) VALUES (?,?,?,?,?)",
                (title, system_prompt, json.dumps(asdict(sampling)), now, now))
        conv = self.get(cur.lastrowid)
        self._notify("added", conv.id)
        return conv

    def conversations(self) -> list[Conversation]:
        """Newest activity first."""
        rows = self._db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        return [self._conversation(r) for r in rows]

    def get(self, conversation_id: int) -> Conversation:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise ChatStoreError(f"no conversation {conversation_id}")
        return self._conversation(row)

    def update(self, conversation_id: int, *, title: str | None = None, system_prompt: str | None = None,
               sampling: ChatSampling | None = None) -> Conversation:
        self.get(conversation_id)
        changes: dict[str, Any] = {}
        if title is not None:
            changes["title"] = title.strip() or DEFAULT_TITLE
        if system_prompt is not None:
            changes["system_prompt"] = system_prompt
        if sampling is not None:
            changes["sampling"] = json.dumps(asdict(sampling.validate()))
        if changes:
            assignments = ", ".join(f"{k} = ?" for k in changes)
            with self._db:
                self._db.execute(f"UPDATE conversations SET {assignments}, updated = ? WHERE id = ?",
                                 (*changes.values(), time.time(), conversation_id))
            self._notify("changed", conversation_id)
        return self.get(conversation_id)

    def delete(self, conversation_id: int) -> None:
        with self._db:
            cur = self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        if cur.rowcount:
            self._notify("removed", conversation_id)

    # -- messages ------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, *, reasoning: str = "",
                    tool_calls: list[dict[str, Any]] | None = None,
                    stats: dict[str, Any] | None = None) -> Message:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
        conv = self.get(conversation_id)
        now = time.time()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, reasoning, tool_calls, stats, created) "
                "VALUES (?,?,?,?,?,?,?)",
                (conversation_id, role, content, reasoning, json.dumps(tool_calls or []), json.dumps(stats or {}),
                 now))
            # The first thing the user says names the conversation, as every chat app does.
            title_update = (role == "user" and conv.title == DEFAULT_TITLE and content.strip())
            if title_update:
                self._db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                                 (_title_from(content), conversation_id))
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        self._notify("messages", conversation_id)
        if title_update:
            self._notify("changed", conversation_id)
        return self.message(cur.lastrowid)

    def update_message(self, message_id: int, *, content: str | None = None, reasoning: str | None = None,
                       tool_calls: list[dict[str, Any]] | None = None,
                       stats: dict[str, Any] | None = None) -> Message:
        msg = self.message(message_id)
        changes: dict[str, Any] = {}
        if content is not None:
            changes["content"] = content
        if reasoning is not None:
            changes["reasoning"] = reasoning
        if tool_calls is not None:
            changes["tool_calls"] = json.dumps(tool_calls)
        if stats is not None:
            changes["stats"] = json.dumps(stats)
        if changes:
            assignments = ", ".join(f"{k} = ?" for k in changes)
            with self._db:
                self._db.execute(f"UPDATE messages SET {assignments} WHERE id = ?", (*changes.values(), message_id))
            self._notify("messages", msg.conversation_id)
        return self.message(message_id)

    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise ChatStoreError(f"no message {message_id}")
        return self._message(row)

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id",
                                (conversation_id,)).fetchall()
        return [self._message(r) for r in rows]

    def truncate_from(self, message_id: int) -> int:
        """Delete this message and every later one of its conversation (edit-and-resend, regenerate).

        Returns the number of messages removed."""
        msg = self.message(message_id)
        with self._db:
            cur = self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                                   (msg.conversation_id, message_id))
        self._notify("messages", msg.conversation_id)
        return cur.rowcount

    def api_messages(self, conversation_id: int) -> list[dict[str, Any]]:
        """System prompt plus history, ready for a generate request."""
        conv = self.get(conversation_id)
        out = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt.strip() else []
        return out + [m.as_api() for m in self.messages(conversation_id)]

    # -- rows ----------------------------------------------------------------------------
    @staticmethod
    def _conversation(row: sqlite3.Row) -> Conversation:
        return Conversation(id=row["id"], title=row["title"], system_prompt=row["system_prompt"],
                            sampling=ChatSampling.from_dict(_json(row["sampling"], {})),
                            created=row["created"], updated=row["updated"])

    @staticmethod
    def _message(row: sqlite3.Row) -> Message:
        return Message(id=row["id"], conversation_id=row["conversation_id"], role=row["role"],
                       content=row["content"], reasoning=row["reasoning"],
                       tool_calls=_json(row["tool_calls"], []), stats=_json(row["stats"], {}),
                       created=row["created"])


def _json(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return default


def _title_from(content: str) -> str:
    line = " ".join(content.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"
