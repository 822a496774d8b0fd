"""Turning a model's streamed output into text, reasoning and tool calls, incrementally.

Each family marks reasoning and tool calls its own way:
- Qwen: `<think>...</think>` (the prompt may already have opened it) and
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, or in Qwen3.5 / Qwen3-Coder the XML form
  `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`. One parser reads
  both tool forms: what follows `<tool_call>` tells which. A bare `<function=...>` block (the wrapper
  forgotten) is a call too.
- gpt-oss (harmony): messages `<|start|>assistant<|channel|>analysis<|message|>...<|end|>`; the
  `analysis` channel is reasoning, `final` is the answer, and `commentary to=functions.NAME` with a
  `<|call|>` end is a tool call whose body is the JSON arguments.
- Mixtral: plain text.

Parsers are fed text deltas (any split: per token, per character, all at once) and return `Delta`s;
the concatenated result is the same whatever the split, because a decision is made only once the
buffered text settles it: text that might be the start of a marker is held back. Tool calls are
buffered until they close and are checked; a malformed one degrades to plain text, never an error.
Whitespace at the edges of a reasoning block and around tool calls is dropped, as the templates add it.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

QWEN_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen2_moe"})
HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})


@dataclass(frozen=True)
class Delta:
    """One piece of parsed output. Tool calls: the first delta of an index carries id and name, later ones
    carry argument text (append `arguments` of every delta of that index)."""

    kind: str                 # "text" | "reasoning" | "tool_call"
    text: str = ""
    index: int = 0            # tool-call number within the response
    id: str = ""
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def safe_prefix_length(buffer: str, markers: Sequence[str]) -> int:
    """How much of `buffer` can be released: all but the longest suffix that could begin a marker."""
    hold = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(buffer)), hold, -1):
            if buffer.endswith(marker[:length]):
                hold = length
                break
    return len(buffer) - hold


def find_first(buffer: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """Earliest occurrence of any marker: (index, marker), or (-1, None)."""
    best, found = -1, None
    for marker in markers:
        i = buffer.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    return best, found


class _Trimmed:
    """A stream of one kind whose whitespace at block edges is dropped: leading whitespace when a block
    opens, trailing whitespace when it closes. Trailing whitespace is held until later text proves it inner."""

    def __init__(self, kind: str, *, trim: bool = True):
        self.kind, self.trim = kind, trim
        self._at_start, self._pending = True, ""

    def add(self, text: str) -> list[Delta]:
        if not self.trim:
            return [Delta(self.kind, text)] if text else []
        if self._at_start:
            text = text.lstrip()
            if not text:
                return []
            self._at_start = False
        text = self._pending + text
        body = text.rstrip()
        self._pending = text[len(body):]
        return [Delta(self.kind, body)] if body else []

    def close_block(self) -> None:
        """The block ended at a marker: its trailing whitespace goes, the next block starts fresh."""
        self._at_start, self._pending = True, ""

    def release(self) -> list[Delta]:
        """End of the response: trailing whitespace of unfinished text is kept."""
        pending, self._pending = self._pending, ""
        return [Delta(self.kind, pending)] if pending else []


class OutputParser(ABC):
    """Common interface: feed(text) -> deltas, finish() -> deltas."""

    def __init__(self, *, tools: Sequence[dict] | None = None):
        self.tools = list(tools or [])
        self._buffer = ""
        self._next_index = 0
        self._finished = False

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("the parser has finished; make a new one for a new response")
        self._buffer += text
        return self._process(final=False)

    def finish(self) -> list[Delta]:
        if self._finished:
            return []
        out = self._process(final=True)
        self._finished = True
        return out

    @abstractmethod
    def _process(self, *, final: bool) -> list[Delta]:
        """Consume what the buffer settles (everything when `final`) and return the deltas."""

    def _tool_call(self, name: str, arguments: str) -> list[Delta]:
        index, self._next_index = self._next_index, self._next_index + 1
        call_id = new_call_id()
        return [Delta("tool_call", index=index, id=call_id, name=name),
                Delta("tool_call", index=index, id=call_id, arguments=arguments)]

    def _schema_of(self, function: str) -> dict:
        for tool in self.tools:
            spec = tool.get("function", tool) if isinstance(tool, dict) else {}
            if isinstance(spec, dict) and spec.get("name") == function:
                params = spec.get("parameters") or {}
                return params.get("properties") or {} if isinstance(params, dict) else {}
        return {}


class PlainParser(OutputParser):
    """Families without reasoning or tool markers (Mixtral): everything is text."""

    def _process(self, *, final: bool) -> list[Delta]:
        text, self._buffer = self._buffer, ""
        return [Delta("text", text)] if text else []


# ---- Qwen ---------------------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# Qwen3-Coder / Qwen3.5 sometimes drop the <tool_call> wrapper and write the function block bare (vLLM's
# qwen3_coder parser accepts that too); such a block runs to </function>.
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
_XML_FUNCTION = re.compile(r"\s*<function=([^<>\s]+)>(.*?)(?:</function>\s*)?\Z", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the prompt's final assistant turn already opened a <think> block that is not closed."""
    tail = prompt_text[prompt_text.rfind("<|im_start|>"):] if "<|im_start|>" in prompt_text else prompt_text
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


class QwenParser(OutputParser):
    """`<think>` reasoning and `<tool_call>` calls, JSON or XML-function form."""

    def __init__(self, *, prompt_text: str = "", tools: Sequence[dict] | None = None):
        super().__init__(tools=tools)
        self._state = "reasoning" if prompt_opens_think(prompt_text) else "text"
        self._text = _Trimmed("text")
        self._reasoning = _Trimmed("reasoning")
        self._tool_body = ""
        self._tool_open, self._tool_close = TOOL_OPEN, TOOL_CLOSE   # the markers of the call being read

    def _process(self, *, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._state == "tool":
                index, _ = find_first(self._buffer, [self._tool_close])
                if index < 0:
                    cut = len(self._buffer) if final else safe_prefix_length(self._buffer, [self._tool_close])
                    self._tool_body += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    if final:
                        out += self._end_tool_call(closed=False)
                    return out
                self._tool_body += self._buffer[:index]
                self._buffer = self._buffer[index + len(self._tool_close):]
                out += self._end_tool_call(closed=True)
                continue
            stream = self._text if self._state == "text" else self._reasoning
            markers = [THINK_OPEN, THINK_CLOSE, TOOL_OPEN, FUNCTION_OPEN] if self._state == "text" else [THINK_CLOSE]
            index, marker = find_first(self._buffer, markers)
            if marker is None:
                cut = len(self._buffer) if final else safe_prefix_length(self._buffer, markers)
                out += stream.add(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                if final:
                    out += stream.release()
                return out
            out += stream.add(self._buffer[:index])
            self._buffer = self._buffer[index + len(marker):]
            if marker not in (TOOL_OPEN, FUNCTION_OPEN):   # whitespace before a call goes only if it is valid
                stream.close_block()
            if marker == THINK_OPEN:
                self._state = "reasoning"
            elif marker == THINK_CLOSE:
                self._state = "text"      # in text mode a stray </think> is dropped
            else:
                self._state, self._tool_body = "tool", ""
                self._tool_open, self._tool_close = ((TOOL_OPEN, TOOL_CLOSE) if marker == TOOL_OPEN
                                                     else (FUNCTION_OPEN, FUNCTION_CLOSE))

    def _end_tool_call(self, *, closed: bool) -> list[Delta]:
        body, self._tool_body = self._tool_body, ""
        self._state = "text"
        bare = self._tool_open == FUNCTION_OPEN
        call = self._parse_xml_call(FUNCTION_OPEN + body + FUNCTION_CLOSE) if bare else self._parse_call(body)
        if call is not None:
            self._text.close_block()
            return self._tool_call(*call)
        # Not a tool call after all: show it as the model wrote it.
        return self._text.add(self._tool_open + body + (self._tool_close if closed else ""))

    def _parse_call(self, body: str) -> tuple[str, str] | None:
        stripped = body.strip()
        if stripped.startswith("<function="):
            return self._parse_xml_call(stripped)
        return parse_json_call(stripped)

    def _parse_xml_call(self, body: str) -> tuple[str, str] | None:
        match = _XML_FUNCTION.match(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if not name or inner.strip() and not inner.strip().startswith("<parameter="):
            return None
        schema = self._schema_of(name)
        arguments: dict[str, Any] = {}
        for param, raw in _XML_PARAMETER.findall(inner):
            arguments[param.strip()] = convert_parameter(_strip_one_newline(raw), schema.get(param.strip()))
        return name, json.dumps(arguments, ensure_ascii=False)


def _strip_one_newline(value: str) -> str:
    """The XML form puts each value on its own lines; one newline on each side belongs to the markup."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def convert_parameter(value: str, schema: dict | None) -> Any:
    """An XML parameter's text as the JSON value the tool's schema asks for (strings stay strings)."""
    kind = (schema or {}).get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):   # ["string", "null"] and the like
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return value
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, ValueError):
        return value
    if kind is None:
        return parsed if not isinstance(parsed, str) else value
    if kind in ("integer", "number") and isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        return parsed
    if kind == "boolean" and isinstance(parsed, bool):
        return parsed
    if kind == "object" and isinstance(parsed, dict) or kind == "array" and isinstance(parsed, list):
        return parsed
    if kind == "null" and parsed is None:
        return None
    return value


def parse_json_call(body: str) -> tuple[str, str] | None:
    """`{"name": ..., "arguments": {...}}` -> (name, arguments as JSON text), or None when it is not one."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, ValueError):
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


# ---- gpt-oss harmony ----------------------------------------------------------------------------------------

H_START, H_END, H_MESSAGE, H_CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
H_RETURN, H_CALL, H_CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
_H_MESSAGE_ENDS = (H_END, H_CALL, H_RETURN, H_START)
MAX_HEADER_CHARS = 256   # a header longer than this is not a header: the model is writing plain text
_H_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_.\-]+)")
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(OutputParser):
    """gpt-oss's harmony messages: analysis -> reasoning, final -> text, commentary to=functions.X -> tool call."""

    def __init__(self, *, prompt_text: str = "", tools: Sequence[dict] | None = None):
        super().__init__(tools=tools)
        self._reasoning = _Trimmed("reasoning", trim=False)
        self._text = _Trimmed("text", trim=False)
        self._state, self._channel, self._recipient, self._call_body = "header", None, None, ""
        # The generation prompt ends inside an assistant header ("<|start|>assistant"): continue it.
        # Those characters came from the prompt, so they are never shown as output.
        tail = prompt_text[prompt_text.rfind(H_START) + len(H_START):] if H_START in prompt_text else ""
        self._from_prompt = 0
        if tail and not any(end in tail for end in (H_END, H_CALL, H_RETURN)):
            self._buffer, self._from_prompt = tail, len(tail)
            self._process(final=False)

    def _process(self, *, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._state == "header":
                if not self._read_header(final):
                    if final and self._buffer:
                        out += self._text.add(self._buffer[self._from_prompt:])
                        self._buffer, self._from_prompt = "", 0
                    return out
                continue
            # In a message body: up to its end marker.
            index, marker = find_first(self._buffer, _H_MESSAGE_ENDS)
            if marker is None:
                cut = len(self._buffer) if final else safe_prefix_length(self._buffer, _H_MESSAGE_ENDS)
                out += self._body(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                if final:
                    out += self._end_message(marker=None)
                return out
            out += self._body(self._buffer[:index])
            self._buffer = self._buffer[index + (0 if marker == H_START else len(marker)):]
            out += self._end_message(marker=marker)

    def _read_header(self, final: bool) -> bool:
        """Consume a header up to <|message|> if the buffer holds one; False when more text is needed."""
        message = self._buffer.find(H_MESSAGE)
        start = self._buffer.rfind(H_START, 0, message if message >= 0 else len(self._buffer))
        if start >= 0:   # a new message starts: its header follows <|start|>
            self._buffer, self._from_prompt = self._buffer[start + len(H_START):], 0
        index = self._buffer.find(H_MESSAGE)
        if 0 <= index <= MAX_HEADER_CHARS:
            header, self._buffer = self._buffer[:index], self._buffer[index + len(H_MESSAGE):]
            channel = _H_CHANNEL_NAME.search(header)
            recipient = _H_RECIPIENT.search(header)
            self._channel = channel.group(1) if channel else None
            self._recipient = recipient.group(1) if recipient else None
            self._state, self._call_body, self._from_prompt = "body", "", 0
            return True
        if index > MAX_HEADER_CHARS or (index < 0 and len(self._buffer) > MAX_HEADER_CHARS):
            # Not harmony at all (a model that ignores the format): plain text from here on.
            self._buffer, self._from_prompt = self._buffer[self._from_prompt:], 0
            self._channel, self._recipient, self._state = "final", None, "body"
            return True
        return False

    def _is_call(self) -> bool:
        return self._recipient is not None and self._recipient != "user"

    def _body(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self._is_call():
            self._call_body += text
            return []
        if self._channel == "analysis":
            return self._reasoning.add(text)
        return self._text.add(text)

    def _end_message(self, *, marker: str | None) -> list[Delta]:
        out: list[Delta] = []
        if self._is_call():
            name = self._recipient.removeprefix("functions.")
            body = self._call_body.strip()
            try:
                json.loads(body)
                valid = bool(name)
            except (json.JSONDecodeError, ValueError):
                valid = False
            if valid:
                out += self._tool_call(name, body)
            else:
                out += self._text.add(self._call_body)
        self._state, self._channel, self._recipient, self._call_body = "header", None, None, ""
        return out


def make_output_parser(model_type: str, prompt_text: str = "", *, tools: Sequence[dict] | None = None) -> OutputParser:
    """The parser for a family's output; `prompt_text` tells whether the prompt already opened a block."""
    if model_type in QWEN_MODEL_TYPES:
        return QwenParser(prompt_text=prompt_text, tools=tools)
    if model_type in HARMONY_MODEL_TYPES:
        return HarmonyParser(prompt_text=prompt_text, tools=tools)
    return PlainParser(tools=tools)


def collect(deltas: Sequence[Delta]) -> dict:
    """Fold deltas into {"text", "reasoning", "tool_calls": [{"id", "name", "arguments"}]}: the whole response."""
    result: dict[str, Any] = {"text": "", "reasoning": "", "tool_calls": []}
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta.kind == "text":
            result["text"] += delta.text
        elif delta.kind == "reasoning":
            result["reasoning"] += delta.text
        else:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": None, "arguments": ""})
            if delta.name is not None:
                call["name"] = delta.name
            call["arguments"] += delta.arguments
    result["tool_calls"] = [calls[i] for i in sorted(calls)]
    return result
