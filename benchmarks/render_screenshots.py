"""Render every page of the desktop app to PNG, offscreen, at a fixed size: docs/screenshots/<page>-<theme>.png.

    QT_QPA_PLATFORM=offscreen python benchmarks/render_screenshots.py [--out docs/screenshots] [--no-model]

It runs the real app in a throwaway FREETOKEN_HOME: the real services, the real worker and, unless
--no-model, the built-in demo model (random weights: its answers are gibberish by design) loaded
and asked one question, so Chat, Console and the status bar show a real streamed answer with its
stats and the real memory plan. Telemetry is sampled for a few seconds so the charts have lines.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZE = (1280, 800)
TELEMETRY_SECONDS = 6
ANSWER_TOKENS = 48
QUESTION = "Write a Python function that adds two numbers, in a fenced code block."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--no-model", action="store_true", help="skip loading the demo model")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for load and answer")
    args = parser.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["FREETOKEN_HOME"] = tempfile.mkdtemp(prefix="freetoken-screens-")
    sys.path.insert(0, str(ROOT))

    from PySide6.QtCore import QSize
    from PySide6.QtWidgets import QApplication

    from ui.main_window import PAGES, MainWindow
    from ui.theme import Theme

    app = QApplication.instance() or QApplication([sys.argv[0]])
    theme = Theme()
    theme.apply(app, "light")
    window = MainWindow()
    window.setFixedSize(QSize(*SIZE))
    window.show()

    def pump(seconds: float, until=lambda: False) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            app.processEvents()
            if until():
                return True
            time.sleep(0.02)
        return until()

    session = window.services.session
    if not args.no_model and session.available:
        from app.demo import ensure_demo_model

        demo = ensure_demo_model(window.services.paths.models)
        session.load(str(demo.path), {"device": "cpu", "context_length": 2048})
        if not pump(args.timeout, lambda: session.model_ready):
            print(f"the demo model did not load: {session.state} {session.crash_reason}", file=sys.stderr)
            return 1
        window.show_page("chat")
        chat = window.views["chat"]
        from app.chats import ChatSampling

        # random weights ramble to the token limit: keep the answer short
        window.services.chats.update(chat.new_chat(), sampling=ChatSampling(max_tokens=ANSWER_TOKENS))
        chat.input.setPlainText(QUESTION)
        chat.send()
        pump(args.timeout, lambda: chat.streaming is None)
    pump(TELEMETRY_SECONDS)

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for mode in ("light", "dark"):
        theme.apply(app, mode)
        for page in PAGES:
            window.show_page(page)
            pump(0.3)
            path = args.out / f"{page}-{mode}.png"
            window.grab().save(str(path))
            written.append(path)
    window.close()
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
