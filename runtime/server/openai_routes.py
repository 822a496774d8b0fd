"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

The Responses API (Codex's wire) is in responses_routes.py. Each route converts its request into the
canonical chat form (runtime/server/prompts.py), starts a job on the engine service, and turns the
job's pieces into the API's own shape with a builder that serves both streaming and non-streaming
answers, so the two can never disagree.
"""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.server import prompts
from runtime.server.context import advertised_id, current_model, new_id, now, service_of
from runtime.server.errors import APIError, error_body, is_anthropic
from runtime.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from runtime.server.streaming import JobStream, sse, sse_response
from runtime.service import Finished, Piece

router = APIRouter()

OPENAI_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


# ---- /v1/models ----

@router.get("/v1/models", summary="List the loaded model (OpenAI or Anthropic shape by headers)")
async def list_models(request: Request):
    service = service_of(request)
    model = service.model
    anthropic = is_anthropic(request.url.path, request.headers)
    models = [model] if model else []
    if anthropic:
        data = [{"type": "model", "id": advertised_id(request, m), "display_name": advertised_id(request, m),
                 "created_at": _iso(m.loaded_at)} for m in models]
        return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}
    return {"object": "list", "data": [_openai_model(request, m) for m in models]}


@router.get("/v1/models/{model_id:path}", summary="One model; any id names the loaded model")
async def get_model(model_id: str, request: Request):
    model = service_of(request).model
    if model is None:
        raise APIError("not_found", f"model {model_id!r} is not loaded (no model is)")
    if is_anthropic(request.url.path, request.headers):
        return {"type": "model", "id": advertised_id(request, model), "display_name": advertised_id(request, model),
                "created_at": _iso(model.loaded_at)}
    return _openai_model(request, model)


def _openai_model(request: Request, model) -> dict:
    return {"id": advertised_id(request, model), "object": "model", "created": int(model.loaded_at),
            "owned_by": "freetoken", "context_length": model.context_length, "max_model_len": model.context_length}


def _iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- chat completions ----

def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI chat messages -> the canonical form (system messages merged, arguments as dicts)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if m.role in ("system", "developer", "user"):
            out.append({"role": m.role, "content": prompts.text_of(m.content, where=where)})
        elif m.role == "assistant":
            msg: dict = {"role": "assistant", "content": prompts.text_of(m.content, where=where)}
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [{"id": tc.id, "type": "function",
                                      "function": {"name": tc.function.name,
                                                   "arguments": prompts.parse_arguments(tc.function.arguments)}}
                                     for tc in m.tool_calls]
            out.append(msg)
        else:   # tool, or the legacy function role
            msg = {"role": "tool", "content": prompts.text_of(m.content, where=where)}
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
            out.append(msg)
    return prompts.merge_system(out)


def chat_tools(body: ChatCompletionRequest) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    tools = []
    for t in body.tools:
        if t.type == "function" and t.function is not None:
            tools.append({"type": "function", "function": t.function.model_dump(exclude_none=True)})
    return tools or None


def refuse_unsupported(body) -> None:
    if body.n not in (None, 1):
        raise APIError("unsupported", "n > 1 is not supported: ask for one choice per request", param="n")
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type not in ("text",):
        raise APIError("unsupported", f"response_format {fmt.type!r} is not supported: FreeToken has no "
                                      f"constrained decoding, so it cannot guarantee the output matches a "
                                      f"schema; describe the format in the prompt instead",
                       param="response_format")


class ChatBuilder:
    """Pieces -> chat.completion chunks (streaming) and the final message (non-streaming)."""

    def __init__(self, *, completion_id: str, model: str, created: int):
        self.id, self.model, self.created = completion_id, model, created
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}

    def chunk(self, delta: dict, finish_reason: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": "freetoken",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                **extra}

    def add(self, piece: Piece) -> dict | None:
        """Record the piece; the chunk delta it makes."""
        if piece.kind == "text":
            self.content.append(piece.text)
            return {"content": piece.text}
        if piece.kind == "reasoning":
            self.reasoning.append(piece.text)
            return {"reasoning_content": piece.text}
        call = self.calls.get(piece.index)
        if call is None:
            call = self.calls[piece.index] = {"id": piece.call_id or new_id("call_"), "type": "function",
                                              "function": {"name": piece.name or "", "arguments": ""}}
            call["function"]["arguments"] += piece.arguments
            return {"tool_calls": [{"index": piece.index, "id": call["id"], "type": "function",
                                    "function": {"name": call["function"]["name"], "arguments": piece.arguments}}]}
        call["function"]["arguments"] += piece.arguments
        if not piece.arguments:
            return None
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]}

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": "".join(self.content) if self.content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return msg


def usage_of(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens}}


def template_kwargs_for_chat(body: ChatCompletionRequest) -> dict:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if body.reasoning_effort in ("none", "minimal"):
            kwargs.setdefault("enable_thinking", False)
    return kwargs


@router.post("/v1/chat/completions", summary="OpenAI chat completions (streaming and not, tools, reasoning)")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    refuse_unsupported(body)
    model = await current_model(request)
    messages = chat_messages(body.messages)
    tools = chat_tools(body)
    text, ids = await prompts.render_and_tokenize(model, messages, tools, template_kwargs_for_chat(body))
    prompts.check_context(model, ids)
    sampling = prompts.sampling_params(
        model, prompt_len=len(ids), max_tokens=body.max_completion_tokens or body.max_tokens, stop=body.stop,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed)
    stream = JobStream(service_of(request)).start(prompt_ids=ids, prompt_text=text, sampling=sampling, tools=tools)
    builder = ChatBuilder(completion_id=new_id("chatcmpl-"), model=body.model or advertised_id(request, model),
                          created=now())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_frames(stream, builder, include_usage), stream)
    if not await stream.collect(request, builder.add):      # the client went away
        return JSONResponse({}, status_code=499)
    return {"id": builder.id, "object": "chat.completion", "created": builder.created, "model": builder.model,
            "system_fingerprint": "freetoken",
            "choices": [{"index": 0, "message": builder.message(), "logprobs": None,
                         "finish_reason": OPENAI_FINISH.get(stream.finished.finish_reason, "stop")}],
            "usage": usage_of(stream.finished), "timings": stream.finished.timings()}


async def _chat_frames(stream: JobStream, builder: ChatBuilder, include_usage: bool) -> AsyncIterator[str]:
    usage_field = {"usage": None} if include_usage else {}
    yield sse(builder.chunk({"role": "assistant", "content": ""}, **usage_field))
    try:
        async for event in stream.events():
            if isinstance(event, Piece):
                delta = builder.add(event)
                if delta:
                    yield sse(builder.chunk(delta, **usage_field))
            elif isinstance(event, Finished):
                yield sse(builder.chunk({}, OPENAI_FINISH.get(event.finish_reason, "stop"), **usage_field))
                if include_usage:
                    yield sse({"id": builder.id, "object": "chat.completion.chunk", "created": builder.created,
                               "model": builder.model, "system_fingerprint": "freetoken", "choices": [],
                               "usage": usage_of(event)})
    except APIError as exc:
        yield sse(error_body(False, exc.kind, exc.message))
    yield sse("[DONE]")


# ---- text completions ----

@router.post("/v1/completions", summary="OpenAI text completions (raw prompt, no chat template)")
async def completions(body: CompletionRequest, request: Request):
    refuse_unsupported(body)
    if body.suffix:
        raise APIError("unsupported", "suffix (fill-in-the-middle) is not supported", param="suffix")
    model = await current_model(request)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        ids = list(prompt)
        vocab = model.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError("invalid_request", f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt")
        text = model.tokenizer.decode(ids)
    else:
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError("unsupported", "send one prompt per request (a list of several is not supported)",
                               param="prompt")
            prompt = prompt[0]
        text = prompt
        ids = prompts.tokenize(model, text)
    if not ids:
        raise APIError("invalid_request", "the prompt is empty", param="prompt")
    prompts.check_context(model, ids, param="prompt")
    sampling = prompts.sampling_params(
        model, prompt_len=len(ids), max_tokens=body.max_tokens or 16, stop=body.stop,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed)
    stream = JobStream(service_of(request)).start(prompt_ids=ids, prompt_text=text, sampling=sampling, parse=False)
    cid, created, name = new_id("cmpl-"), now(), body.model or advertised_id(request, model)

    def chunk(text_piece: str, finish_reason: str | None, **extra) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"text": text_piece, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
                **extra}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def frames():
            try:
                if body.echo:
                    yield sse(chunk(text, None))
                async for event in stream.events():
                    if isinstance(event, Piece) and event.text:
                        yield sse(chunk(event.text, None))
                    elif isinstance(event, Finished):
                        yield sse(chunk("", OPENAI_FINISH.get(event.finish_reason, "stop")))
                        if include_usage:
                            yield sse({"id": cid, "object": "text_completion", "created": created, "model": name,
                                       "choices": [], "usage": usage_of(event)})
            except APIError as exc:
                yield sse(error_body(False, exc.kind, exc.message))
            yield sse("[DONE]")

        return sse_response(frames(), stream)
    pieces = [text] if body.echo else []
    if not await stream.collect(request, lambda piece: pieces.append(piece.text)):
        return JSONResponse({}, status_code=499)
    out = chunk("".join(pieces), OPENAI_FINISH.get(stream.finished.finish_reason, "stop"),
                usage=usage_of(stream.finished))
    out["object"] = "text_completion"
    return out

