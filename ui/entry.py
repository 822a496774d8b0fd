"""The `freetoken` console entry: no arguments opens the app, anything else is the CLI.

It lives in ui/ because it is the one place allowed to reach every layer; the GUI (and
QtWidgets) is imported only when the window is asked for, so headless commands never load it.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "gui":
        from ui.app_main import run_gui

        return run_gui(argv[1:])
    from app.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
