"""A chat message rendered from Markdown: prose through Qt's CommonMark renderer, fenced code
blocks as their own widget with syntax highlighting (Pygments) and a Copy button.

Streaming calls `set_markdown` with the growing text many times a second; blocks that did not
change keep their widgets, so only the last block is re-rendered.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from ui import theme

# A fence opens with ``` or ~~~ (up to 3 spaces of indent) and an optional info string (the language).
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^\n]*$")
COPIED_FEEDBACK_MS = 1500


@dataclass(frozen=True)
class Block:
    kind: str          # "text" | "code"
    text: str
    lang: str = ""
    closed: bool = True   # False for a code block still streaming in


def split_blocks(markdown: str) -> list[Block]:
    """Prose paragraphs and fenced code blocks, in order. An unclosed fence (mid-stream) runs to the end.

    Prose is cut at blank lines so that while an answer streams only its last paragraph is laid out
    again, not the whole answer (a long answer would otherwise cost more per redraw than the loop has)."""
    blocks: list[Block] = []
    prose: list[str] = []
    code: list[str] = []
    fence = ""
    lang = ""
    for line in markdown.split("\n"):
        if not fence:
            m = FENCE.match(line)
            if m:
                if any(p.strip() for p in prose):
                    blocks.append(Block("text", "\n".join(prose).strip("\n")))
                prose = []
                fence, lang, code = m.group(1), m.group(2), []
            elif not line.strip() and any(p.strip() for p in prose):
                blocks.append(Block("text", "\n".join(prose).strip("\n")))
                prose = []
            else:
                prose.append(line)
        elif line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append(Block("code", "\n".join(code), lang))
            fence = ""
        else:
            code.append(line)
    if fence:
        blocks.append(Block("code", "\n".join(code), lang, closed=False))
    elif any(p.strip() for p in prose):
        blocks.append(Block("text", "\n".join(prose).strip("\n")))
    return blocks


def highlight_html(code: str, lang: str, *, dark: bool) -> str:
    """Code as HTML with inline colours (QLabel has no CSS classes); plain when the language is unknown."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import get_lexer_by_name
    from pygments.util import ClassNotFound

    try:
        lexer = get_lexer_by_name(lang) if lang else None
    except ClassNotFound:
        lexer = None
    if lexer is None:
        body = html.escape(code)
    else:
        formatter = HtmlFormatter(noclasses=True, nowrap=True, style="monokai" if dark else "friendly")
        body = highlight(code, lexer, formatter).rstrip("\n")
    return f"<pre style='margin:0'>{body}</pre>"


class TextBlock(QLabel):
    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.MarkdownText)
        self.setWordWrap(True)
        self.setOpenExternalLinks(True)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        self.source = ""
        self.set_source(text)

    def set_source(self, text: str) -> None:
        if text != self.source:
            self.source = text
            self.setText(text)


class CodeBlock(QFrame):
    """A highlighted code block with its language and a Copy button."""

    copied = Signal(str)

    def __init__(self, code: str, lang: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("CodeBlock")
        self.code = ""
        self.lang = lang
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 8)
        layout.setSpacing(2)
        header = QHBoxLayout()
        self.lang_label = QLabel(lang or "code")
        self.lang_label.setObjectName("CodeLang")
        self.copy_button = QPushButton("Copy")
        self.copy_button.setIcon(theme.icon("copy"))
        self.copy_button.setProperty("flat", True)
        self.copy_button.setAccessibleName(f"Copy {lang or 'code'} block")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        header.addWidget(self.lang_label)
        header.addStretch(1)
        header.addWidget(self.copy_button)
        layout.addLayout(header)
        self.label = QLabel()
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        # Long lines scroll sideways instead of widening the whole chat.
        self.scroll = QScrollArea()
        self.scroll.setWidget(self.label)
        self.scroll.setWidgetResizable(True)
        self.scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setStyleSheet("background: transparent;")
        layout.addWidget(self.scroll)
        self.set_code(code)

    def set_code(self, code: str) -> None:
        if code == self.code and self.label.text():
            return
        self.code = code
        self.label.setText(highlight_html(code, self.lang, dark=theme_is_dark()))
        hint = self.label.sizeHint().height()
        self.scroll.setFixedHeight(hint + self.scroll.horizontalScrollBar().sizeHint().height() + 2)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code)
        self.copy_button.setText("Copied")
        QTimer.singleShot(COPIED_FEEDBACK_MS, self.copy_button, lambda: self.copy_button.setText("Copy"))
        self.copied.emit(self.code)


def theme_is_dark() -> bool:
    app = QGuiApplication.instance()
    return bool(app) and app.palette().window().color().lightness() < 128


class MarkdownView(QWidget):
    """A column of TextBlock and CodeBlock widgets kept in step with a Markdown source."""

    def __init__(self, markdown: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(6)
        self.blocks: list[Block] = []
        self.widgets: list[QWidget] = []
        self.markdown = ""
        self.set_markdown(markdown)

    def set_markdown(self, markdown: str) -> None:
        if markdown == self.markdown and self.widgets:
            return
        self.markdown = markdown
        blocks = split_blocks(markdown)
        keep = 0
        for old, new in zip(self.blocks, blocks):
            if old.kind != new.kind or old.lang != new.lang:
                break
            keep += 1
        for widget in self.widgets[keep:]:
            self._layout.removeWidget(widget)
            widget.deleteLater()
        self.widgets = self.widgets[:keep]
        for i, block in enumerate(blocks):
            if i < keep:
                widget = self.widgets[i]
                if block != self.blocks[i]:
                    widget.set_code(block.text) if block.kind == "code" else widget.set_source(block.text)
                continue
            widget = CodeBlock(block.text, block.lang) if block.kind == "code" else TextBlock(block.text)
            self._layout.addWidget(widget)
            self.widgets.append(widget)
        self.blocks = blocks

    def code_blocks(self) -> list[CodeBlock]:
        return [w for w in self.widgets if isinstance(w, CodeBlock)]
