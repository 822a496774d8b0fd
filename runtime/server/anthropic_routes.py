"""Anthropic-compatible routes: /v1/messages (also ?beta=true) and /v1/messages/count_tokens.

This is Claude Code's wire. System prompts come as a string, as text blocks, or as `system` messages
inside `messages`: all merged into one. A leading `x-anthropic-billing-header` block changes on every
request and would defeat the prefix cache, so it is dropped. Thinking blocks sent back are accepted
(their text goes back to the template as reasoning_content); tool_result blocks become tool messages.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.server import prompts
from runtime.server.context import advertised_id, current_model, new_id, service_of
from runtime.server.errors import APIError, error_body
from runtime.server.schemas import AnthropicMessage, CountTokensRequest, MessagesRequest
from runtime.server.streaming import JobStream, sse, sse_response
from runtime.service import Finished, Piece

router = APIRouter()

BILLING_HEADER = "x-anthropic-billing-header"
THINKING_SIGNATURE = "freetoken-local"    # opaque; clients echo it back and we ignore it
IGNORED_BLOCKS = ("redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "container_upload", "search_result")


def system_text(system, *, where: str = "system") -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    blocks = list(system)
    if blocks and isinstance(blocks[0].get("text"), str) and blocks[0]["text"].lstrip().startswith(BILLING_HEADER):
        blocks = blocks[1:]
    return prompts.text_of(blocks, where=where)


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        content = prompts.text_of([b for b in content if b.get("type") == "text"], where=f"{where}.content")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return f"Error: {text}" if block.get("is_error") else text


def anthropic_messages(system, messages: list[AnthropicMessage]) -> list[dict]:
    """Anthropic system + messages -> canonical chat messages."""
    out: list[dict] = []
    sys_text = system_text(system)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if m.role == "system":
            out.append({"role": "system", "content": system_text(m.content, where=where)})
            continue
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "user":
            texts: list[str] = []
            for j, block in enumerate(blocks):
                kind = block.get("type")
                if kind == "tool_result":
                    out.append({"role": "tool", "content": _tool_result_text(block, f"{where}[{j}]"),
                                "tool_call_id": block.get("tool_use_id", "")})
                elif kind in IGNORED_BLOCKS:
                    continue
                else:
                    texts.append(prompts.text_of([block], where=f"{where}[{j}:]"))
            if texts or not blocks:
                out.append({"role": "user", "content": "".join(texts)})
        else:
            msg: dict = {"role": "assistant", "content": ""}
            for j, block in enumerate(blocks):
                kind = block.get("type")
                if kind == "text":
                    msg["content"] += prompts.text_of([block], where=f"{where}[{j}:]")
                elif kind == "thinking":
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + str(block.get("thinking", ""))
                elif kind == "tool_use":
                    if not isinstance(block.get("name"), str):
                        raise APIError("invalid_request", f"{where}[{j}].name must be a string")
                    msg.setdefault("tool_calls", []).append(
                        {"id": block.get("id", ""), "type": "function",
                         "function": {"name": block["name"], "arguments": block.get("input") or {}}})
                elif kind in IGNORED_BLOCKS:
                    continue
                else:
                    raise APIError("invalid_request", f"{where}[{j}] has type {kind!r}, which an assistant "
                                                      f"message cannot hold", param=where)
            out.append(msg)
    return prompts.merge_system(out)


def anthropic_tools(tools, tool_choice: dict | None) -> list[dict] | None:
    if not tools or (tool_choice or {}).get("type") == "none":
        return None
    out = []
    for t in tools:
        if t.type not in (None, "custom") and t.input_schema is None:
            continue        # Anthropic-hosted tools (web_search_..., bash_...) that we cannot run
        out.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                      "parameters": t.input_schema or {"type": "object"}}})
    return out or None


def template_kwargs(thinking) -> dict:
    if thinking is None:
        return {}
    if thinking.type == "enabled":
        return {"enable_thinking": True}
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    return {}


async def _prompt(model, body) -> tuple[str, list[int], list[dict] | None]:
    messages = anthropic_messages(body.system, body.messages)
    tools = anthropic_tools(body.tools, getattr(body, "tool_choice", None))
    text, ids = await prompts.render_and_tokenize(model, messages, tools, template_kwargs(body.thinking))
    return text, ids, tools


class MessageBuilder:
    """Pieces -> Anthropic content blocks and their stream events."""

    def __init__(self, *, message_id: str, model: str):
        self.id, self.model = message_id, model
        self.blocks: list[dict] = []
        self.open_kind: str | None = None
        self.open_index: int | None = None      # tool-call index of an open tool_use block
        self.raw_input: dict[int, str] = {}      # block index -> streamed JSON of a tool_use

    @staticmethod
    def event(kind: str, **fields) -> str:
        return sse({"type": kind, **fields}, event=kind)

    def _close(self) -> list[str]:
        if self.open_kind is None:
            return []
        index = len(self.blocks) - 1
        frames = []
        if self.open_kind == "thinking":
            self.blocks[index]["signature"] = THINKING_SIGNATURE
            frames.append(self.event("content_block_delta", index=index,
                                     delta={"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        elif self.open_kind == "tool_use":
            raw = self.raw_input.get(index, "")
            try:
                value = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                value = {"input": raw}      # keep what the model wrote rather than dropping it
            self.blocks[index]["input"] = value if isinstance(value, dict) else {"input": value}
        frames.append(self.event("content_block_stop", index=index))
        self.open_kind = self.open_index = None
        return frames

    def _open(self, kind: str, block: dict) -> list[str]:
        self.blocks.append(block)
        self.open_kind = kind
        start = dict(block)
        if kind == "tool_use":
            start["input"] = {}
        return [self.event("content_block_start", index=len(self.blocks) - 1, content_block=start)]

    def add(self, piece: Piece) -> list[str]:
        frames: list[str] = []
        if piece.kind in ("text", "reasoning"):
            kind = "text" if piece.kind == "text" else "thinking"
            if self.open_kind != kind:
                frames += self._close()
                frames += self._open(kind, {"type": "text", "text": ""} if kind == "text"
                                     else {"type": "thinking", "thinking": "", "signature": ""})
            index = len(self.blocks) - 1
            field = "text" if kind == "text" else "thinking"
            self.blocks[index][field] += piece.text
            frames.append(self.event("content_block_delta", index=index,
                                     delta={"type": f"{field}_delta", field: piece.text}))
            return frames
        if self.open_kind != "tool_use" or self.open_index != piece.index:
            frames += self._close()
            frames += self._open("tool_use", {"type": "tool_use", "id": piece.call_id or new_id("toolu_"),
                                              "name": piece.name or "", "input": {}})
            self.open_index = piece.index
        index = len(self.blocks) - 1
        if piece.arguments:
            self.raw_input[index] = self.raw_input.get(index, "") + piece.arguments
            frames.append(self.event("content_block_delta", index=index,
                                     delta={"type": "input_json_delta", "partial_json": piece.arguments}))
        return frames

    def finish(self) -> list[str]:
        return self._close()


def stop_reason(finished: Finished) -> tuple[str, str | None]:
    if finished.finish_reason == "length":
        return "max_tokens", None
    if finished.finish_reason == "tool_calls":
        return "tool_use", None
    if finished.stop_sequence:
        return "stop_sequence", finished.stop_sequence
    return "end_turn", None


def usage(finished: Finished | None, prompt_tokens: int) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens (the rest)."""
    cached = finished.cached_tokens if finished else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": finished.completion_tokens if finished else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


@router.post("/v1/messages", summary="Anthropic Messages (Claude Code): streaming and not, tools, thinking")
async def messages(body: MessagesRequest, request: Request):
    model = await current_model(request)
    text, ids, tools = await _prompt(model, body)
    prompts.check_context(model, ids)
    sampling = prompts.sampling_params(model, prompt_len=len(ids), max_tokens=body.max_tokens,
                                       stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p,
                                       top_k=body.top_k)
    stream = JobStream(service_of(request)).start(prompt_ids=ids, prompt_text=text, sampling=sampling, tools=tools)
    builder = MessageBuilder(message_id=new_id("msg_"), model=body.model or advertised_id(request, model))
    if body.stream:
        return sse_response(_message_frames(stream, builder, len(ids)), stream)
    if not await stream.collect(request, builder.add):
        return JSONResponse({}, status_code=499)
    builder.finish()
    reason, sequence = stop_reason(stream.finished)
    return {"id": builder.id, "type": "message", "role": "assistant", "model": builder.model,
            "content": builder.blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(stream.finished, len(ids))}


async def _message_frames(stream: JobStream, builder: MessageBuilder, prompt_tokens: int) -> AsyncIterator[str]:
    yield builder.event("message_start", message={
        "id": builder.id, "type": "message", "role": "assistant", "model": builder.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage(None, prompt_tokens)})
    yield builder.event("ping")
    try:
        async for event in stream.events():
            if isinstance(event, Piece):
                for frame in builder.add(event):
                    yield frame
            elif isinstance(event, Finished):
                for frame in builder.finish():
                    yield frame
                reason, sequence = stop_reason(event)
                final = usage(event, prompt_tokens)
                yield builder.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                    usage={k: final[k] for k in ("input_tokens", "cache_read_input_tokens",
                                                                 "output_tokens")})
                yield builder.event("message_stop")
    except APIError as exc:
        yield sse(error_body(True, exc.kind, exc.message), event="error")


@router.post("/v1/messages/count_tokens", summary="Anthropic token count with the model's real chat template")
async def count_tokens(body: CountTokensRequest, request: Request):
    model = await current_model(request)
    _, ids, _ = await _prompt(model, body)
    return {"input_tokens": len(ids)}
