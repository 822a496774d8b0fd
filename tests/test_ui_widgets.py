"""Chat message widgets: Markdown with highlighted, copyable code; the thought block; the progress delegate."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QStandardItem, QStandardItemModel
from PySide6.QtWidgets import QStyleFactory, QTableView

from ui.widgets.markdown_view import CodeBlock, MarkdownView, TextBlock, highlight_html, split_blocks
from ui.widgets.message_widget import MessageWidget, stats_text, tool_call_text
from ui.widgets.progress_delegate import PROGRESS_ROLE, ProgressDelegate
from ui.widgets.thought_block import ThoughtBlock, thought_label

ANSWER = """Here is the fix:

```python
def add(a, b):
    return a + b
```

Then run it with `python x.py`.

~~~
plain block
~~~"""


def test_split_blocks_finds_prose_and_fenced_code():
    blocks = split_blocks(ANSWER)
    assert [(b.kind, b.lang) for b in blocks] == [("text", ""), ("code", "python"), ("text", ""), ("code", "")]
    assert blocks[1].text == "def add(a, b):\n    return a + b"
    assert blocks[3].text == "plain block" and blocks[3].closed
    # mid-stream: an open fence runs to the end and is marked open
    partial = split_blocks("Look:\n```js\nconsole.log(1)")
    assert partial[-1].kind == "code" and partial[-1].lang == "js" and not partial[-1].closed
    assert partial[-1].text == "console.log(1)"
    # a fence needs the same character: ~~~ does not close ```
    assert split_blocks("```\na\n~~~\nb\n```")[0].text == "a\n~~~\nb"


def test_code_is_highlighted_and_escaped():
    html = highlight_html("if x < 3: print('<b>')", "python", dark=False)
    assert "color" in html and "&lt;b&gt;" in html and "<b>" not in html.replace("<b>'", "")
    plain = highlight_html("<script>", "no-such-language", dark=True)
    assert "&lt;script&gt;" in plain and "color" not in plain


def test_markdown_view_renders_blocks_and_copies_code(qtbot):
    view = MarkdownView(ANSWER)
    qtbot.addWidget(view)
    kinds = [type(w) for w in view.widgets]
    assert kinds == [TextBlock, CodeBlock, TextBlock, CodeBlock]
    code = view.code_blocks()[0]
    assert code.lang_label.text() == "python"
    with qtbot.waitSignal(code.copied):
        qtbot.mouseClick(code.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "def add(a, b):\n    return a + b"
    assert code.copy_button.text() == "Copied"
    assert code.copy_button.accessibleName() == "Copy python block"


def test_streaming_keeps_finished_blocks(qtbot):
    view = MarkdownView("Intro text")
    qtbot.addWidget(view)
    first = view.widgets[0]
    view.set_markdown("Intro text\n\n```python\nx = 1")
    code = view.widgets[1]
    view.set_markdown("Intro text\n\n```python\nx = 1\ny = 2\n```\nDone.")
    assert view.widgets[0] is first and view.widgets[1] is code   # reused, not rebuilt
    assert code.code == "x = 1\ny = 2" and view.widgets[2].source == "Done."
    # paragraphs are separate blocks: streaming more text re-renders only the last one
    long = "\n\n".join(f"Paragraph {i} with some words." for i in range(50))
    view.set_markdown(long)
    paragraphs = list(view.widgets)
    assert len(paragraphs) == 50 and paragraphs[-1].source == "Paragraph 49 with some words."
    view.set_markdown(long + " More")
    assert view.widgets[:49] == paragraphs[:49] and view.widgets[-1].source.endswith("words. More")


def test_thought_block_folds_reasoning(qtbot):
    block = ThoughtBlock()
    qtbot.addWidget(block)
    block.show()
    block.set_text("First, the user wants...")
    assert block.toggle.text() == "Thinking…" and not block.body.isVisible()
    block.set_seconds(4.4)
    assert block.toggle.text() == "Thought for 4 s"
    qtbot.mouseClick(block.toggle, Qt.MouseButton.LeftButton)
    assert block.expanded and block.body.isVisible() and block.body.text() == "First, the user wants..."
    qtbot.mouseClick(block.toggle, Qt.MouseButton.LeftButton)
    assert not block.body.isVisible()
    assert thought_label(0.3) == "Thought for less than a second" and thought_label(75) == "Thought for 1 min 15 s"


def test_message_widget_shows_stats_tools_and_actions(qtbot):
    widget = MessageWidget(7, "assistant")
    qtbot.addWidget(widget)
    widget.show_content("Calling a tool", reasoning="need weather", thought_s=2.0,
                        tool_calls=[{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    widget.show_stats({"ttft_s": 0.25, "tokens_per_s": 31.26, "prompt_tokens": 12, "completion_tokens": 40,
                       "finish_reason": "length"})
    assert widget.stats.text() == ("TTFT 0.25 s · 31.3 tok/s · 12 prompt + 40 generated tokens · "
                                   "stopped at the token limit")
    assert 'get_weather({"city": "Oslo"})' in widget.tools.text()
    assert widget.thought.toggle.text() == "Thought for 2 s"
    with qtbot.waitSignal(widget.regenerate_requested) as sig:
        qtbot.mouseClick(widget.regenerate_button, Qt.MouseButton.LeftButton)
    assert sig.args == [7]
    user = MessageWidget(3, "user")
    qtbot.addWidget(user)
    with qtbot.waitSignal(user.edit_requested) as sig:
        qtbot.mouseClick(user.edit_button, Qt.MouseButton.LeftButton)
    assert sig.args == [3] and not hasattr(user, "regenerate_button")
    assert stats_text({}) == "" and tool_call_text({"name": "x", "arguments": '{"a'}) == '🔧 x({"a)'


def test_progress_delegate_draws_a_bar(qtbot):
    model = QStandardItemModel(2, 1)
    bar = QStandardItem("50% · 1.0 GiB of 2.0 GiB")
    bar.setData(0.5, PROGRESS_ROLE)
    model.setItem(0, 0, bar)
    model.setItem(1, 0, QStandardItem("queued"))
    view = QTableView()
    view.setStyle(QStyleFactory.create("Fusion"))   # the app's style (ui/theme.py)
    qtbot.addWidget(view)
    view.setModel(model)
    view.setItemDelegate(ProgressDelegate(view))
    view.resize(400, 120)
    view.setColumnWidth(0, 360)
    view.show()
    qtbot.waitExposed(view)
    image = view.viewport().grab().toImage()
    rect = view.visualRect(model.index(0, 0))
    filled = image.pixelColor(rect.left() + 20, rect.center().y())
    empty = image.pixelColor(rect.right() - 20, rect.center().y())
    assert filled != empty   # the left half is drawn as progress, the right half is not
