"""A live API server over the real engine on a tiny fixture model, for the API and worker tests.

A random-weight model never writes a tool call or a `<think>` block on its own, so `ScriptedEngine`
— the real Engine, running the real model forward over every token — replaces the *sampled* token by
a scripted one when the prompt names a script (`[[script:NAME]]` anywhere in it). Everything after
sampling (detokenizing, stop strings, EOS, the family's output parser, the API shapes) runs for
real. Without a marker it is the plain Engine.
"""
from __future__ import annotations

import re
import socket
from contextlib import contextmanager
from pathlib import Path

from runtime.engine import Engine
from runtime.server.app import ServerThread, create_app
from runtime.server.context import ServerConfig
from runtime.server.security import SecurityConfig
from runtime.service import LoadOptions, Service

SCRIPT_MARKER = re.compile(r"\[\[script:(\w+)\]\]")

# Outputs in the Qwen3 format (the tiny qwen3_moe fixture's template and parser) and, `harmony_*`, in
# gpt-oss's harmony format; each ends with an end-of-generation token.
SCRIPTS = {
    "weather": '<think>\nThe user asks about the weather, so I call the tool.\n</think>\n\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call><|im_end|>',
    "two_calls": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call><|im_end|>',
    "patch": '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Add File: a.txt\\n'
             '+hello\\n*** End Patch"}}\n</tool_call><|im_end|>',
    "think": "<think>\nLet me think about this carefully.\n</think>\n\nThe answer is 4.<|im_end|>",
    "answer": "It is sunny in Paris, 21 degrees.<|im_end|>",
    "stopword": "one two three STOP four five<|im_end|>",
    "explode": "Starting to answer, then the engine fails",     # see ScriptedEngine._accept
    "harmony_weather": "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
                       "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                       '<|message|>{"city": "Paris"}<|call|>',
    "harmony_answer": "<|channel|>analysis<|message|>Simple arithmetic.<|end|>"
                      "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
}


class ScriptedEngine(Engine):
    """The real engine whose sampled tokens follow a script when the prompt asks for one."""

    scripts: dict[str, list[int]]

    def add_request(self, prompt_ids, sampling=None, **kwargs):
        rid = super().add_request(prompt_ids, sampling, **kwargs)
        if not hasattr(self, "scripts"):
            self.scripts, self._script_names = {}, {}
        found = SCRIPT_MARKER.findall(self.tokenizer.decode(prompt_ids))
        if found:
            self.scripts[rid] = list(self.tokenizer.encode(SCRIPTS[found[-1]]))
            self._script_names[rid] = found[-1]
        return rid

    def _accept(self, seq, token, now):
        script = getattr(self, "scripts", {}).get(seq.request_id)
        if script:
            token = script.pop(0)
        elif script is not None and self._script_names.get(seq.request_id) == "explode":
            raise RuntimeError("simulated engine failure (the explode script ran out)")
        return super()._accept(seq, token, now)


def scripted_loader(path, options: LoadOptions, progress):
    """Service engine loader: an FTW package folder, or a Hugging Face checkpoint folder read directly."""
    path = Path(path)
    kwargs = dict(device=options.device, max_batch=options.max_batch, progress=progress,
                  context_length=options.context_length)
    if (path / "manifest.json").is_file():
        return ScriptedEngine.load(path, **kwargs)
    from tests.engine_fixtures import SafetensorsSource

    return ScriptedEngine.from_package(SafetensorsSource(path), **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(model_path, *, api_key: str | None = None, max_queue: int = 64, context_length: int = 2048,
                max_batch: int = 8, max_body_bytes: int | None = None):
    """A Service with the model loaded and uvicorn serving it on a free loopback port."""
    service = Service(max_queue=max_queue, engine_loader=scripted_loader, stats_interval_s=0.2)
    service.load_sync(model_path, LoadOptions(device="cpu", context_length=context_length, max_batch=max_batch))
    security = SecurityConfig(host="127.0.0.1", api_key=api_key,
                              **({"max_body_bytes": max_body_bytes} if max_body_bytes else {}))
    server = ServerThread(create_app(service, ServerConfig(security=security)), host="127.0.0.1", port=0).start()
    try:
        yield service, server
    finally:
        server.stop()
        service.close()
