"""Shared helpers for the desktop-app tests (tests/test_ui_*.py): the real services, an isolated agent home."""
from __future__ import annotations

from pathlib import Path

from app.agents.base import Platform
from app.agents.setup import AgentSetup
from ui.services import Services


def make_services(home: Path, **kwargs) -> Services:
    """The window's real services under FREETOKEN_HOME, with agent configs under `home` (never the real ~)."""
    services = Services.create(**kwargs)
    services.agent_setup = AgentSetup(services.paths.data,
                                      Platform(system="linux", env={"HOME": str(home / "user-home")}))
    return services


def make_window(qtbot, home: Path, **kwargs):
    from ui.main_window import MainWindow

    window = MainWindow(make_services(home, **kwargs))
    qtbot.addWidget(window)
    return window
