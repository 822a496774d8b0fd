"""The engine service: one thread owns the Engine; HTTP handlers and the IPC loop hand it work.

Everything that touches the Engine runs on the service thread (the Engine is not thread-safe and the
GPU wants one owner). Callers talk to it through an inbox of commands and get their answers through
the `sink` they hand in with each job: a callable the service thread calls with ServiceEvents, which
the caller forwards to its own world (an asyncio queue for HTTP, a socket for IPC).

    caller thread                     service thread
    submit(job) --> inbox ----------> add_request / cancel / load / unload
                                       loop: drain inbox; engine.step(); route TokenEvents
    job.sink(Piece | Finished | ...) <- parser(text) per request

The queue bound counts every admitted request (waiting or running); past it `submit` raises
Overloaded at once, so a flood gets 429/529 instead of a hang. Cancel goes through the inbox and is
handled before the next step, so a client that goes away stops costing compute within one step.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 64          # admitted requests (running + waiting) before Overloaded
DEFAULT_STATS_INTERVAL_S = 1.0
LEARNED_STATE_SAVE_S = 60.0      # the expert tier's learned state is written at most this often while idle,
                                 # and always at unload: a crash loses at most a minute of it


# ---- what the service tells a job's sink ------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """A parsed piece of output: text, reasoning, or part of a tool call (index; call_id/name on its first)."""
    kind: str                      # "text" | "reasoning" | "tool_call"
    text: str = ""
    index: int = 0
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class Finished:
    finish_reason: str             # "stop" | "length" | "cancelled" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    total_s: float
    stop_sequence: str | None = None   # the stop string that ended generation, when known
    cached_tokens: int = 0             # prompt tokens the engine's prefix cache supplied (not recomputed)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens}

    def timings(self) -> dict:
        return {"ttft_s": self.ttft_s, "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
                "total_s": self.total_s}


@dataclass(frozen=True)
class Failed:
    code: str                      # a runtime.protocol ERROR_CODES value
    message: str


ServiceEvent = Piece | PrefillProgress | Finished | Failed


# ---- errors raised to the caller at submit time ---------------------------------------------------------

class ServiceError(Exception):
    code = "engine_error"


class Overloaded(ServiceError):
    code = "overloaded"


class NoModel(ServiceError):
    code = "no_model"


class StillLoading(ServiceError):
    code = "loading"


class ContextTooLong(ServiceError):
    code = "context_length"

    def __init__(self, prompt_tokens: int, limit: int):
        self.prompt_tokens, self.limit = prompt_tokens, limit
        super().__init__(f"the prompt is {prompt_tokens} tokens, but the model's context is {limit} tokens "
                         f"(it must leave room for at least one generated token)")


# ---- jobs --------------------------------------------------------------------------------------------------

@dataclass
class GenerateJob:
    prompt_ids: list[int]
    prompt_text: str                 # what the parser needs to know (did the prompt open <think>?)
    sampling: Any                    # runtime.engine.SamplingParams
    sink: Callable[[ServiceEvent], None]
    parse: bool = True               # False: raw completion, every token is text
    tools: list | None = None        # canonical tools, so the parser can type XML tool parameters
    # set by the service
    key: int = 0
    request_id: Any = None
    parser: Any = None
    t_submit: float = 0.0
    t_first: float | None = None
    completion_tokens: int = 0
    tokens: list = field(default_factory=list)    # generated ids, to tell which stop string matched
    cached_tokens: int = 0
    saw_tool_call: bool = False
    done: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What request handlers may read about the loaded model from any thread (immutable snapshot)."""
    model_id: str
    model_type: str
    context_length: int
    tokenizer: Any                   # runtime.text.tokenizer.Tokenizer (read-only use is thread-safe)
    chat_template: Any               # runtime.text.chat_template.ChatTemplate
    plan: dict
    path: str
    generation_config: dict = field(default_factory=dict)
    loaded_at: float = 0.0


@dataclass(frozen=True)
class LoadOptions:
    device: str = "auto"
    context_length: int | None = None
    max_batch: int = 8
    vram_budget: int | None = None
    cpu_experts_per_layer: int | None = None
    dense_int8: bool | None = None      # dense weights in int8 on a GPU (None: the engine decides; Engine.load)
    state_dir: str | None = None        # the model's learned state (routing statistics): see Engine.load

    @classmethod
    def from_dict(cls, options: dict | None) -> "LoadOptions":
        options = dict(options or {})
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown load option(s): {', '.join(sorted(unknown))}")
        return cls(**options)


def _default_engine_loader(path, options: LoadOptions, progress):
    from runtime.engine import Engine

    kwargs = dict(device=options.device, max_batch=options.max_batch, vram_budget=options.vram_budget,
                  cpu_experts_per_layer=options.cpu_experts_per_layer, dense_int8=options.dense_int8,
                  progress=progress)
    if options.context_length:
        kwargs["context_length"] = options.context_length
    if options.state_dir:
        kwargs["state_dir"] = options.state_dir
    return Engine.load(path, **kwargs)


def _default_parser_factory(model_type: str, prompt_text: str, tools: list | None):
    from runtime.text.parsers import make_output_parser

    return make_output_parser(model_type, prompt_text, tools=tools)


def _generation_config(engine) -> dict:
    config = getattr(engine, "generation_config", None)
    if config is None:
        config = getattr(getattr(engine, "package", None), "generation_config", None)
    return dict(config or {})


class Service:
    """Owns the engine thread. Thread-safe: every public method may be called from any thread."""

    def __init__(self, *, max_queue: int = DEFAULT_MAX_QUEUE, stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
                 engine_loader: Callable = _default_engine_loader,
                 parser_factory: Callable = _default_parser_factory):
        self.max_queue = max_queue
        self.stats_interval_s = stats_interval_s
        self._engine_loader = engine_loader
        self._parser_factory = parser_factory
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._jobs: dict[int, GenerateJob] = {}      # key -> admitted job (waiting in inbox or running)
        self._by_rid: dict[Any, GenerateJob] = {}     # engine request id -> job (service thread only)
        self._keys = itertools.count(1)
        self._engine = None                           # service thread only
        self._saved_at = time.monotonic()             # when the learned state was last written
        self._unsaved = False                         # steps ran since then (an idle engine learns nothing)
        self._model: ModelInfo | None = None
        self._state = "empty"                         # empty | loading | ready | failed
        self._load_error: str | None = None
        self._stats_sinks: dict[str, Callable[[dict], None]] = {}
        self._served = 0
        self._tokens_out = 0
        self._recent: list[tuple[float, int]] = []    # (time, tokens) per step, for a recent tok/s
        self._thread = threading.Thread(target=self._run, name="freetoken-engine", daemon=True)
        self._thread.start()

    # ---- state readable from any thread ----

    @property
    def model(self) -> ModelInfo | None:
        return self._model

    @property
    def state(self) -> str:
        return self._state

    @property
    def load_error(self) -> str | None:
        return self._load_error

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    # ---- commands ----

    def load(self, path, options: LoadOptions | None = None, *,
             on_progress: Callable[[float, float, str], None] | None = None,
             on_done: Callable[[ModelInfo | None, str | None], None] | None = None) -> None:
        """Load the model at `path` (replacing the current one) on the service thread. `on_done(info, error)`."""
        with self._lock:
            self._state = "loading"
            self._load_error = None
        self._inbox.put(("load", path, options or LoadOptions(), on_progress, on_done))

    def load_sync(self, path, options: LoadOptions | None = None, *, timeout_s: float = 600) -> ModelInfo:
        done = threading.Event()
        result: dict = {}

        def finished(info, error):
            result.update(info=info, error=error)
            done.set()

        self.load(path, options, on_done=finished)
        if not done.wait(timeout_s):
            raise ServiceError(f"loading {path} took longer than {timeout_s} s")
        if result["error"]:
            raise ServiceError(result["error"])
        return result["info"]

    def unload(self, *, on_done: Callable[[], None] | None = None) -> None:
        self._inbox.put(("unload", on_done))

    def submit(self, job: GenerateJob) -> GenerateJob:
        """Admit `job` or raise Overloaded / NoModel / StillLoading / ContextTooLong at once."""
        model = self._model
        if model is None:
            if self._state == "loading":
                raise StillLoading("a model is still loading; try again in a moment")
            raise NoModel("no model is loaded")
        if len(job.prompt_ids) >= model.context_length:
            raise ContextTooLong(len(job.prompt_ids), model.context_length)
        if not job.prompt_ids:
            raise ServiceError("the prompt is empty")
        with self._lock:
            if len(self._jobs) >= self.max_queue:
                raise Overloaded(f"the server is busy: {len(self._jobs)} requests are queued or running "
                                 f"(limit {self.max_queue}); retry shortly")
            job.key = next(self._keys)
            job.t_submit = time.perf_counter()
            self._jobs[job.key] = job
        self._inbox.put(("add", job))
        return job

    def cancel(self, job: GenerateJob) -> None:
        """Stop `job` before the engine's next step (no-op when it already finished)."""
        if not job.done:
            self._inbox.put(("cancel", job))

    def subscribe_stats(self, name: str, sink: Callable[[dict], None]) -> None:
        with self._lock:
            self._stats_sinks[name] = sink

    def unsubscribe_stats(self, name: str) -> None:
        with self._lock:
            self._stats_sinks.pop(name, None)

    def stats(self) -> dict:
        """Service figures (any thread); the engine's own stats arrive through subscribe_stats."""
        with self._lock:
            admitted = len(self._jobs)
        now = time.monotonic()
        recent = [n for t, n in self._recent if now - t <= 5.0]
        return {"state": self._state, "model": self._model.model_id if self._model else None,
                "requests_admitted": admitted, "queue_limit": self.max_queue, "requests_served": self._served,
                "tokens_generated": self._tokens_out, "tokens_per_s_5s": sum(recent) / 5.0}

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel everything, free the engine and end the thread."""
        self._inbox.put(("stop",))
        self._thread.join(timeout_s)

    # ---- the service thread ----

    def _run(self) -> None:
        next_stats = time.monotonic() + self.stats_interval_s
        try:
            while True:
                busy = self._engine is not None and self._engine.has_work()
                timeout = 0 if busy else max(0.0, next_stats - time.monotonic())
                if not self._drain_inbox(block_s=timeout):
                    return
                if self._engine is not None and self._engine.has_work():
                    self._step()
                if time.monotonic() >= next_stats:
                    self._publish_stats()
                    next_stats = time.monotonic() + self.stats_interval_s
                    if not busy and time.monotonic() - self._saved_at >= LEARNED_STATE_SAVE_S:
                        self._save_learned_state()
        finally:
            self._fail_all("engine_error", "the engine service stopped")
            self._save_learned_state()
            self._engine = None

    def _save_learned_state(self) -> None:
        """Write the engine's learned state (routing statistics) where the load asked; a failure (a full disk)
        is logged and costs only that state, never a request."""
        self._saved_at = time.monotonic()
        save = getattr(self._engine, "save_learned_state", None)
        if not callable(save) or not self._unsaved:
            return
        self._unsaved = False
        try:
            save()
        except Exception:            # noqa: BLE001  (the next load then starts colder: say so, carry on)
            log.exception("saving the model's learned state failed")

    def _drain_inbox(self, block_s: float) -> bool:
        """Run every queued command; False once 'stop' arrived."""
        try:
            command = self._inbox.get(timeout=block_s) if block_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "stop":
                return False
            try:
                getattr(self, f"_do_{kind}")(*command[1:])
            except Exception:   # a bug in one command must not kill the engine thread
                log.exception("engine service command %s failed", kind)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _do_load(self, path, options: LoadOptions, on_progress, on_done) -> None:
        self._fail_all("engine_error", "the model was replaced while this request ran")
        self._save_learned_state()
        self._engine = None
        self._model = None
        try:
            engine = self._engine_loader(path, options, on_progress or (lambda *a: None))
            info = ModelInfo(model_id=engine.model_id, model_type=engine.model_type,
                             context_length=int(engine.context_length), tokenizer=engine.tokenizer,
                             chat_template=engine.chat_template, plan=dict(getattr(engine, "plan", {}) or {}),
                             path=str(path), generation_config=_generation_config(engine),
                             loaded_at=time.time())
        except Exception as exc:   # any load failure is reported, never kills the thread
            log.exception("loading %s failed", path)
            # the engine's and the reader's errors are written for users; anything else is a bug: name it
            message = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._state, self._load_error = "failed", message
            if on_done:
                on_done(None, message)
            return
        self._engine = engine
        with self._lock:
            self._model, self._state = info, "ready"
        if on_done:
            on_done(info, None)

    def _do_unload(self, on_done) -> None:
        self._fail_all("no_model", "the model was unloaded")
        self._save_learned_state()
        self._engine = None
        with self._lock:
            self._model, self._state = None, "empty"
        if on_done:
            on_done()

    def _do_add(self, job: GenerateJob) -> None:
        if job.done:                      # cancelled before it reached the engine
            return
        if self._engine is None:
            self._finish_failed(job, "no_model", "no model is loaded")
            return
        try:
            job.parser = (self._parser_factory(self._model.model_type, job.prompt_text, job.tools)
                          if job.parse else None)
            job.request_id = self._engine.add_request(
                job.prompt_ids, job.sampling, on_prefill=lambda done, total: self._deliver(job, PrefillProgress(done, total)))
        except Exception as exc:
            # the engine refuses bad requests with EngineError (a ValueError): the caller's fault, not ours
            code = ("context_length" if "context" in str(exc).lower() else
                    "bad_request" if isinstance(exc, ValueError) else "engine_error")
            self._finish_failed(job, code, str(exc))
            return
        self._by_rid[job.request_id] = job

    def _do_cancel(self, job: GenerateJob) -> None:
        if job.done:
            return
        if job.request_id is not None and self._engine is not None:
            self._engine.cancel(job.request_id)
            self._by_rid.pop(job.request_id, None)
            self._forget(job)
        self._finish(job, "cancelled", stop_sequence=None)

    def _step(self) -> None:
        self._unsaved = True
        try:
            events = self._engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_all("engine_error", f"the engine failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        produced = 0
        for ev in events:
            job = self._by_rid.get(ev.request_id)
            if job is None or job.done:
                continue
            if ev.token_id is not None:
                job.completion_tokens += 1
                job.tokens.append(ev.token_id)
                produced += 1
            if job.t_first is None:
                job.t_first = now
            if ev.text:
                self._emit_text(job, ev.text)
            if ev.finished:
                self._by_rid.pop(ev.request_id, None)
                self._forget(job)
                self._flush_parser(job)
                reason = ev.finish_reason or "stop"
                if reason == "stop" and job.saw_tool_call:
                    reason = "tool_calls"
                self._finish(job, reason, stop_sequence=self._matched_stop(job, reason))
        if produced:
            self._tokens_out += produced
            self._recent.append((time.monotonic(), produced))
            if len(self._recent) > 4096:
                del self._recent[:2048]

    def _matched_stop(self, job: GenerateJob, reason: str) -> str | None:
        """The stop string that ended `job`, if one did (the engine hides it from the text it streams)."""
        stops = tuple(getattr(job.sampling, "stop", ()) or ())
        if reason != "stop" or not stops or not job.tokens:
            return None
        if job.tokens[-1] in set(getattr(self._engine, "eos_ids", ()) or ()):
            return None
        text = self._model.tokenizer.decode(job.tokens)
        found = [(text.find(s), s) for s in stops if s and s in text]
        return min(found)[1] if found else None

    def _deliver(self, job: GenerateJob, event) -> None:
        """Hand `event` to the job's owner. A sink that fails (its client or event loop is gone) must not
        take the engine thread down: the job is cancelled before the next step instead."""
        try:
            job.sink(event)
        except Exception:
            log.exception("the receiver of a request failed; cancelling the request")
            if not job.done:
                self._inbox.put(("cancel", job))

    def _forget(self, job: GenerateJob) -> None:
        """Drop the engine's kept result of a finished request (it keeps them until read)."""
        pop = getattr(self._engine, "result", None)
        if pop is not None and job.request_id is not None:
            result = pop(job.request_id)
            job.cached_tokens = int(getattr(result, "cached_tokens", 0) or 0)

    def _emit_text(self, job: GenerateJob, text: str) -> None:
        if job.parser is None:
            self._deliver(job, Piece("text", text))
            return
        for delta in job.parser.feed(text):
            self._emit_delta(job, delta)

    def _flush_parser(self, job: GenerateJob) -> None:
        if job.parser is not None:
            for delta in job.parser.finish():
                self._emit_delta(job, delta)

    def _emit_delta(self, job: GenerateJob, delta) -> None:
        if delta.kind == "tool_call":
            job.saw_tool_call = True
            self._deliver(job, Piece("tool_call", index=delta.index, call_id=getattr(delta, "id", None) or None,
                                     name=delta.name, arguments=delta.arguments or ""))
        elif delta.text:
            self._deliver(job, Piece(delta.kind, delta.text))

    def _finish(self, job: GenerateJob, reason: str, *, stop_sequence: str | None) -> None:
        end = time.perf_counter()
        first = job.t_first or end
        ttft = first - job.t_submit
        prompt = len(job.prompt_ids)
        decode_s = end - first
        job.done = True
        with self._lock:
            self._jobs.pop(job.key, None)
            self._served += 1
        self._deliver(job, Finished(finish_reason=reason, prompt_tokens=prompt, completion_tokens=job.completion_tokens,
                          ttft_s=ttft, prefill_tps=prompt / ttft if ttft > 0 else 0.0,
                          decode_tps=(job.completion_tokens - 1) / decode_s if decode_s > 0 and
                          job.completion_tokens > 1 else 0.0,
                          total_s=end - job.t_submit, stop_sequence=stop_sequence,
                          cached_tokens=job.cached_tokens))

    def _finish_failed(self, job: GenerateJob, code: str, message: str) -> None:
        job.done = True
        with self._lock:
            self._jobs.pop(job.key, None)
        self._deliver(job, Failed(code, message))

    def _fail_all(self, code: str, message: str) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.request_id is not None and self._engine is not None:
                try:
                    self._engine.cancel(job.request_id)
                except Exception:
                    log.exception("cancel during shutdown failed")
            self._finish_failed(job, code, message)
        self._by_rid.clear()

    def _publish_stats(self) -> None:
        with self._lock:
            sinks = list(self._stats_sinks.values())
        if not sinks:
            return
        stats = self.stats()
        if self._engine is not None:
            try:
                stats["engine"] = self._engine.stats()
            except Exception as exc:
                stats["engine"] = {"error": str(exc)}
        for sink in sinks:
            try:
                sink(stats)
            except Exception:
                log.exception("stats subscriber failed")
