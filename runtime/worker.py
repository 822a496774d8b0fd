"""The runtime worker: the engine service, reached by the UI over IPC and by clients over HTTP.

    freetoken worker --ipc NAME      (started by the UI with QProcess; connects back to its QLocalServer)

`WorkerCore` is the protocol logic and knows nothing of Qt: it takes request dicts and answers through
a `send(message)` callable that any thread may call. `run_worker` wires it to the QLocalSocket
transport and a Qt event loop on the main thread. The engine runs on the service's own thread; the
HTTP server (when the UI turns it on) on its own thread; so a long generation never stalls IPC.
docs/ipc.md is the protocol.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from runtime import protocol
from runtime.protocol import ProtocolError
from runtime.service import (ContextTooLong, Failed, Finished, GenerateJob, LoadOptions, NoModel, Overloaded, Piece,
                             PrefillProgress, Service, ServiceError, StillLoading)

log = logging.getLogger(__name__)

MIN_STATS_INTERVAL_S = 0.1
DEFAULT_PORT = 1919
EXIT_OK, EXIT_NO_CONNECTION, EXIT_PROTOCOL = 0, 2, 3


class WorkerCore:
    """Protocol logic: handshake, then each request turned into service calls and events."""

    def __init__(self, service: Service, send: Callable[[dict], None], *, version: str | None = None,
                 on_exit: Callable[[int], None] = lambda code: None, server_factory: Callable | None = None):
        self.service = service
        self.send = send
        self.version = version
        self.on_exit = on_exit
        self.server_factory = server_factory or _default_server
        self.server = None
        self.handshaken = False
        self.jobs: dict[str, GenerateJob] = {}

    def start(self) -> None:
        self.send(protocol.hello(version=self.version, pid=os.getpid()))

    def handle(self, message: dict) -> None:
        request_id = message.get("id") if isinstance(message.get("id"), str) else None
        if not self.handshaken:
            try:
                protocol.check_hello(message, peer="app")
            except ProtocolError as exc:
                self.send(protocol.error(request_id, "protocol_mismatch", str(exc)))
                self.on_exit(EXIT_PROTOCOL)
                return
            self.handshaken = True
            return
        try:
            protocol.check_request(message)
        except ProtocolError as exc:
            self.send(protocol.error(request_id, "bad_request", str(exc)))
            return
        try:
            getattr(self, f"_on_{message['type']}")(message)
        except Exception as exc:   # a bug in one request must answer it and leave the worker serving
            log.exception("request %s failed", message["type"])
            self.send(protocol.error(request_id, "engine_error", f"{type(exc).__name__}: {exc}"))

    # ---- requests ----

    def _on_hello(self, message: dict) -> None:
        self.send(protocol.error(None, "bad_request", "hello was already exchanged"))

    def _on_load(self, message: dict) -> None:
        rid = message["id"]
        try:
            options = LoadOptions.from_dict(message.get("options"))
        except (TypeError, ValueError) as exc:
            self.send(protocol.error(rid, "bad_request", f"load options: {exc}"))
            return

        def progress(done, total, stage):
            self.send(protocol.event("load_progress", id=rid, done=done, total=total, stage=str(stage)))

        def done(info, error):
            if error:
                self.send(protocol.error(rid, "load_failed", error))
            else:
                self.send(protocol.event("loaded", id=rid, model_id=info.model_id, model_type=info.model_type,
                                         context_length=info.context_length, plan=_jsonable(info.plan)))

        self.service.load(message["model"], options, on_progress=progress, on_done=done)

    def _on_unload(self, message: dict) -> None:
        self.service.unload(on_done=lambda: self.send(protocol.event("unloaded", id=message["id"])))

    def _on_generate(self, message: dict) -> None:
        rid = message["id"]
        if rid in self.jobs:
            self.send(protocol.error(rid, "bad_request", f"request id {rid!r} is already generating"))
            return
        try:
            job = self._make_job(rid, message)
            self.jobs[rid] = job
            self.service.submit(job)
        except (ContextTooLong, Overloaded, NoModel, StillLoading) as exc:
            self.jobs.pop(rid, None)
            self.send(protocol.error(rid, exc.code, str(exc)))
        except (ServiceError, ValueError, TypeError) as exc:
            self.jobs.pop(rid, None)
            self.send(protocol.error(rid, "bad_request", str(exc)))
        except Exception as exc:   # a bug must still answer the request, never leave the app waiting
            log.exception("generate %s failed", rid)
            self.jobs.pop(rid, None)
            self.send(protocol.error(rid, "engine_error", f"{type(exc).__name__}: {exc}"))

    def _make_job(self, rid: str, message: dict) -> GenerateJob:
        from runtime.server import prompts
        from runtime.server.errors import APIError

        model = self.service.model
        if model is None:
            raise StillLoading("a model is still loading") if self.service.state == "loading" else NoModel(
                "no model is loaded; send 'load' first")
        tools = message.get("tools") or None
        try:
            if message.get("messages") is not None:
                text = prompts.render(model, prompts.merge_system(_checked_messages(message["messages"])), tools,
                                      dict(message.get("template_kwargs") or {}))
                parse = True
            else:
                text, parse = message["prompt"], False
            ids = prompts.tokenize(model, text)
            if len(ids) >= model.context_length:
                raise ContextTooLong(len(ids), model.context_length)
            sampling = dict(message.get("sampling") or {})
            max_tokens = sampling.pop("max_tokens", None)
            stop = sampling.pop("stop", None)
            params = prompts.sampling_params(model, prompt_len=len(ids), max_tokens=max_tokens, stop=stop, **sampling)
        except APIError as exc:
            raise ValueError(exc.message) from exc
        return GenerateJob(prompt_ids=ids, prompt_text=text, sampling=params, parse=parse, tools=tools,
                           sink=lambda event: self._job_event(rid, event))

    def _job_event(self, rid: str, event) -> None:   # on the service thread
        if isinstance(event, Piece):
            if event.kind == "tool_call":
                fields = {"index": event.index, "arguments": event.arguments}
                if event.name is not None:
                    fields.update(call_id=event.call_id, name=event.name)
                self.send(protocol.event("delta", id=rid, kind="tool_call", **fields))
            else:
                self.send(protocol.event("delta", id=rid, kind=event.kind, text=event.text))
        elif isinstance(event, PrefillProgress):
            self.send(protocol.event("prefill_progress", id=rid, done=event.done, total=event.total))
        elif isinstance(event, Finished):
            self.jobs.pop(rid, None)
            self.send(protocol.event("done", id=rid, finish_reason=event.finish_reason, usage=event.usage(),
                                     timings=event.timings()))
        elif isinstance(event, Failed):
            self.jobs.pop(rid, None)
            self.send(protocol.error(rid, event.code, event.message))

    def _on_cancel(self, message: dict) -> None:
        job = self.jobs.get(message["target"])
        if job is None:
            self.send(protocol.error(message["id"], "unknown_request",
                                     f"no generation with id {message['target']!r} is running"))
            return
        self.service.cancel(job)
        self.send(protocol.event("ok", id=message["id"]))

    def _on_subscribe_stats(self, message: dict) -> None:
        rid = message["id"]
        interval = message.get("interval_s")
        if interval is not None:
            self.service.stats_interval_s = max(MIN_STATS_INTERVAL_S, float(interval))
        self.service.subscribe_stats(rid, lambda stats: self.send(protocol.event("stats", id=rid,
                                                                                 stats=_jsonable(stats))))
        self.send(protocol.event("ok", id=rid))

    def _on_unsubscribe_stats(self, message: dict) -> None:
        self.service.unsubscribe_stats(message["id"])
        self.send(protocol.event("ok", id=message["id"]))

    def _on_server(self, message: dict) -> None:
        rid = message["id"]
        if self.server is not None:
            self.server.stop()
            self.server = None
        if not message["enable"]:
            self.send(protocol.event("server_state", id=rid, running=False, url=None, message="stopped"))
            return
        try:
            port = message.get("port")
            self.server = self.server_factory(self.service, host=message.get("host") or "127.0.0.1",
                                              port=DEFAULT_PORT if port is None else port,   # 0: any free port
                                              api_key=message.get("api_key"))
        except Exception as exc:   # port in use, unsafe bind, ...: the UI shows the reason
            self.send(protocol.event("server_state", id=rid, running=False, url=None, message=str(exc)))
            return
        self.send(protocol.event("server_state", id=rid, running=True, url=self.server.url, message=None))

    def _on_shutdown(self, message: dict) -> None:
        self.send(protocol.event("ok", id=message["id"]))
        self.close()
        self.on_exit(EXIT_OK)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.service.close()


def _checked_messages(messages: list) -> list[dict]:
    """Chat messages as the templates need them: dicts with a string role and text content."""
    from runtime.server import prompts

    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        out.append({**m, "content": prompts.text_of(m.get("content"), where=f"messages[{i}].content")})
    return out


def _default_server(service: Service, *, host: str, port: int, api_key: str | None):
    from runtime.server.app import ServerThread, create_app
    from runtime.server.context import ServerConfig
    from runtime.server.security import SecurityConfig

    app = create_app(service, ServerConfig(security=SecurityConfig(host=host, api_key=api_key or None), port=port))
    return ServerThread(app, host=host, port=port).start()


def _jsonable(value):
    """Stats and plans as plain JSON values (tuples to lists, odd objects to strings, NaN to None)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def run_worker(ipc_name: str, *, version: str | None = None, max_queue: int | None = None) -> int:
    """Connect to the app's QLocalServer `ipc_name` and serve until shutdown or until the app goes away."""
    from runtime.worker_transport import EventLoop, WorkerTransport

    app = EventLoop()
    transport = WorkerTransport(ipc_name)
    if not transport.connect_to_server():
        return EXIT_NO_CONNECTION
    service = Service(**({"max_queue": max_queue} if max_queue else {}))
    exit_code = {"code": EXIT_OK}

    def finish(code: int) -> None:
        exit_code["code"] = code
        transport.flush()
        app.exit(code)

    core = WorkerCore(service, transport.send, version=version, on_exit=finish)
    transport.received.connect(core.handle)

    def on_broken(reason: str) -> None:
        log.warning("IPC connection ended: %s", reason)
        core.close()
        app.exit(EXIT_OK)

    transport.broken.connect(on_broken)
    core.start()
    app.run()
    core.close()
    return exit_code["code"]
