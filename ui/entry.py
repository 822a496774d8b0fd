"""The `freetoken` console entry: no arguments opens the app, anything else is the CLI.

It lives in ui/ because it is the one place allowed to reach every layer; the GUI (and
QtWidgets) is imported only when the window is asked for, so headless commands never load it.
On a Linux machine with no display at all, `freetoken` alone serves the API instead of failing
to open a window (the README's first command is then the whole main job).
"""
from __future__ import annotations

import os
import sys


def has_display(platform: str = sys.platform, env: dict | None = None) -> bool:
    """Whether a window can be shown: always on Windows/macOS; on Linux an X11/Wayland display or a Qt platform."""
    env = os.environ if env is None else env
    if not platform.startswith("linux"):
        return True
    return any(env.get(k) for k in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "gui" or not argv and has_display():
        from ui.app_main import run_gui

        return run_gui(argv[1:])
    from app.cli import main as cli_main

    if not argv:
        print("No display found: serving the API instead of opening the app (`freetoken serve --help`).",
              file=sys.stderr)
        argv = ["serve"]
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
