"""The one logging setup: a rotating file in the user's log folder plus stderr."""
from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(log_dir: Path, *, name: str = "freetoken", level: int = logging.INFO,
                  stderr: bool = True) -> Path:
    """Configure the root logger once per process; returns the log file's path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"{name}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_freetoken", False):
            root.removeHandler(handler)
            handler.close()
    file_handler = logging.handlers.RotatingFileHandler(
        log_file, maxBytes=5 * 1024 * 1024, backupCount=3, encoding="utf-8")
    handlers: list[logging.Handler] = [file_handler]
    if stderr:
        handlers.append(logging.StreamHandler())
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._freetoken = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    return log_file
