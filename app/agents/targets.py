"""The agents FreeToken can set up, and the exact settings each one reads (../shared/api-contracts.md)."""
from __future__ import annotations

import json
from pathlib import Path

import tomlkit
from tomlkit.exceptions import ParseError as TomlParseError

from app.agents.base import AgentConfigError, AgentTarget, Endpoint, Platform

PROVIDER_ID = "freetoken"
LONG_TIMEOUT_MS = "3000000"     # local prefill of a 20K-token agent prompt can take minutes on a small GPU


def _load_json_object(text: str | None, what: str) -> dict:
    if text is None or not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AgentConfigError(f"{what} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                               "fix it or move it aside, then try again — nothing was changed") from exc
    if not isinstance(data, dict):
        raise AgentConfigError(f"{what} should hold a JSON object, not {type(data).__name__}; nothing was changed")
    return data


def _dump_json(data: dict) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _sub_object(data: dict, key: str, what: str) -> dict:
    value = data.setdefault(key, {})
    if not isinstance(value, dict):
        raise AgentConfigError(f"{what}: `{key}` should be an object, not {type(value).__name__}; nothing was changed")
    return value


# --- Claude Code: the env block of ~/.claude/settings.json -------------------------------------

def claude_env(ep: Endpoint) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": ep.origin,                 # no /v1: the client appends it
        "ANTHROPIC_AUTH_TOKEN": ep.token,
        "ANTHROPIC_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": ep.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ep.model,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",           # keeps the prompt prefix stable: prefix cache hits
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": LONG_TIMEOUT_MS,
    }


def claude_path(p: Platform) -> Path:
    root = p.env.get("CLAUDE_CONFIG_DIR")
    return (Path(root) if root else p.home / ".claude") / "settings.json"


def claude_merge(text: str | None, ep: Endpoint) -> str:
    data = _load_json_object(text, "Claude Code settings.json")
    _sub_object(data, "env", "Claude Code settings.json").update(claude_env(ep))
    return _dump_json(data)


def claude_model(text: str) -> str | None:
    env = _load_json_object(text, "Claude Code settings.json").get("env") or {}
    return env.get("ANTHROPIC_MODEL")


# --- Codex CLI: ~/.codex/config.toml -----------------------------------------------------------

def codex_path(p: Platform) -> Path:
    root = p.env.get("CODEX_HOME")
    return (Path(root) if root else p.home / ".codex") / "config.toml"


def _parse_toml(text: str | None):
    try:
        return tomlkit.parse(text or "")
    except TomlParseError as exc:
        raise AgentConfigError(f"Codex config.toml does not parse ({exc}); fix it or move it aside, "
                               "then try again — nothing was changed") from exc


def codex_merge(text: str | None, ep: Endpoint) -> str:
    doc = _parse_toml(text)
    # Root keys: tomlkit keeps them above the first table, where TOML needs them.
    doc["model"] = ep.model
    doc["model_provider"] = PROVIDER_ID          # overriding the built-in `openai` provider is ignored by Codex
    doc["model_context_window"] = ep.context_window
    providers = doc.get("model_providers")
    if providers is None:
        providers = tomlkit.table(is_super_table=True)
        doc["model_providers"] = providers
    elif not isinstance(providers, dict):
        raise AgentConfigError("Codex config.toml: `model_providers` should be a table; nothing was changed")
    provider = tomlkit.table()
    provider["name"] = "FreeToken"
    provider["base_url"] = ep.openai_base
    provider["wire_api"] = "responses"           # Codex speaks nothing else now
    provider["env_key"] = "FREETOKEN_API_KEY"
    providers[PROVIDER_ID] = provider
    return tomlkit.dumps(doc)


def codex_env(ep: Endpoint) -> dict[str, str]:
    return {"FREETOKEN_API_KEY": ep.token}


def codex_model(text: str) -> str | None:
    model = _parse_toml(text).get("model")
    return str(model) if model is not None else None


# --- opencode: ~/.config/opencode/opencode.json ------------------------------------------------

def opencode_path(p: Platform) -> Path:
    return p.xdg_config() / "opencode" / "opencode.json"


def opencode_merge(text: str | None, ep: Endpoint) -> str:
    data = _load_json_object(text, "opencode.json")
    data.setdefault("$schema", "https://opencode.ai/config.json")
    providers = _sub_object(data, "provider", "opencode.json")
    providers[PROVIDER_ID] = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "FreeToken",
        "options": {"baseURL": ep.openai_base, "apiKey": ep.token},
        "models": {ep.model: {"name": ep.model,
                              "limit": {"context": ep.context_window, "output": ep.max_output_tokens}}},
    }
    data["model"] = f"{PROVIDER_ID}/{ep.model}"
    return _dump_json(data)


def opencode_model(text: str) -> str | None:
    model = _load_json_object(text, "opencode.json").get("model")
    return model.split("/", 1)[1] if isinstance(model, str) and model.startswith(PROVIDER_ID + "/") else model


# --- Crush: ~/.config/crush/crush.json ---------------------------------------------------------

def crush_path(p: Platform) -> Path:
    return p.xdg_config() / "crush" / "crush.json"


def crush_merge(text: str | None, ep: Endpoint) -> str:
    data = _load_json_object(text, "crush.json")
    providers = _sub_object(data, "providers", "crush.json")
    providers[PROVIDER_ID] = {
        "name": "FreeToken", "type": "openai-compat", "base_url": ep.openai_base, "api_key": ep.token,
        "models": [{"id": ep.model, "name": ep.model, "context_window": ep.context_window,
                    "default_max_tokens": ep.max_output_tokens}],
    }
    return _dump_json(data)


def crush_model(text: str) -> str | None:
    prov = (_load_json_object(text, "crush.json").get("providers") or {}).get(PROVIDER_ID) or {}
    models = prov.get("models") or []
    return models[0].get("id") if models else None


# --- env-only and instruction agents ----------------------------------------------------------

def openai_env(ep: Endpoint) -> dict[str, str]:
    return {"OPENAI_BASE_URL": ep.openai_base, "OPENAI_API_BASE": ep.openai_base, "OPENAI_API_KEY": ep.token,
            "OPENAI_MODEL": ep.model}


def _instructions(lines: list[str]):
    return lambda ep: "\n".join(line.format(ep=ep) for line in lines)


AGENTS: tuple[AgentTarget, ...] = (
    AgentTarget("claude-code", "Claude Code", "messages", claude_path, claude_merge, claude_env,
                _instructions(["Writes the `env` block of Claude Code's settings.json; run `claude` as usual."]),
                claude_model),
    AgentTarget("codex", "Codex CLI", "responses", codex_path, codex_merge, codex_env,
                _instructions(["Adds a `freetoken` provider to Codex's config.toml and makes it the default.",
                               "Codex reads the key from FREETOKEN_API_KEY (any value works without an API key)."]),
                codex_model),
    AgentTarget("opencode", "opencode", "chat", opencode_path, opencode_merge, lambda ep: {},
                _instructions(["Adds a `freetoken` provider (@ai-sdk/openai-compatible) to opencode.json and "
                               "selects it."]), opencode_model),
    AgentTarget("crush", "Crush", "chat", crush_path, crush_merge, lambda ep: {},
                _instructions(["Adds a `freetoken` openai-compat provider to crush.json; pick "
                               "{ep.model} in Crush's model menu."]), crush_model),
    AgentTarget("aider", "Aider", "chat", None, None, openai_env,
                _instructions(["Set the environment below, then run: aider --model openai/{ep.model}"])),
    AgentTarget("qwen-code", "Qwen Code", "chat", None, None, openai_env,
                _instructions(["Set the environment below, then run: qwen"])),
    AgentTarget("continue", "Continue", "chat", None, None, lambda ep: {},
                _instructions(["In ~/.continue/config.yaml add under `models:`:",
                               "  - name: FreeToken {ep.model}",
                               "    provider: openai",
                               "    model: {ep.model}",
                               "    apiBase: {ep.openai_base}",
                               "    apiKey: {ep.token}"])),
    AgentTarget("cline", "Cline", "chat", None, None, lambda ep: {},
                _instructions(["In Cline's settings choose API Provider \"OpenAI Compatible\",",
                               "Base URL {ep.openai_base}, API Key {ep.token}, Model ID {ep.model}."])),
)
BY_NAME = {a.name: a for a in AGENTS}


def get_agent(name: str) -> AgentTarget:
    try:
        return BY_NAME[name]
    except KeyError:
        raise AgentConfigError(f"unknown agent {name!r}; known: {', '.join(BY_NAME)}") from None
