"""The IPC protocol between the UI and the runtime worker: the only thing the two processes share.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON holding one object.
Every message has a `type`. Requests (UI -> worker) carry an `id` the UI chooses; every event the
worker sends about a request carries the same `id` (events not tied to a request have `id: null`).

Both sides send `hello` first, with PROTOCOL_VERSION; a side that gets another version answers an
`error` with code `protocol_mismatch` naming both versions and closes. docs/ipc.md is the full spec.

Messages are plain dicts checked against SCHEMA (field -> type, required) so that a bad frame from a
newer or broken peer is reported naming the message and the field, never acted on half-understood.
Unknown fields are allowed (a newer peer may add optional ones); unknown types are not.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 32 * 1024 * 1024   # a generate request with a long agent conversation is ~1 MB; 32 MB is abuse

# Error codes an `error` event may carry (docs/ipc.md says when each is sent).
ERROR_CODES = (
    "protocol_mismatch",   # hello with another protocol version
    "bad_request",         # a request that does not match SCHEMA, or an unknown request type
    "no_model",            # generate while no model is loaded
    "loading",             # generate while a model is loading and the wait ran out
    "overloaded",          # the request queue is full
    "context_length",      # the prompt does not fit in the model's context
    "load_failed",         # the model could not be loaded (message says why)
    "engine_error",        # the engine failed while generating
    "unknown_request",     # cancel of an id the worker does not know
    "worker_crashed",      # made by the UI side when the worker process dies; never sent on the wire
)

FINISH_REASONS = ("stop", "length", "cancelled", "tool_calls", "error")
DELTA_KINDS = ("text", "reasoning", "tool_call")


class ProtocolError(ValueError):
    """A frame or message that does not follow the protocol; the message names what is wrong."""


@dataclass(frozen=True)
class Field:
    type: type | tuple[type, ...]
    required: bool = True


_OPT_STR = Field((str, type(None)), required=False)
_OPT_DICT = Field((dict, type(None)), required=False)
_OPT_LIST = Field((list, type(None)), required=False)
_NUM = (int, float)

# type -> fields beyond `type`. Requests first (UI -> worker), then events (worker -> UI).
REQUESTS: dict[str, dict[str, Field]] = {
    "hello": {"protocol": Field(int), "version": _OPT_STR, "pid": Field((int, type(None)), required=False)},
    # model: an FTW package folder. options: device, context_length, vram_budget, cpu_experts_per_layer, dense_int8,
    # max_batch, state_dir (the model's learned state: routing statistics)
    "load": {"id": Field(str), "model": Field(str), "options": _OPT_DICT},
    "unload": {"id": Field(str)},
    # messages (chat form, rendered with the model's template) or prompt (raw text); sampling: SamplingParams
    # fields; tools: OpenAI function tools; template_kwargs: e.g. enable_thinking, reasoning_effort
    "generate": {"id": Field(str), "messages": _OPT_LIST, "prompt": _OPT_STR, "tools": _OPT_LIST,
                 "sampling": _OPT_DICT, "template_kwargs": _OPT_DICT},
    "cancel": {"id": Field(str), "target": Field(str)},
    "subscribe_stats": {"id": Field(str), "interval_s": Field(_NUM, required=False)},
    "unsubscribe_stats": {"id": Field(str)},
    # HTTP API inside the worker: enable with host/port/api_key, or disable
    "server": {"id": Field(str), "enable": Field(bool), "host": _OPT_STR, "port": Field((int, type(None)), False),
               "api_key": _OPT_STR},
    "shutdown": {"id": Field(str)},
}

EVENTS: dict[str, dict[str, Field]] = {
    "hello": REQUESTS["hello"],
    "load_progress": {"id": Field(str), "done": Field(_NUM), "total": Field(_NUM), "stage": Field(str)},
    "loaded": {"id": Field(str), "model_id": Field(str), "model_type": Field(str), "context_length": Field(int),
               "plan": _OPT_DICT},
    "unloaded": {"id": Field(str)},
    # kind text|reasoning: text; kind tool_call: index, call_id and name (first delta of a call), arguments
    "delta": {"id": Field(str), "kind": Field(str), "text": Field(str, required=False),
              "index": Field(int, required=False), "call_id": _OPT_STR, "name": _OPT_STR,
              "arguments": Field(str, required=False)},
    "prefill_progress": {"id": Field(str), "done": Field(int), "total": Field(int)},
    # usage: prompt_tokens, completion_tokens; timings: ttft_s, prefill_tps, decode_tps, total_s
    "done": {"id": Field(str), "finish_reason": Field(str), "usage": Field(dict), "timings": Field(dict)},
    "error": {"id": Field((str, type(None))), "code": Field(str), "message": Field(str)},
    # stats: the engine's stats() plus the service's queue figures
    "stats": {"id": Field((str, type(None))), "stats": Field(dict)},
    "server_state": {"id": Field((str, type(None))), "running": Field(bool), "url": _OPT_STR,
                     "message": _OPT_STR},
    "ok": {"id": Field(str)},     # a request that has no other answer (cancel, subscribe, shutdown) was taken
}


def _check(message: Any, table: dict[str, dict[str, Field]], side: str) -> dict:
    if not isinstance(message, dict):
        raise ProtocolError(f"{side} must be a JSON object, got {type(message).__name__}")
    kind = message.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(f"{side} has no string field 'type'")
    fields = table.get(kind)
    if fields is None:
        raise ProtocolError(f"unknown {side} type {kind!r} (known: {', '.join(sorted(table))})")
    for name, spec in fields.items():
        if name not in message:
            if spec.required:
                raise ProtocolError(f"{side} {kind!r} lacks field {name!r}")
            continue
        value = message[name]
        bad_bool = isinstance(value, bool) and spec.type is not bool and bool not in _types(spec.type)
        if not isinstance(value, spec.type) or bad_bool:
            raise ProtocolError(f"{side} {kind!r} field {name!r} has type {type(value).__name__}, "
                                f"expected {_type_names(spec.type)}")
    if kind == "delta" and message["kind"] not in DELTA_KINDS:
        raise ProtocolError(f"event 'delta' field 'kind' is {message['kind']!r}, expected one of {DELTA_KINDS}")
    if kind == "generate" and (message.get("messages") is None) == (message.get("prompt") is None):
        raise ProtocolError("request 'generate' needs exactly one of 'messages' or 'prompt'")
    return message


def _types(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


def _type_names(t) -> str:
    return " or ".join("null" if x is type(None) else x.__name__ for x in _types(t))


def check_request(message: Any) -> dict:
    """The message if it is a valid request; ProtocolError naming the type and field otherwise."""
    return _check(message, REQUESTS, "request")


def check_event(message: Any) -> dict:
    """The message if it is a valid event; ProtocolError naming the type and field otherwise."""
    return _check(message, EVENTS, "event")


def request(message_type: str, /, **fields) -> dict:
    """A request of type `message_type`, checked before it goes on the wire."""
    return check_request({"type": message_type, **fields})


def event(message_type: str, /, **fields) -> dict:
    """An event of type `message_type`, checked before it goes on the wire (a delta has a field `kind`)."""
    return check_event({"type": message_type, **fields})


def hello(*, version: str | None = None, pid: int | None = None) -> dict:
    return {"type": "hello", "protocol": PROTOCOL_VERSION, "version": version, "pid": pid}


def check_hello(message: dict, *, peer: str) -> None:
    """Raise ProtocolError (code protocol_mismatch) unless `message` is a hello with our version."""
    if message.get("type") != "hello":
        raise ProtocolError(f"the {peer} did not start with 'hello' but with {message.get('type')!r}")
    theirs = message.get("protocol")
    if theirs != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol_mismatch: the {peer} speaks IPC protocol {theirs!r} (version {message.get('version')}), "
            f"this side speaks {PROTOCOL_VERSION}; run the worker from the same FreeToken installation")


def error(request_id: str | None, code: str, message: str) -> dict:
    assert code in ERROR_CODES, code   # our own code, never user input
    return {"type": "error", "id": request_id, "code": code, "message": message}


# ---- frames ----------------------------------------------------------------------------------------------

def encode_frame(message: dict) -> bytes:
    """4-byte big-endian length + UTF-8 JSON (NaN and infinities refused: JSON has no such values)."""
    try:
        body = json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"message {message.get('type')!r} cannot be sent as JSON: {exc}") from exc
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message {message.get('type')!r} is {len(body)} bytes; frames are at most "
                            f"{MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Turns a byte stream, fed in chunks of any size, into messages."""

    def __init__(self, *, max_frame_bytes: int = MAX_FRAME_BYTES):
        self._buffer = bytearray()
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[dict]:
        """Every message completed by `data`. ProtocolError on an oversized frame or a body that is not a
        JSON object: the stream cannot be trusted after that, the caller closes it."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer)
            if length > self._max:
                raise ProtocolError(f"incoming frame announces {length} bytes; frames are at most {self._max}")
            if len(self._buffer) < HEADER.size + length:
                break
            body = bytes(self._buffer[HEADER.size:HEADER.size + length])
            del self._buffer[:HEADER.size + length]
            try:
                message = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ProtocolError(f"incoming frame of {length} bytes is not UTF-8 JSON: {exc}") from exc
            if not isinstance(message, dict):
                raise ProtocolError(f"incoming frame holds a JSON {type(message).__name__}, not an object")
            messages.append(message)
        return messages

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
