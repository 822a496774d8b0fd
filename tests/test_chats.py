"""Conversations persist in SQLite in the user data folder, with their settings, history and stats."""
from __future__ import annotations

import sqlite3

import pytest

from app.chats import DB_NAME, ChatSampling, ChatStore, ChatStoreError
from app.paths import user_paths


def test_conversation_round_trip_across_reopen(freetoken_home):
    store = ChatStore()
    assert store.path == user_paths().data / DB_NAME
    conv = store.create(system_prompt="You are terse.", sampling=ChatSampling(temperature=0.2, max_tokens=64))
    store.add_message(conv.id, "user", "Write a haiku about experts living in RAM and hot ones in VRAM please")
    answer = store.add_message(conv.id, "assistant", "", reasoning="")
    store.update_message(answer.id, content="Cold weights wait below", reasoning="counting syllables",
                         stats={"ttft_s": 0.42, "tokens_per_s": 17.5, "prompt_tokens": 21, "completion_tokens": 9})
    store.close()

    again = ChatStore()
    (loaded,) = again.conversations()
    assert loaded.system_prompt == "You are terse."
    assert loaded.sampling == ChatSampling(temperature=0.2, max_tokens=64)
    assert loaded.title.startswith("Write a haiku about experts") and loaded.title.endswith("…")
    assert len(loaded.title) <= 60
    user, assistant = again.messages(loaded.id)
    assert (user.role, assistant.role) == ("user", "assistant")
    assert assistant.reasoning == "counting syllables" and assistant.stats["tokens_per_s"] == 17.5
    assert again.api_messages(loaded.id) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": user.content},
        {"role": "assistant", "content": "Cold weights wait below"},
    ]


def test_listeners_hear_every_change_and_order_is_newest_first():
    store = ChatStore()
    events = []
    store.subscribe(lambda event, cid: events.append((event, cid)))
    a = store.create(title="first")
    b = store.create(title="second")
    store.add_message(a.id, "user", "bump a")
    assert [c.id for c in store.conversations()] == [a.id, b.id]   # a was active last
    store.update(b.id, title="  ")
    assert store.get(b.id).title == "New chat"
    store.delete(b.id)
    assert events == [("added", a.id), ("added", b.id), ("messages", a.id), ("changed", b.id), ("removed", b.id)]


def test_truncate_for_edit_and_regenerate():
    store = ChatStore()
    conv = store.create()
    ids = [store.add_message(conv.id, role, text).id
           for role, text in [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2")]]
    assert store.truncate_from(ids[2]) == 2
    assert [m.content for m in store.messages(conv.id)] == ["q1", "a1"]
    other = store.create()
    store.add_message(other.id, "user", "untouched")
    store.truncate_from(ids[1])
    assert [m.content for m in store.messages(conv.id)] == ["q1"]
    assert [m.content for m in store.messages(other.id)] == ["untouched"]


def test_deleting_a_conversation_deletes_its_messages():
    store = ChatStore()
    conv = store.create()
    store.add_message(conv.id, "user", "hi")
    store.delete(conv.id)
    assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    with pytest.raises(ChatStoreError, match=f"no conversation {conv.id}"):
        store.get(conv.id)


def test_bad_input_is_refused_clearly(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    conv = store.create()
    with pytest.raises(ValueError, match="role 'robot'"):
        store.add_message(conv.id, "robot", "beep")
    with pytest.raises(ValueError, match="temperature"):
        store.update(conv.id, sampling=ChatSampling(temperature=9.0))
    with pytest.raises(ChatStoreError, match="no conversation 999"):
        store.add_message(999, "user", "hi")
    # unknown sampling keys from another version are ignored, not fatal
    assert ChatSampling.from_dict({"temperature": 0.1, "mirostat": 2}).temperature == 0.1


def test_newer_or_corrupt_database_is_reported(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    db = sqlite3.connect(newer)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(ChatStoreError, match="newer FreeToken"):
        ChatStore(newer)
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ChatStoreError, match="corrupt.sqlite3"):
        ChatStore(corrupt)
