"""The window's view of the runtime worker: one object every page listens to.

`EngineSession` starts the worker on demand (through app.worker_client), turns the IPC events of
runtime/protocol.py into Qt signals the views connect to, and remembers what the window shows at
a glance (loaded model, its memory plan, the latest engine stats). When the worker dies it says
so once (`crashed(reason)`), fails every request in flight with `worker_crashed`, and `restart()`
brings a new worker up with the same model.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

from app.paths import model_state_dir, user_paths
from app.settings import dense_int8_option

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0


GIB = 1024**3


def load_options(settings) -> dict[str, Any]:
    """The `load` request's options from the user's settings (0 / -1 mean "let the planner decide")."""
    options: dict[str, Any] = {"device": settings.get("device"), "context_length": settings.get("context_length")}
    if settings.get("vram_budget_gib") > 0:
        options["vram_budget"] = int(settings.get("vram_budget_gib") * GIB)
    if settings.get("cpu_experts_per_layer") >= 0:
        options["cpu_experts_per_layer"] = settings.get("cpu_experts_per_layer")
    dense_int8 = dense_int8_option(settings.get("dense_precision"))
    if dense_int8 is not None:
        options["dense_int8"] = dense_int8
    return options


class SessionError(RuntimeError):
    """A request the session cannot take now; the message says why in plain words."""


class EngineSession(QObject):
    # worker lifecycle: "stopped" | "starting" | "idle" (no model) | "loading" | "ready" | "crashed"
    state_changed = Signal(str)
    worker_started = Signal()                # a (new) worker said hello: per-worker setup goes here
    crashed = Signal(str)
    model_changed = Signal()                 # loaded / unloaded / crashed: model_id and plan changed
    load_progress = Signal(float, float, str)   # done, total, stage
    load_failed = Signal(str)
    stats = Signal(dict)
    server_state = Signal(dict)
    delta = Signal(str, dict)                # request id, delta event
    finished = Signal(str, dict)             # request id, done event
    failed = Signal(str, str, str)           # request id, code, message

    def __init__(self, client_factory: Callable[[], Any] | None, *, parent: QObject | None = None,
                 unavailable_reason: str = "") -> None:
        super().__init__(parent)
        self._factory = client_factory
        self.unavailable_reason = unavailable_reason
        self.client: Any = None
        self.state = "stopped"
        self.model_id = ""
        self.model_path = ""
        self.model_type = ""
        self.context_length = 0
        self.plan: dict[str, Any] = {}
        self.last_stats: dict[str, Any] = {}
        self.load_options: dict[str, Any] = {}
        self.crash_reason = ""
        self._pending_load: str | None = None
        self._generations: set[str] = set()

    # -- state ---------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._factory is not None

    @property
    def model_ready(self) -> bool:
        return self.state == "ready"

    def not_ready_reason(self) -> str:
        if not self.available:
            return f"The runtime worker is not available yet: {self.unavailable_reason}"
        return {
            "crashed": f"The worker stopped ({self.crash_reason}). Restart it from the banner.",
            "loading": "The model is still loading.",
            "starting": "The worker is starting.",
        }.get(self.state, "No model is loaded. Load one in the Library first.")

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)

    # -- worker --------------------------------------------------------------------------
    def ensure_worker(self) -> None:
        if not self.available:
            raise SessionError(self.not_ready_reason())
        if self.client is not None and self.state not in ("stopped", "crashed"):
            return
        self.client = self._factory()
        self.client.setParent(self)
        self.client.event.connect(self._on_event)
        self.client.exited.connect(self._on_exited)
        self._set_state("starting")
        self.client.start()

    def restart(self) -> None:
        """A fresh worker; the model that was loaded (or loading) is loaded again."""
        model, options = self.model_path, dict(self.load_options)
        self._drop_client()
        self._set_state("stopped")
        if model:
            self.load(model, options)
        else:
            self.ensure_worker()

    def shutdown(self, *, wait_ms: int = 0) -> None:
        """Stop the worker cleanly; `wait_ms` > 0 waits for it to exit (quitting the app)."""
        if self.client is not None:
            client, self.client = self.client, None
            try:
                client.event.disconnect(self._on_event)
                client.exited.disconnect(self._on_exited)
            except (RuntimeError, TypeError):
                pass   # already disconnected
            client.stop(wait_ms=wait_ms)
        self._generations.clear()
        self._forget_model()
        self._set_state("stopped")

    def _drop_client(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                client.event.disconnect(self._on_event)
                client.exited.disconnect(self._on_exited)
            except (RuntimeError, TypeError):
                pass   # already disconnected
            client.stop()

    # -- requests ------------------------------------------------------------------------
    def load(self, model_path: str, options: dict[str, Any] | None = None) -> str:
        self.ensure_worker()
        self.model_path = str(model_path)
        self.load_options = dict(options or {})
        # what the model's expert tier learns (routing statistics) is kept per model, so it starts warm next time
        self.load_options.setdefault("state_dir", str(model_state_dir(user_paths(), self.model_path)))
        self.crash_reason = ""
        self._set_state("loading")
        request_id = self.client.request("load", model=self.model_path, options=self.load_options)
        self._pending_load = request_id
        return request_id

    def unload(self) -> None:
        if self.client is None or self.state not in ("ready", "loading"):
            return
        self.client.request("unload")
        self.model_path = ""

    def generate(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                 sampling: dict[str, Any] | None = None, tools: list[dict] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> str:
        if not self.model_ready:
            raise SessionError(self.not_ready_reason())
        fields: dict[str, Any] = {"sampling": sampling or {}}
        if messages is not None:
            fields["messages"] = messages
        else:
            fields["prompt"] = prompt
        if tools:
            fields["tools"] = tools
        if template_kwargs:
            fields["template_kwargs"] = template_kwargs
        request_id = self.client.request("generate", **fields)
        self._generations.add(request_id)
        return request_id

    def cancel(self, request_id: str) -> None:
        if self.client is not None and request_id in self._generations:
            self.client.request("cancel", target=request_id)

    def set_server(self, *, enable: bool, host: str | None = None, port: int | None = None,
                   api_key: str | None = None) -> None:
        if self.client is None:
            return
        self.client.request("server", enable=enable, host=host, port=port, api_key=api_key or None)

    # -- events --------------------------------------------------------------------------
    def _on_event(self, message: dict) -> None:
        kind = message.get("type")
        rid = message.get("id")
        if kind == "hello":
            if self.state == "starting":
                self._set_state("idle")
            self.client.request("subscribe_stats", interval_s=STATS_INTERVAL_S)
            self.worker_started.emit()
        elif kind == "load_progress":
            self.load_progress.emit(float(message["done"]), float(message["total"]), message["stage"])
        elif kind == "loaded":
            self._pending_load = None
            self.model_id = message["model_id"]
            self.model_type = message["model_type"]
            self.context_length = message["context_length"]
            self.plan = message.get("plan") or {}
            self._set_state("ready")
            self.model_changed.emit()
        elif kind == "unloaded":
            self._forget_model()
            self._set_state("idle")
            self.model_changed.emit()
        elif kind == "delta":
            self.delta.emit(rid, message)
        elif kind == "done":
            self._generations.discard(rid)
            self.finished.emit(rid, message)
        elif kind == "stats":
            self.last_stats = message["stats"]
            self.stats.emit(self.last_stats)
        elif kind == "server_state":
            self.server_state.emit(message)
        elif kind == "error":
            self._on_error(rid, message["code"], message["message"])

    def _on_error(self, rid: str | None, code: str, text: str) -> None:
        if rid is not None and rid == self._pending_load:
            self._pending_load = None
            self.model_path = ""
            self._set_state("idle")
            self.load_failed.emit(text)
            return
        if rid in self._generations:
            self._generations.discard(rid)
            self.failed.emit(rid, code, text)
            return
        log.warning("worker error %s: %s", code, text)

    def _forget_model(self) -> None:
        self.model_id = ""
        self.model_type = ""
        self.context_length = 0
        self.plan = {}
        self.model_path = ""

    def _on_exited(self, reason: str) -> None:
        self.crash_reason = reason or "the worker process ended"
        self._drop_client()
        for rid in sorted(self._generations):
            self.failed.emit(rid, "worker_crashed", f"the worker stopped: {self.crash_reason}")
        self._generations.clear()
        if self._pending_load is not None:
            self._pending_load = None
            self.load_failed.emit(f"the worker stopped while loading: {self.crash_reason}")
        self.model_id = ""
        self.plan = {}
        self._set_state("crashed")
        self.model_changed.emit()
        self.crashed.emit(self.crash_reason)
