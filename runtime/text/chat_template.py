"""The model's own chat template, rendered exactly as transformers' `apply_chat_template` renders it.

Chat templates are Jinja programs written against transformers' environment, so we build the same
one: a sandbox (`ImmutableSandboxedEnvironment`, templates are untrusted), `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` tag that passes its body through,
the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that rejects `_` names, and a
`tojson` filter that is plain `json.dumps` (Jinja's own escapes HTML). Messages are normalised the
same way (keys with None values dropped; reasoning under any of its names is passed as both
`reasoning_content` and `thinking`), and every named special token is a variable.

Where the template lives, in transformers' order: `chat_template.jinja` (and named ones in
`additional_chat_templates/`), else `tokenizer_config.json["chat_template"]`, a string or a list of
`{name, template}`; with several, `tool_use` is chosen when tools are passed, else `default`.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.text.tokenizer import read_tokenizer_config, special_tokens_map

# Names a message's reasoning is passed under; templates read `reasoning_content` (Qwen) or `thinking` (gpt-oss).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, or refused the conversation; the message says which."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering passes it through."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_passthrough"), [], [], body).set_lineno(lineno)

    def _passthrough(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself to the sandbox."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names (a path towards CPython internals)."""

    def __init__(*args, **kwargs):   # jinja's signature trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# ---- inputs as the template sees them ----------------------------------------------------------------------


def _to_plain(value: Any) -> Any:
    """Rebuild inputs from plain JSON types (dataclasses and pydantic models become dicts; str/int subclasses
    lose their extra methods) so that nothing with dangerous methods reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_to_plain(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_plain(value.model_dump())
    if hasattr(value, "item") and callable(value.item):   # numpy / torch scalars
        return _to_plain(value.item())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Messages as apply_chat_template passes them: plain dicts, None-valued keys dropped, reasoning aliased."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation; give at least one message")
    normalized = []
    for position, message in enumerate(_to_plain(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {position} must be a dict with 'role' and 'content', got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def decode_tool_arguments(messages: Sequence[dict]) -> list[dict]:
    """Messages whose tool-call `arguments` given as JSON text (as OpenAI clients send them) become dicts.

    Templates are written for dicts (Qwen3.5 iterates them, gpt-oss `tojson`s them); vLLM does the same
    before rendering. Text that is not a JSON object is left alone. The input is not modified.
    """
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        new_calls = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            holder, key = (call, "function") if isinstance(function, dict) else (None, None)
            target = function if holder is not None else call
            arguments = target.get("arguments") if isinstance(target, dict) else None
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    parsed = None
                if isinstance(parsed, dict):
                    target = {**target, "arguments": parsed}
                    call = {**call, key: target} if holder is not None else target
            new_calls.append(call)
        out.append({**message, "tool_calls": new_calls})
    return out


def _check_tools(tools: Sequence[Any] | None) -> list[dict] | None:
    if tools is None:
        return None
    tools = _to_plain(list(tools))
    for position, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatTemplateError(f"tool {position} must be a JSON schema (a dict), got {type(tool).__name__}")
    return tools


# ---- the template -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template(s) and the special tokens its templates see."""

    templates: dict[str, str]              # name -> Jinja source; "default" when there is one
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    origin: str = "<string>"               # where it came from, for error messages

    @classmethod
    def from_string(cls, source: str, *, special_tokens: dict[str, str] | None = None) -> "ChatTemplate":
        return cls(templates={"default": source}, special_tokens=dict(special_tokens or {}))

    @classmethod
    def from_dir(cls, folder: str | Path) -> "ChatTemplate":
        folder = Path(folder)
        config = read_tokenizer_config(folder)
        templates: dict[str, str] = {}
        origin = str(folder / "chat_template.jinja")
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.stem] = path.read_text(encoding="utf-8")
        if not templates and (folder / "chat_template.json").is_file():   # processor-style exports
            origin = str(folder / "chat_template.json")
            try:
                templates["default"] = json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))[
                    "chat_template"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ChatTemplateError(f"{origin}: no 'chat_template' string in it ({exc})") from exc
        if not templates:
            origin = str(folder / "tokenizer_config.json")
            value = config.get("chat_template")
            if isinstance(value, str):
                templates["default"] = value
            elif isinstance(value, list):
                for entry in value:
                    if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                            and isinstance(entry.get("template"), str)):
                        raise ChatTemplateError(f"{origin}: chat_template list entries need 'name' and 'template'")
                    templates[entry["name"]] = entry["template"]
            elif value is not None:
                raise ChatTemplateError(f"{origin}: chat_template must be a string or a list, "
                                        f"got {type(value).__name__}")
        if not templates:
            raise ChatTemplateError(f"{folder}: the model has no chat template (no chat_template.jinja and none in "
                                    "tokenizer_config.json); use raw prompts instead")
        return cls(templates=templates, special_tokens=special_tokens_map(config), origin=origin)

    def source(self, *, tools: Sequence[Any] | None = None, name: str | None = None) -> str:
        """The Jinja source used for a request (transformers' get_chat_template)."""
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"{self.origin}: no chat template named {name!r} "
                                        f"(have {sorted(self.templates)})")
            return self.templates[name]
        if len(self.templates) == 1 and "default" in self.templates:
            return self.templates["default"]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"{self.origin}: several chat templates ({sorted(self.templates)}) and none is "
                                "'default'; name the one to use")

    def render(self, messages: Sequence[Any], tools: Sequence[Any] | None = None, add_generation_prompt: bool = True,
               *, documents: Sequence[Any] | None = None, template_name: str | None = None, **kwargs) -> str:
        """The prompt text for `messages`, as apply_chat_template(..., tokenize=False) renders it.

        Extra keyword arguments (enable_thinking, reasoning_effort, ...) become template variables; they
        win over the special tokens of the same name.
        """
        source = self.source(tools=tools, name=template_name)
        try:
            template = compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{self.origin}: the chat template is not valid Jinja "
                                    f"(line {exc.lineno}: {exc.message})") from exc
        variables = {**self.special_tokens, **_to_plain(kwargs)}
        try:
            return template.render(messages=normalize_messages(messages), tools=_check_tools(tools),
                                   documents=_to_plain(documents), add_generation_prompt=add_generation_prompt,
                                   **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused this conversation: {exc}") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"the model's chat template failed to render this conversation: "
                                    f"{type(exc).__name__}: {exc}") from exc
