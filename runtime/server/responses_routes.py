"""OpenAI Responses API: /v1/responses, the only wire Codex speaks.

Stateless: every request carries the whole conversation (`previous_response_id` gets a clear 400).
Function tools are offered to the model; Codex's `custom` free-form tools (apply_patch) are offered
as a function with one string parameter `input` and answered as `custom_tool_call`; hosted tools
(web_search, file_search, ...) are dropped, never an error. Streams carry `sequence_number` and end
with `response.completed` / `response.incomplete` / `response.failed`, without `[DONE]`.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.server import prompts
from runtime.server.context import advertised_id, current_model, new_id, now, service_of
from runtime.server.errors import KINDS, APIError
from runtime.server.schemas import ResponsesRequest
from runtime.server.streaming import JobStream, sse, sse_response
from runtime.service import Finished, Piece

router = APIRouter()

CUSTOM_INPUT_SCHEMA = {"type": "object", "properties": {"input": {
    "type": "string", "description": "The raw free-form input for this tool, exactly as the tool expects it."}},
    "required": ["input"]}


def response_tools(tools: list[dict] | None) -> tuple[list[dict], set[str]]:
    """Flat Responses tools -> canonical function tools, and the names of the custom (free-form) ones."""
    out, custom = [], set()
    for i, tool in enumerate(tools or []):
        kind, name = tool.get("type"), tool.get("name")
        if kind not in ("function", "custom"):
            continue                      # hosted tools we cannot run: ignored by design
        if not isinstance(name, str) or not name:
            raise APIError("invalid_request", f"tools[{i}] has no name", param=f"tools[{i}].name")
        description = tool.get("description") or ""
        if kind == "custom":
            custom.add(name)
            fmt = tool.get("format") or {}
            if fmt.get("type") == "grammar" and fmt.get("definition"):
                description += f"\n\nThe input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
            params = CUSTOM_INPUT_SCHEMA
        else:
            params = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": {"name": name, "description": description, "parameters": params}})
    return out, custom


def response_messages(body: ResponsesRequest) -> list[dict]:
    """instructions + input items -> canonical chat messages."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    pending_reasoning: list[str] = []

    def assistant() -> dict:
        """The assistant message that tool calls attach to: the last one if nothing came after it."""
        if messages and messages[-1]["role"] == "assistant":
            return messages[-1]
        msg = {"role": "assistant", "content": ""}
        if pending_reasoning:
            msg["reasoning_content"] = "".join(pending_reasoning)
            pending_reasoning.clear()
        messages.append(msg)
        return msg

    for i, item in enumerate(body.input):
        if not isinstance(item, dict):
            raise APIError("invalid_request", f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError("invalid_request", f"input[{i}].role {role!r} is not user, assistant, system or "
                                                  f"developer", param=f"input[{i}].role")
            text = prompts.text_of(item.get("content"), where=f"input[{i}].content")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id") or item.get("id") or new_id("call_"), item.get("name")
            if not isinstance(name, str):
                raise APIError("invalid_request", f"input[{i}].name must be a string", param=f"input[{i}].name")
            arguments = (prompts.parse_arguments(item.get("arguments", "")) if kind == "function_call"
                         else {"input": item.get("input", "")})
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            text = output if isinstance(output, str) else prompts.text_of(output, where=f"input[{i}].output")
            messages.append({"role": "tool", "content": text, "tool_call_id": item.get("call_id", "")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning.extend(p.get("text", "") for p in parts if isinstance(p, dict))
        # other items (item_reference, web_search_call, ...) refer to state we do not keep: skipped
    return prompts.merge_system(messages)


class ResponseBuilder:
    """Pieces -> Responses output items and their stream events (with sequence numbers)."""

    def __init__(self, *, response_id: str, model: str, body: ResponsesRequest, custom: set[str]):
        self.id, self.model, self.body, self.custom = response_id, model, body, custom
        self.created = now()
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None       # the item being streamed
        self.open_kind: str | None = None
        self.open_index: int | None = None  # tool-call index of the open item
        self.text: list[str] = []

    def event(self, kind: str, **fields) -> str:
        frame = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(frame, event=kind)

    def response(self, status: str, finished: Finished | None = None, error: dict | None = None) -> dict:
        usage = None
        if finished is not None:
            usage = {"input_tokens": finished.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": finished.cached_tokens},
                     "output_tokens": finished.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": finished.prompt_tokens + finished.completion_tokens}
        incomplete = ({"reason": "max_output_tokens"} if finished is not None and finished.finish_reason == "length"
                      else None)
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "usage": usage, "error": error,
                "incomplete_details": incomplete, "instructions": self.body.instructions,
                "max_output_tokens": self.body.max_output_tokens, "metadata": {},
                "parallel_tool_calls": self.body.parallel_tool_calls if self.body.parallel_tool_calls is not None
                else True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
                "store": False, "temperature": self.body.temperature, "top_p": self.body.top_p,
                "text": {"format": {"type": "text"}}, "tool_choice": self.body.tool_choice or "auto",
                "tools": self.body.tools or [], "truncation": "disabled"}

    def _close(self) -> list[str]:
        item, kind, out_index = self.open, self.open_kind, len(self.output) - 1
        if item is None:
            return []
        self.open = self.open_kind = self.open_index = None
        frames = []
        if kind == "message":
            part = item["content"][0]
            frames.append(self.event("response.output_text.done", item_id=item["id"], output_index=out_index,
                                     content_index=0, text=part["text"], logprobs=[]))
            frames.append(self.event("response.content_part.done", item_id=item["id"], output_index=out_index,
                                     content_index=0, part=part))
        elif kind == "reasoning":
            part = item["content"][0]
            frames.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=out_index,
                                     content_index=0, text=part["text"]))
            frames.append(self.event("response.content_part.done", item_id=item["id"], output_index=out_index,
                                     content_index=0, part=part))
        elif kind == "function_call":
            frames.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=out_index, name=item["name"], arguments=item["arguments"]))
        elif kind == "custom_tool_call":
            raw = item.pop("_raw")
            try:
                value = json.loads(raw) if raw.strip() else {}
                item["input"] = value.get("input", "") if isinstance(value, dict) else str(value)
            except json.JSONDecodeError:
                item["input"] = raw      # the model wrote the input bare: take it as it is
            if not isinstance(item["input"], str):
                item["input"] = json.dumps(item["input"], ensure_ascii=False)
            frames.append(self.event("response.custom_tool_call_input.delta", item_id=item["id"],
                                     output_index=out_index, delta=item["input"]))
            frames.append(self.event("response.custom_tool_call_input.done", item_id=item["id"],
                                     output_index=out_index, input=item["input"]))
        item["status"] = "completed"
        frames.append(self.event("response.output_item.done", output_index=out_index, item=item))
        return frames

    def _open(self, kind: str, item: dict) -> list[str]:
        self.output.append(item)
        self.open, self.open_kind = item, kind
        out_index = len(self.output) - 1
        frames = [self.event("response.output_item.added", output_index=out_index,
                             item={**{k: v for k, v in item.items() if k != "_raw"}, "status": "in_progress"})]
        if kind in ("message", "reasoning"):
            frames.append(self.event("response.content_part.added", item_id=item["id"], output_index=out_index,
                                     content_index=0, part={**item["content"][0], "text": ""}))
        return frames

    def add(self, piece: Piece) -> list[str]:
        frames: list[str] = []
        out_index = len(self.output) - 1
        if piece.kind in ("text", "reasoning"):
            kind = "message" if piece.kind == "text" else "reasoning"
            if self.open_kind != kind:
                frames += self._close()
                if kind == "message":
                    item = {"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
                else:
                    item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "status": "completed",
                            "content": [{"type": "reasoning_text", "text": ""}]}
                frames += self._open(kind, item)
                out_index = len(self.output) - 1
            self.open["content"][0]["text"] += piece.text
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            frames.append(self.event(name, item_id=self.open["id"], output_index=out_index, content_index=0,
                                     delta=piece.text, **extra))
            return frames
        # a tool call: a new index opens a new item
        if self.open_index != piece.index or self.open_kind not in ("function_call", "custom_tool_call"):
            frames += self._close()
            name = piece.name or ""
            call_id = piece.call_id or new_id("call_")
            if name in self.custom:
                item = {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": call_id, "name": name,
                        "input": "", "status": "completed", "_raw": ""}
                frames += self._open("custom_tool_call", item)
            else:
                item = {"type": "function_call", "id": new_id("fc_"), "call_id": call_id, "name": name,
                        "arguments": "", "status": "completed"}
                frames += self._open("function_call", item)
            self.open_index = piece.index
            out_index = len(self.output) - 1
        if piece.arguments:
            if self.open_kind == "custom_tool_call":
                self.open["_raw"] += piece.arguments     # decoded from its JSON wrapper when it closes
            else:
                self.open["arguments"] += piece.arguments
                frames.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=out_index, delta=piece.arguments))
        return frames

    def finish(self) -> list[str]:
        return self._close()


def _refuse(body: ResponsesRequest) -> None:
    if body.previous_response_id:
        raise APIError("unsupported", "previous_response_id is not supported: this server keeps no state; send the "
                                      "whole conversation in `input` (Codex does)", param="previous_response_id")
    fmt = (body.text.format or {}) if body.text else {}
    if fmt.get("type") not in (None, "text"):
        raise APIError("unsupported", f"text.format {fmt.get('type')!r} is not supported: FreeToken has no "
                                      f"constrained decoding; describe the format in the prompt instead",
                       param="text.format")


@router.post("/v1/responses", summary="OpenAI Responses (Codex): streaming and not, function and custom tools")
async def responses(body: ResponsesRequest, request: Request):
    _refuse(body)
    model = await current_model(request)
    tools, custom = response_tools(body.tools)
    if body.tool_choice == "none":
        tools = []
    messages = response_messages(body)
    if not messages:
        raise APIError("invalid_request", "input is empty", param="input")
    kwargs = {}
    effort = body.reasoning.effort if body.reasoning else None
    if effort:
        kwargs["reasoning_effort"] = effort
        if effort in ("none", "minimal"):
            kwargs["enable_thinking"] = False
    text, ids = await prompts.render_and_tokenize(model, messages, tools, kwargs)
    prompts.check_context(model, ids, param="input")
    sampling = prompts.sampling_params(model, prompt_len=len(ids), max_tokens=body.max_output_tokens,
                                       temperature=body.temperature, top_p=body.top_p)
    stream = JobStream(service_of(request)).start(prompt_ids=ids, prompt_text=text, sampling=sampling, tools=tools)
    builder = ResponseBuilder(response_id=new_id("resp_"), model=body.model or advertised_id(request, model),
                              body=body, custom=custom)
    if body.stream:
        return sse_response(_response_frames(stream, builder), stream)
    if not await stream.collect(request, builder.add):
        return JSONResponse({}, status_code=499)
    builder.finish()
    status = "incomplete" if stream.finished.finish_reason == "length" else "completed"
    return _public(builder.response(status, stream.finished))


def _public(response: dict) -> dict:
    for item in response["output"]:
        item.pop("_raw", None)
    return response


async def _response_frames(stream: JobStream, builder: ResponseBuilder) -> AsyncIterator[str]:
    yield builder.event("response.created", response=builder.response("in_progress"))
    yield builder.event("response.in_progress", response=builder.response("in_progress"))
    try:
        async for event in stream.events():
            if isinstance(event, Piece):
                for frame in builder.add(event):
                    yield frame
            elif isinstance(event, Finished):
                for frame in builder.finish():
                    yield frame
                if event.finish_reason == "length":
                    yield builder.event("response.incomplete", response=_public(builder.response("incomplete", event)))
                else:
                    yield builder.event("response.completed", response=_public(builder.response("completed", event)))
    except APIError as exc:
        error = {"code": KINDS[exc.kind].code_openai or "server_error", "message": exc.message}
        yield builder.event("response.failed", response=_public(builder.response("failed", error=error)))
