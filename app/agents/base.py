"""What every agent target shares: the endpoint it is pointed at and the shape of a target.

A target knows where its agent keeps its config on this platform (honouring the agent's own
home-folder variables), how to merge our settings into the user's text, and which environment
variables do the same job for the "environment only" mode. It never writes files itself:
`app/agents/setup.py` does that, with the diff, backup and undo every target gets.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping


class AgentConfigError(ValueError):
    """The user's existing config cannot be merged safely (it does not parse, or has the wrong shape)."""


@dataclass(frozen=True)
class Endpoint:
    """The FreeToken server an agent should talk to."""
    host: str = "127.0.0.1"
    port: int = 1919
    api_key: str = ""
    model: str = "freetoken"
    context_window: int = 32768
    max_output_tokens: int = 8192

    @property
    def origin(self) -> str:            # Anthropic-style clients append /v1 themselves
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base(self) -> str:       # OpenAI-style clients want the /v1 prefix
        return f"{self.origin}/v1"

    @property
    def token(self) -> str:
        """Clients refuse an empty key; our server ignores the key when none is configured."""
        return self.api_key or "freetoken"


@dataclass(frozen=True)
class Platform:
    """The bits of the environment that decide config paths; injectable so tests cover every OS."""
    system: str = field(default_factory=lambda: {"win32": "windows", "darwin": "macos"}.get(sys.platform, "linux"))
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    @property
    def home(self) -> Path:
        if self.system == "windows":
            return Path(self.env.get("USERPROFILE") or self.env.get("HOME") or Path.home())
        return Path(self.env.get("HOME") or Path.home())

    def xdg_config(self) -> Path:
        """opencode and Crush use ~/.config on every platform unless XDG_CONFIG_HOME says otherwise."""
        return Path(self.env["XDG_CONFIG_HOME"]) if self.env.get("XDG_CONFIG_HOME") else self.home / ".config"


@dataclass(frozen=True)
class AgentTarget:
    name: str                                   # CLI id: claude-code, codex, opencode, ...
    display: str
    wire: str                                   # the API it speaks: messages | responses | chat
    config_path: Callable[[Platform], Path] | None
    merge: Callable[[str | None, Endpoint], str] | None   # existing text (None: no file) -> new text
    env: Callable[[Endpoint], dict[str, str]]
    instructions: Callable[[Endpoint], str]
    configured_model: Callable[[str], str | None] | None = None   # which model the file points at now

    @property
    def writes_config(self) -> bool:
        return self.config_path is not None and self.merge is not None
