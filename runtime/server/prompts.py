"""From an API request to prompt tokens: one canonical chat form, rendered with the model's own template.

The canonical form is what Hugging Face chat templates expect (OpenAI chat messages):
  {"role": "system"|"user"|"assistant"|"tool", "content": str,
   "reasoning_content"?: str, "tool_calls"?: [{"id", "type": "function", "function": {"name", "arguments": dict}}],
   "tool_call_id"?: str}
and tools as [{"type": "function", "function": {"name", "description", "parameters"}}].
Each API's converter lives beside its routes; this module holds what they share: system-message
merging, rendering, tokenizing, and the sampling parameters with the model's own defaults.
"""
from __future__ import annotations

import json
from typing import Any

from runtime.server.errors import APIError
from runtime.service import ModelInfo

# Sampling fields generation_config may carry, which we use when a request does not set them.
_GENERATION_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def text_of(content: Any, *, where: str) -> str:
    """The text of a content value: a string, or a list of text parts (other parts refused by name)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError("invalid_request", f"{where}[{i}].text must be a string", param=where)
            parts.append(text)
        elif kind in ("image", "image_url", "input_image", "input_audio", "file", "input_file", "document"):
            raise APIError("unsupported", f"{where}[{i}] is a {kind!r} part; the loaded model reads text only",
                           param=where)
        else:
            raise APIError("invalid_request", f"{where}[{i}] has unknown content type {kind!r}", param=where)
    return "".join(parts)


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as the templates want them: a dict when the JSON parses, else the raw string."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return value
    return arguments


def merge_system(messages: list[dict]) -> list[dict]:
    """All system (and developer) messages joined into one leading system message: templates accept a
    system prompt only first, and clients now put them anywhere."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer") and m["content"]]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def render(model: ModelInfo, messages: list[dict], tools: list[dict] | None, template_kwargs: dict) -> str:
    if model.chat_template is None:
        raise APIError("invalid_request", f"{model.model_id} has no chat template; use /v1/completions with a "
                                          f"raw prompt")
    try:
        return model.chat_template.render(messages, tools=tools or None, add_generation_prompt=True,
                                          **template_kwargs)
    except Exception as exc:   # a template raising on these messages is the caller's problem to fix
        raise APIError("invalid_request", f"the model's chat template refused these messages: {exc}") from exc


def tokenize(model: ModelInfo, text: str) -> list[int]:
    return list(model.tokenizer.encode(text))


async def render_and_tokenize(model: ModelInfo, messages: list[dict], tools: list[dict] | None,
                              template_kwargs: dict) -> tuple[str, list[int]]:
    """Template and tokenizer off the event loop: an agent's 20K-token prompt takes tens of milliseconds,
    which would stall every other stream's tokens if done on the loop."""
    from starlette.concurrency import run_in_threadpool

    def work():
        text = render(model, messages, tools, template_kwargs)
        return text, tokenize(model, text)

    return await run_in_threadpool(work)


def check_context(model: ModelInfo, prompt_ids: list[int], *, param: str = "messages") -> None:
    if len(prompt_ids) >= model.context_length:
        raise APIError("context_length", f"the prompt is {len(prompt_ids)} tokens, but the model's context is "
                                         f"{model.context_length} tokens", param=param)


def sampling_params(model: ModelInfo, *, prompt_len: int, max_tokens: int | None, stop=None, **given):
    """SamplingParams: the request's values, else generation_config's, else the engine's defaults;
    max_tokens is clamped to what is left of the context (an unset one means 'up to the context')."""
    from runtime.engine import SamplingParams

    room = model.context_length - prompt_len
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    for name in _GENERATION_DEFAULTS:
        if name not in kwargs and isinstance(model.generation_config.get(name), (int, float)):
            kwargs[name] = model.generation_config[name]
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0
    kwargs["max_tokens"] = max(1, min(max_tokens or room, room))
    if isinstance(stop, str):
        stop = [stop]
    if stop:
        kwargs["stop"] = tuple(s for s in stop if s)
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise APIError("invalid_request", f"sampling parameters: {exc}") from exc
