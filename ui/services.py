"""Everything the window's pages share, built once: settings, chats, telemetry, the worker session,
agent setup, and the library services. Tests build the same object, so views run against the real
services everywhere.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from PySide6.QtCore import QObject

from app.agents.setup import AgentSetup
from app.chats import ChatStore
from app.paths import Paths, user_paths
from app.settings import Settings
from app.telemetry import TelemetryMonitor, TelemetrySampler
from ui.session import EngineSession

log = logging.getLogger(__name__)


def optional_module(name: str) -> tuple[ModuleType | None, str]:
    """(module, "") when a service module exists, else (None, why) — a page then says it is not available."""
    try:
        return importlib.import_module(name), ""
    except ModuleNotFoundError as exc:
        if exc.name != name:   # the module exists but something it needs is missing: that is a real error
            raise
        return None, f"{name} is not part of this build"


@dataclass
class Services:
    settings: Settings
    paths: Paths
    chats: ChatStore
    telemetry: TelemetryMonitor
    session: EngineSession
    agent_setup: AgentSetup
    downloads: Any = None          # app.downloads.DownloadManager, when that service is in the build

    @classmethod
    def create(cls, *, parent: QObject | None = None, sampler: TelemetrySampler | None = None,
               worker_factory: Any = None) -> "Services":
        settings = Settings()
        paths = user_paths(settings.get("models_dir") or None).ensure()
        if worker_factory is None:
            worker_factory, reason = default_worker_factory()
        else:
            reason = ""
        return cls(settings=settings, paths=paths, chats=ChatStore(paths.data / "chats.sqlite3"),
                   telemetry=TelemetryMonitor(sampler, parent=parent),
                   session=EngineSession(worker_factory, parent=parent, unavailable_reason=reason),
                   agent_setup=AgentSetup(paths.data), downloads=make_download_manager(paths, settings))

    def close(self) -> None:
        self.telemetry.stop()
        self.session.shutdown(wait_ms=WORKER_QUIT_MS)
        if self.downloads is not None:
            self.downloads.shutdown(wait=True, timeout=DOWNLOAD_SHUTDOWN_S)   # partial files resume next time
        self.chats.close()


DOWNLOAD_SHUTDOWN_S = 5.0
WORKER_QUIT_MS = 5000           # the worker frees the model and exits; past this it is killed
MIB = 1024**2


def make_download_manager(paths: Paths, settings: Settings):
    """The download queue (resumed from the data folder), or None when app.downloads is not in this build."""
    module, _reason = optional_module("app.downloads")
    if module is None:
        return None
    manager = module.DownloadManager(paths.models, paths.data / "downloads.json",
                                     endpoint=settings.get("hf_endpoint") or None,
                                     concurrency=settings.get("download_concurrency"),
                                     bandwidth_bytes_s=settings.get("download_bandwidth_mib_s") * MIB)
    return manager.start()


def default_worker_factory():
    """A callable that makes a fresh worker client, or (None, why) when the worker is not in this build."""
    module, reason = optional_module("app.worker_client")
    if module is None:
        return None, reason
    from ui.worker_adapter import make_worker_factory

    return make_worker_factory(module), ""
