"""The chat page: streaming, reasoning, tool calls, stats, stop, regenerate, edit-and-resend, persistence.

The worker here is a protocol-level stand-in: every request the page sends is checked against
runtime/protocol.py's schema and every event it receives is built by runtime.protocol.event, so the
page is held to the real wire contract while each test scripts exactly which tokens arrive. The same
page against the real worker process and engine is tests/test_ui_first_run.py.
"""
from __future__ import annotations

import itertools

import pytest
from PySide6.QtCore import QObject, Qt, Signal

from runtime import protocol
from tests.ui_fixtures import make_services
from ui.views.chat import ChatView


class ScriptedWorker(QObject):
    event = Signal(dict)
    exited = Signal(str)
    _ids = itertools.count(1)

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[dict] = []
        self.stopped = False

    def start(self) -> None:
        self.event.emit(protocol.hello(version="test", pid=1))

    def stop(self, *, wait_ms: int = 0) -> None:
        self.stopped = True

    def request(self, kind: str, **fields) -> str:
        rid = f"r{next(self._ids)}"
        self.requests.append(protocol.request(kind, id=rid, **fields))
        return rid

    def send(self, event_type: str, **fields) -> None:
        # check_event, not protocol.event(): a delta's own `kind` field would clash with event()'s parameter
        self.event.emit(protocol.check_event({"type": event_type, **fields}))

    def last(self, kind: str) -> dict:
        return [r for r in self.requests if r["type"] == kind][-1]


@pytest.fixture
def chat(qtbot, tmp_path):
    workers: list[ScriptedWorker] = []

    def factory():
        workers.append(ScriptedWorker())
        return workers[-1]

    services = make_services(tmp_path, worker_factory=factory)
    session = services.session
    session.load("/models/demo", {"device": "cpu"})
    worker = workers[-1]
    worker.send("loaded", id=worker.last("load")["id"], model_id="demo", model_type="qwen3_moe",
                context_length=4096, plan={})
    view = ChatView(services.chats, session)
    qtbot.addWidget(view)
    view.show()
    view.workers = workers
    yield view
    services.close()


def answer(view, qtbot, *, text="", reasoning="", tool=None, finish="stop"):
    worker = view.workers[-1]
    rid = worker.last("generate")["id"]
    if reasoning:
        worker.send("delta", id=rid, kind="reasoning", text=reasoning)
    for piece in [text[i:i + 7] for i in range(0, len(text), 7)]:
        worker.send("delta", id=rid, kind="text", text=piece)
    if tool:
        worker.send("delta", id=rid, kind="tool_call", index=0, call_id="call_1", name=tool[0], arguments="")
        worker.send("delta", id=rid, kind="tool_call", index=0, arguments=tool[1])
    worker.send("done", id=rid, finish_reason=finish, usage={"prompt_tokens": 11, "completion_tokens": 5},
                timings={"ttft_s": 0.21, "prefill_tps": 50.0, "decode_tps": 12.5, "total_s": 0.6})
    qtbot.waitUntil(lambda: view.streaming is None, timeout=2000)


def test_send_streams_and_persists_with_stats(chat, qtbot):
    view = chat
    view.input.setPlainText("Show me code")
    qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)   # Ctrl+Enter sends
    gen = view.workers[-1].last("generate")
    assert gen["messages"] == [{"role": "user", "content": "Show me code"}]
    assert gen["sampling"]["temperature"] == 0.7 and gen["sampling"]["max_tokens"] == 1024
    assert not view.send_button.isEnabled() and view.stop_button.isEnabled()
    answer(view, qtbot, text="Here:\n\n```python\nprint('hi')\n```\n", reasoning="The user wants code.")
    conv = view.store.conversations()[0]
    assert conv.title == "Show me code" and view.title.text() == "Show me code"
    user, assistant = view.store.messages(conv.id)
    assert assistant.content == "Here:\n\n```python\nprint('hi')\n```\n"
    assert assistant.reasoning == "The user wants code."
    assert assistant.stats["ttft_s"] == 0.21 and assistant.stats["tokens_per_s"] == 12.5
    assert assistant.stats["completion_tokens"] == 5 and assistant.stats["thought_s"] >= 0
    widget = view.widgets[assistant.id]
    assert widget.stats.text() == "TTFT 0.21 s · 12.5 tok/s · 11 prompt + 5 generated tokens"
    assert widget.body.code_blocks()[0].code == "print('hi')"
    assert widget.thought.isVisibleTo(widget) and widget.thought.toggle.text().startswith("Thought for")
    assert view.send_button.isEnabled() and not view.stop_button.isEnabled()


def test_tool_calls_are_shown_and_stored(chat, qtbot):
    view = chat
    view.input.setPlainText("Weather in Oslo?")
    view.send()
    answer(view, qtbot, tool=("get_weather", '{"city": "Oslo"}'), finish="tool_calls")
    assistant = view.store.messages(view.conversation_id)[-1]
    assert assistant.tool_calls == [{"id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert 'get_weather({"city": "Oslo"})' in view.widgets[assistant.id].tools.text()
    # the next request carries the tool call back in OpenAI chat shape
    view.input.setPlainText("and tomorrow?")
    view.send()
    history = view.workers[-1].last("generate")["messages"]
    assert history[1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_stop_cancels_the_request(chat, qtbot):
    view = chat
    view.input.setPlainText("Count to a million")
    view.send()
    worker = view.workers[-1]
    rid = worker.last("generate")["id"]
    worker.send("delta", id=rid, kind="text", text="1, 2, 3")
    qtbot.keyClick(view.input, Qt.Key.Key_Escape)                    # Esc stops
    assert worker.last("cancel")["target"] == rid
    worker.send("done", id=rid, finish_reason="cancelled", usage={"prompt_tokens": 4, "completion_tokens": 3},
                timings={"ttft_s": 0.1, "prefill_tps": 40.0, "decode_tps": 9.0, "total_s": 0.4})
    qtbot.waitUntil(lambda: view.streaming is None, timeout=2000)
    assistant = view.store.messages(view.conversation_id)[-1]
    assert assistant.content == "1, 2, 3" and "stopped by you" in view.widgets[assistant.id].stats.text()


def test_regenerate_and_edit_replace_history(chat, qtbot):
    view = chat
    view.input.setPlainText("first question")
    view.send()
    answer(view, qtbot, text="first answer")
    old = view.store.messages(view.conversation_id)[-1]
    view.widgets[old.id].regenerate_button.click()
    assert [m.content for m in view.store.messages(view.conversation_id)][:1] == ["first question"]
    assert view.workers[-1].last("generate")["messages"] == [{"role": "user", "content": "first question"}]
    answer(view, qtbot, text="second answer")
    assert [m.content for m in view.store.messages(view.conversation_id)] == ["first question", "second answer"]
    assert old.id not in view.widgets
    user = view.store.messages(view.conversation_id)[0]
    view.widgets[user.id].edit_button.click()
    assert view.input.toPlainText() == "first question"
    view.input.setPlainText("edited question")
    view.send()
    assert view.workers[-1].last("generate")["messages"] == [{"role": "user", "content": "edited question"}]
    answer(view, qtbot, text="third answer")
    assert [m.content for m in view.store.messages(view.conversation_id)] == ["edited question", "third answer"]
    assert len(view.widgets) == 2


def test_system_prompt_and_sampling_per_conversation(chat, qtbot):
    view = chat
    view.new_chat()
    view.settings_button.setChecked(True)
    view.panel.system_prompt.setPlainText("Answer in French.")
    view.panel.temperature.setValue(0.2)
    view.panel.max_tokens.setValue(64)
    view.apply_settings()
    view.input.setPlainText("hello")
    view.send()
    gen = view.workers[-1].last("generate")
    assert gen["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert gen["sampling"]["temperature"] == pytest.approx(0.2) and gen["sampling"]["max_tokens"] == 64
    answer(view, qtbot, text="bonjour")
    first = view.conversation_id
    view.new_chat()                                       # a new chat has its own defaults
    assert view.panel.system_prompt.toPlainText() == "" and view.panel.temperature.value() == pytest.approx(0.7)
    view.select(first)
    assert view.panel.system_prompt.toPlainText() == "Answer in French."
    assert [w.content for w in view.widgets.values()] == ["hello", "bonjour"]


def test_worker_error_and_crash_end_the_answer_with_a_reason(chat, qtbot):
    view = chat
    view.input.setPlainText("hi")
    view.send()
    worker = view.workers[-1]
    worker.send("error", id=worker.last("generate")["id"], code="context_length",
                message="the prompt is 5000 tokens; the context holds 4096")
    qtbot.waitUntil(lambda: view.streaming is None, timeout=2000)
    assistant = view.store.messages(view.conversation_id)[-1]
    assert "5000 tokens" in view.widgets[assistant.id].error.text()
    view.input.setPlainText("again")
    view.send()
    worker.exited.emit("the process crashed (exit code 139)")
    qtbot.waitUntil(lambda: view.streaming is None, timeout=2000)
    assistant = view.store.messages(view.conversation_id)[-1]
    assert assistant.stats["error_code"] == "worker_crashed"
    assert "exit code 139" in view.widgets[assistant.id].error.text()
    view.input.setPlainText("while crashed")
    assert view.send() is False and "Restart" in view.banner.label.text()
    assert view.store.messages(view.conversation_id)[-1].content != "while crashed"


def test_conversations_list_select_delete(chat, qtbot, qtmodeltester):
    view = chat
    for text in ("alpha", "beta"):
        view.new_chat()
        view.input.setPlainText(text)
        view.send()
        answer(view, qtbot, text=text.upper())
    qtmodeltester.check(view.model)
    assert [view.model.index(r).data() for r in range(view.model.rowCount())] == ["beta", "alpha"]
    view.list.setCurrentIndex(view.model.index(1))
    assert view.title.text() == "alpha" and [w.content for w in view.widgets.values()] == ["alpha", "ALPHA"]
    view.delete_current()
    assert view.model.rowCount() == 1 and view.title.text() == "beta"
    qtmodeltester.check(view.model)


def test_switching_conversations_mid_answer_keeps_the_answer(chat, qtbot):
    view = chat
    view.input.setPlainText("first chat")
    view.send()
    streaming_conv = view.conversation_id
    worker = view.workers[-1]
    rid = worker.last("generate")["id"]
    worker.send("delta", id=rid, kind="text", text="half an ")
    other = view.store.create(title="other")
    view.select(other.id)                                  # look elsewhere while it streams
    assert view.conversation_id == other.id and not view.widgets
    worker.send("delta", id=rid, kind="text", text="answer")
    view.select(streaming_conv)                            # and come back before it ends
    qtbot.waitUntil(lambda: view.widgets and list(view.widgets.values())[-1].content == "half an answer",
                    timeout=2000)
    view.select(other.id)
    answer(view, qtbot, text="")                           # it ends while another chat is open
    assert view.store.messages(streaming_conv)[-1].content == "half an answer"
    assert view.store.messages(streaming_conv)[-1].stats["completion_tokens"] == 5
