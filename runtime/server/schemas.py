"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models.

Every model accepts unknown fields (clients add new ones every month and must not be refused for it)
and types the ones we read, so a wrong type is a 400 naming the field, not a crash later. Content
parts are kept as dicts: their variety is large and each route reads only the kinds it understands.
Bounds (`ge`, `le`) are those of the official APIs.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- OpenAI chat completions ----

class FunctionCall(Open):
    name: str
    arguments: Union[str, dict[str, Any]] = ""


class ToolCall(Open):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(Open):
    type: str = "function"
    function: FunctionDef | None = None


class StreamOptions(Open):
    include_usage: bool = False


class ResponseFormat(Open):
    type: str
    json_schema: dict[str, Any] | None = None


class SamplingFields(Open):
    """Sampling fields shared by chat and text completions (OpenAI names plus the common extensions)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)


class ChatCompletionRequest(SamplingFields):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    model: str = ""
    prompt: Union[str, list[str], list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None


# ---- OpenAI responses ----

class ResponsesReasoning(Open):
    effort: str | None = None
    summary: str | None = None


class ResponsesText(Open):
    format: dict[str, Any] | None = None


class ResponsesRequest(Open):
    model: str = ""
    instructions: str | None = None
    input: Union[str, list[dict[str, Any]]] = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponsesReasoning | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    text: ResponsesText | None = None


# ---- Anthropic messages ----

class AnthropicMessage(Open):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict[str, Any]]]


class AnthropicTool(Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ThinkingConfig(Open):
    type: str
    budget_tokens: int | None = None


class MessagesRequest(Open):
    model: str = ""
    messages: list[AnthropicMessage]
    max_tokens: int = Field(ge=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None


class CountTokensRequest(Open):
    model: str = ""
    messages: list[AnthropicMessage]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[AnthropicTool] | None = None
    thinking: ThinkingConfig | None = None
